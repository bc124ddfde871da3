//! What `pyberth run --output` may write on the host: the policy of the copy back, apart from
//! the tar plumbing of `archive.rs`. Files coming back are the sandbox's choice; the host's
//! directory is often a checkout, where some names are commands in waiting.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Directory names never copied back: interpreter and test-runner caches, not results.
pub(super) const CACHES: &[&str] = &["__pycache__", ".pytest_cache"];

/// The bounds of one transfer: content bytes and files (100,000 empty files cost no bytes).
#[derive(Debug, Clone, Copy)]
pub struct Cap {
    /// Content bytes.
    pub bytes: u64,
    /// Regular files (and, coming back, entries looked at).
    pub files: u64,
}

/// What a transfer moved.
#[derive(Debug, Default, Clone)]
pub struct Moved {
    /// Regular files.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Each file's (mtime, size) as sent, by workspace-relative path: what the run was given.
    pub manifest: HashMap<PathBuf, (u64, u64)>,
    /// Copied back to the host: the workspace-relative paths, in archive order.
    pub copied: Vec<PathBuf>,
    /// Made or changed by the run but left in the sandbox, and why.
    pub held_back: Vec<(PathBuf, HeldBack)>,
}

/// Version-control metadata, never copied back: a `.git/config` with a `core.fsmonitor` command
/// is run by the host's next `git status`. Compared without case (macOS and Windows checkouts).
const VCS: &[&str] = &[".git", ".hg", ".svn", ".bzr", "_darcs", ".jj", ".pijul", "cvs", ".fslckout", "_fossil_"];

/// Why a file the run made was not copied back to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldBack {
    /// Version-control metadata (`.git`, `.hg`, …): never copied back.
    Vcs,
    /// Matched an `--output-exclude` pattern.
    Excluded,
    /// A file the run was not given already stands there on the host (`--output-overwrite`).
    Exists,
}

impl HeldBack {
    /// Why, for a person reading the CI log.
    pub fn why(self) -> &'static str {
        match self {
            Self::Vcs => "version-control metadata is never copied back",
            Self::Excluded => "matches --output-exclude",
            Self::Exists => {
                "the file already there was kept: the run was not given it (--output-overwrite replaces it)"
            }
        }
    }
}

/// What `download_changed` may write on the host.
#[derive(Debug, Default)]
pub struct CopyBack {
    /// Each file's (mtime, size) as uploaded: inputs, not results; and the only host files a
    /// result may replace without `overwrite`.
    pub given: HashMap<PathBuf, (u64, u64)>,
    /// Replace existing host files the run was not given.
    pub overwrite: bool,
    /// Patterns of paths never copied back (`*`, `?`, `**`; a pattern without `/` matches any
    /// one path component, one with `/` the path from the top).
    pub exclude: Vec<String>,
}

impl CopyBack {
    pub(super) fn held_back(&self, rel: &Path, exists: bool) -> Option<HeldBack> {
        let names = || rel.components().filter_map(|c| c.as_os_str().to_str());
        if rel.components().any(|c| VCS.iter().any(|v| c.as_os_str().eq_ignore_ascii_case(v))) {
            return Some(HeldBack::Vcs);
        }
        let text = rel.to_string_lossy();
        let excluded = self.exclude.iter().any(|p| {
            let p = p.trim_start_matches("./").trim_start_matches('/').trim_end_matches('/');
            if p.contains('/') {
                // The path itself or any directory above it.
                let parts: Vec<&str> = text.split('/').collect();
                (1..=parts.len()).any(|n| glob(p.as_bytes(), parts[..n].join("/").as_bytes()))
            } else {
                names().any(|n| glob(p.as_bytes(), n.as_bytes()))
            }
        });
        if excluded {
            return Some(HeldBack::Excluded);
        }
        if exists && !self.overwrite && !self.given.contains_key(rel) {
            return Some(HeldBack::Exists);
        }
        None
    }
}

/// Shell-style matching: `*` and `?` stay within a path component, `**` crosses them.
fn glob(pat: &[u8], s: &[u8]) -> bool {
    match pat {
        [] => s.is_empty(),
        [b'*', b'*', rest @ ..] => {
            let rest = rest.strip_prefix(b"/").unwrap_or(rest);
            (0..=s.len()).any(|i| glob(rest, &s[i..]))
        }
        [b'*', rest @ ..] => (0..=s.len()).take_while(|&i| i == 0 || s[i - 1] != b'/').any(|i| glob(rest, &s[i..])),
        [b'?', rest @ ..] => s.first().is_some_and(|&c| c != b'/') && glob(rest, &s[1..]),
        [c, rest @ ..] => s.first() == Some(c) && glob(rest, &s[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob(b"*.sh", b"a.sh") && !glob(b"*.sh", b"a/b.sh"));
        assert!(glob(b"**/*.sh", b"a/b/c.sh") && glob(b"**/*.sh", b"c.sh"));
        assert!(glob(b"docs/**", b"docs/a/b") && glob(b"?akefile", b"Makefile") && !glob(b"?", b"/"));
    }
}
