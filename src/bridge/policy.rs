//! What a session may call: an environment's allow-list of upstream tools (`time:*`,
//! `git:git_log`, `git:git_*`), the write tools the operator opted in by name, and the
//! budget of one run. Pure: no I/O.

use std::collections::BTreeSet;
use std::time::Duration;

/// Default calls one run may make.
pub const DEFAULT_CALLS: u32 = 100;
/// Default time one run's calls may take together, seconds.
pub const DEFAULT_CALL_TIME_S: u64 = 300;
/// Calls of one session in flight at once.
pub const CONCURRENT_CALLS: usize = 4;

/// One allow-list entry: `server:tool`, where `tool` is a name, `*`, or a prefix ending in `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    server: String,
    tool: String,
}

impl Pattern {
    /// Parses `server:tool`; `servers` are the configured upstreams.
    pub fn parse(text: &str, servers: &dyn Fn(&str) -> bool) -> Result<Self, String> {
        let (server, tool) =
            text.split_once(':').ok_or_else(|| format!("{text:?}: write server:tool (e.g. time:* or git:git_log)"))?;
        if !servers(server) {
            return Err(format!("{text:?}: no upstream named {server:?} ([upstreams.NAME])"));
        }
        let stem = tool.strip_suffix('*').unwrap_or(tool);
        let plain = |s: &str| s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b));
        if tool.is_empty() || !plain(stem) || tool.len() > 128 {
            return Err(format!("{text:?}: the tool is a name, `*`, or a prefix ending in `*`"));
        }
        Ok(Self { server: server.to_owned(), tool: tool.to_owned() })
    }

    fn matches(&self, server: &str, tool: &str) -> bool {
        self.server == server
            && match self.tool.strip_suffix('*') {
                Some(prefix) => tool.starts_with(prefix),
                None => self.tool == tool,
            }
    }

    /// The upstream it names.
    pub fn server(&self) -> &str {
        &self.server
    }
}

/// An environment's bridge policy.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Tools its sessions may call; empty: none (code mode off).
    pub allow: Vec<Pattern>,
    /// `server:tool` names of tools not marked read-only that may be called all the same.
    pub write: BTreeSet<String>,
    /// Calls one run may make.
    pub calls: u32,
    /// Time one run's calls may take together.
    pub time: Duration,
    /// The caller's own list (`[principals.NAME] tools`), when the operator gave one: a call
    /// must be on both lists.
    pub narrow: Option<Vec<Pattern>>,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            write: BTreeSet::new(),
            calls: DEFAULT_CALLS,
            time: Duration::from_secs(DEFAULT_CALL_TIME_S),
            narrow: None,
        }
    }
}

/// Why a call is refused before it goes upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Not on the allow-list.
    NotAllowed,
    /// On it, but not marked read-only and not opted in by name.
    NotReadOnly,
}

impl Policy {
    /// Builds a policy from an environment's keys; errors name the key.
    pub fn new(
        at: &str,
        tools: &[String],
        write_tools: &[String],
        calls: Option<u32>,
        time_s: Option<u64>,
        servers: &dyn Fn(&str) -> bool,
    ) -> Result<Self, String> {
        let allow = tools
            .iter()
            .map(|t| Pattern::parse(t, servers))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{at}.tools: {e}"))?;
        let mut write = BTreeSet::new();
        for w in write_tools {
            let p = Pattern::parse(w, servers).map_err(|e| format!("{at}.write_tools: {e}"))?;
            if p.tool.contains('*') {
                return Err(format!("{at}.write_tools: {w:?}: a write tool is opted in by its full name, no pattern"));
            }
            write.insert(w.clone());
        }
        let calls = calls.unwrap_or(DEFAULT_CALLS);
        if !(1..=10_000).contains(&calls) {
            return Err(format!("{at}.tool_calls: 1 to 10000"));
        }
        let time_s = time_s.unwrap_or(DEFAULT_CALL_TIME_S);
        if !(1..=86_400).contains(&time_s) {
            return Err(format!("{at}.tool_time_s: 1 to 86400"));
        }
        Ok(Self { allow, write, calls, time: Duration::from_secs(time_s), narrow: None })
    }

