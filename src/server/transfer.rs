//! Bulk transfer: directories in and out of a workspace as tar archives.
//!
//! Downloads go through the Docker archive API and are re-packed as hostile input (regular
//! files and directories only, nothing outside). Uploads are unpacked on the server, as
//! hostile input too, and written by the agent as the code's uid, through the same
//! symlink-safe path checks as write_file: the archive API would extract as root, following
//! whatever links the code left in the workspace.

use base64::Engine as _;
use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::{tool, tool_router};
use serde::{Deserialize, Serialize};

use super::{Caller, SandboxServer, session_name, structured, tool_error};
use crate::docker::{archive, layers::safe_relative};
use crate::protocol::Request;
use crate::workspace::check_path;

/// Largest archive moved in one call (decoded), and largest total content.
const MAX_ARCHIVE: usize = 64 << 20;

/// Arguments of `upload_archive`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UploadArchiveArgs {
    /// A tar archive (not compressed), base64.
    pub archive: String,
    /// Directory of the workspace to unpack into (default: the workspace itself).
    #[serde(default)]
    pub path: Option<String>,
    /// Session name. Omit for the default session; a new name creates the session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `download_archive`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DownloadArchiveArgs {
    /// File or directory of the workspace to pack (default: the whole workspace).
    #[serde(default)]
    pub path: Option<String>,
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Structured result of `upload_archive`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct UploadOutput {
    /// Session.
    pub session: String,
    /// Regular files written.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Entries left out (links, devices, unsafe names), with why.
    pub skipped: Vec<String>,
}

/// Structured result of `download_archive`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct DownloadOutput {
    /// Session.
    pub session: String,
    /// The tar archive, base64; entries are named relative to the workspace.
    pub archive: String,
    /// Regular files in it.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
}

#[tool_router(router = transfer_router, vis = "pub(super)")]
impl SandboxServer {
    /// Unpack a tar archive (base64) into the session's workspace: many files in one call.
    /// Regular files and directories only; links and devices are skipped and listed. At most
    /// 64 MiB per archive.
    #[tool(annotations(title = "Upload archive", destructive_hint = true), output_schema = schema_for_output::<UploadOutput>())]
    async fn upload_archive(
        &self,
        Parameters(args): Parameters<UploadArchiveArgs>,
        Caller(who): Caller,
    ) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let dest = match args.path.as_deref().map(|p| check_path(p, true)).transpose() {
            Ok(p) => p.unwrap_or_else(|| ".".into()),
            Err(e) => return tool_error(e),
        };
        if args.archive.len() > MAX_ARCHIVE / 3 * 4 + 4 {
            return tool_error(format!("the archive is over {} MiB: upload it in parts", MAX_ARCHIVE >> 20));
        }
        let tar = match base64::engine::general_purpose::STANDARD.decode(args.archive.trim()) {
            Ok(t) => t,
            Err(_) => return tool_error("archive is not valid base64"),
        };
        // Read every entry first: a broken archive changes nothing.
        let mut files: Vec<(String, Vec<u8>)> = Vec::new();
        let mut skipped = Vec::new();
        let mut ar = tar::Archive::new(&tar[..]);
        let entries = match ar.entries() {
            Ok(e) => e,
            Err(e) => return tool_error(format!("archive is not a tar archive: {e}")),
        };
        for entry in entries {
            let mut entry = match entry {
                Ok(e) => e,
                Err(e) => return tool_error(format!("archive is not a valid tar archive: {e}")),
            };
            let shown = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            let kind = entry.header().entry_type();
            if kind == tar::EntryType::Directory {
                continue; // directories come with their files
            }
            if kind != tar::EntryType::Regular {
                skipped.push(format!("{shown}: not a regular file"));
                continue;
            }
            let rel = match entry.path() {
                Ok(p) if safe_relative(&p) => p.into_owned(),
                _ => {
                    skipped.push(format!("{shown}: unsafe name"));
                    continue;
                }
            };
            let joined = if dest == "." { rel } else { std::path::Path::new(&dest).join(rel) };
            let path = match joined.to_str().map(|p| check_path(p, false)) {
                Some(Ok(p)) => p,
                Some(Err(e)) => {
                    skipped.push(format!("{shown}: {e}"));
                    continue;
                }
                None => {
                    skipped.push(format!("{shown}: not UTF-8"));
                    continue;
                }
            };
            let mut data = Vec::new();
            if let Err(e) = std::io::Read::read_to_end(&mut entry, &mut data) {
                return tool_error(format!("archive entry {shown} is unreadable: {e}"));
            }
            files.push((path, data));
        }
        let (session, _) = match self.registry.get_or_create(&who, &name, None, &[], &|_| {}).await {
            Ok(s) => s,
            Err(e) => return tool_error(e.to_string()),
        };
        let (mut count, mut bytes) = (0u64, 0u64);
        for (path, data) in &files {
            // One file at a time in chunks of the per-call cap; an empty file is one empty write.
            let mut chunks: Vec<&[u8]> = data.chunks(self.cfg.file_cap).collect();
            if chunks.is_empty() {
                chunks.push(&[]);
            }
            for (i, chunk) in chunks.into_iter().enumerate() {
                let b = base64::engine::general_purpose::STANDARD.encode(chunk);
                let written = session.file(|id| Request::Write { id, path, b, append: i > 0 }).await;
                let failed = match written {
                    Ok(_) => None,
                    Err(crate::session::Error::Refused(e)) => Some(e),
                    Err(e) => Some(e.to_string()),
                };
                if let Some(e) = failed {
                    return tool_error(format!(
                        "cannot write {path}: {e} ({count} files were written before it, the rest were not)"
                    ));
                }
            }
            count += 1;
            bytes += data.len() as u64;
        }
        let mut text = format!("unpacked {count} files ({bytes} bytes) into {dest}\n");
        for s in &skipped {
            text.push_str(&format!("[skipped] {s}\n"));
        }
        structured(&UploadOutput { session: name, files: count, bytes, skipped }, text)
    }

    /// Pack a workspace file or directory (default: the whole workspace) as a tar archive,
    /// returned base64: many files in one call. Regular files and directories only; at most
    /// 64 MiB of content.
    #[tool(annotations(title = "Download archive", read_only_hint = true), output_schema = schema_for_output::<DownloadOutput>())]
    async fn download_archive(
        &self,
        Parameters(args): Parameters<DownloadArchiveArgs>,
        Caller(who): Caller,
    ) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let rel = match args.path.as_deref().map(|p| check_path(p, true)).transpose() {
            Ok(p) => p.unwrap_or_else(|| ".".into()),
            Err(e) => return tool_error(e),
        };
        let session = match self.registry.get(&who, &name) {
            Ok(s) => s,
            Err(e) => return tool_error(e.to_string()),
        };
        let docker = self.registry.docker();
        match archive::download_tree(docker, &session.container_id(), &rel, MAX_ARCHIVE as u64).await {
            Ok((tar, moved)) => {
                let text = format!(
                    "packed {} files ({} bytes) of {rel}; the archive is in archive (base64 tar)\n",
                    moved.files, moved.bytes
                );
                let archive = base64::engine::general_purpose::STANDARD.encode(&tar);
                structured(&DownloadOutput { session: name, archive, files: moved.files, bytes: moved.bytes }, text)
            }
            Err(e) => tool_error(e),
        }
    }
}