    /// Whether any tool of `server` may be listed.
    pub fn reaches(&self, server: &str) -> bool {
        self.allow.iter().any(|p| p.server == server)
            && self.narrow.as_ref().is_none_or(|n| n.iter().any(|p| p.server == server))
    }

    /// Whether `server:tool`, whose read-only hint is `read_only`, may be called.
    pub fn check(&self, server: &str, tool: &str, read_only: bool) -> Result<(), Refusal> {
        if !self.allow.iter().any(|p| p.matches(server, tool))
            || self.narrow.as_ref().is_some_and(|n| !n.iter().any(|p| p.matches(server, tool)))
        {
            return Err(Refusal::NotAllowed);
        }
        if !read_only && !self.write.contains(&format!("{server}:{tool}")) {
            return Err(Refusal::NotReadOnly);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(s: &str) -> bool {
        matches!(s, "time" | "git")
    }

    fn policy(tools: &[&str], write: &[&str]) -> Result<Policy, String> {
        let t: Vec<String> = tools.iter().map(|s| (*s).to_owned()).collect();
        let w: Vec<String> = write.iter().map(|s| (*s).to_owned()).collect();
        Policy::new("environments.x", &t, &w, None, None, &known)
    }

    #[test]
    fn patterns_allow_what_they_name_and_write_tools_need_their_name() {
        let p = policy(&["time:*", "git:git_log", "git:git_st*"], &[]).expect("valid");
        assert_eq!(p.check("time", "get_current_time", true), Ok(()));
        assert_eq!(p.check("git", "git_log", true), Ok(()));
        assert_eq!(p.check("git", "git_status", true), Ok(()));
        assert_eq!(p.check("git", "git_diff", true), Err(Refusal::NotAllowed));
        assert_eq!(p.check("gitx", "git_log", true), Err(Refusal::NotAllowed));
        assert_eq!(p.check("time", "set_time", false), Err(Refusal::NotReadOnly));
        let p = policy(&["git:*"], &["git:git_commit"]).expect("valid");
        assert_eq!(p.check("git", "git_commit", false), Ok(()));
        assert_eq!(p.check("git", "git_reset", false), Err(Refusal::NotReadOnly));
        assert!(policy(&[], &[]).expect("empty").allow.is_empty());
        // A principal's own list narrows, never widens.
        let mut p = policy(&["time:*", "git:git_log"], &[]).expect("valid");
        p.narrow = Some(vec![Pattern::parse("time:get_*", &known).expect("pattern")]);
        assert_eq!(p.check("time", "get_current_time", true), Ok(()));
        assert_eq!(p.check("time", "convert_time", true), Err(Refusal::NotAllowed));
        assert_eq!(p.check("git", "git_log", true), Err(Refusal::NotAllowed));
        assert!(p.reaches("time") && !p.reaches("git"));
    }

    #[test]
    fn bad_entries_are_refused_naming_them() {
        for (tools, write, want) in [
            (&["time"][..], &[][..], "server:tool"),
            (&["nope:*"], &[], "no upstream named \"nope\""),
            (&["time:a b"], &[], "environments.x.tools"),
            (&["time:"], &[], "environments.x.tools"),
            (&["time:*"], &["git:*"], "full name"),
            (&["time:*"], &["x:y"], "environments.x.write_tools"),
        ] {
            let e = policy(tools, write).expect_err("refused");
            assert!(e.contains(want), "{tools:?} {write:?}: {e}");
        }
        let t = vec!["time:*".to_owned()];
        assert!(Policy::new("e", &t, &[], Some(0), None, &known).expect_err("0").contains("tool_calls"));
    }
}
