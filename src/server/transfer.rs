//! Bulk transfer: directories in and out of a workspace as tar archives.
//!
//! Downloads are packed by the agent as the code's uid, following no link (the Docker archive
//! API would resolve paths as root), and re-packed as hostile input (regular files and
//! directories only, nothing outside). Uploads are unpacked on the server, as
//! hostile input too, and written by the agent as the code's uid, through the same
//! symlink-safe path checks as write_file: the archive API would extract as root, following
//! whatever links the code left in the workspace.

use base64::Engine as _;
use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::{tool, tool_router};
use serde::{Deserialize, Serialize};

use super::error::{Context as _, ToolResult};
use super::files::agent_file;
use super::render::structured;
use super::{Caller, SandboxServer};
use crate::checks::{check_path, session_name};
use crate::protocol::Request;
use crate::session::transfer as archive;

/// Largest archive moved in one call (decoded), and largest total content.
const MAX_ARCHIVE: usize = 64 << 20;
/// Most files in one downloaded archive: empty files cost no bytes, but a header each.
const MAX_FILES: u64 = 20_000;

/// Arguments of `upload_archive`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct UploadArchiveArgs {
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
pub(super) struct DownloadArchiveArgs {
    /// File or directory of the workspace to pack (default: the whole workspace).
    #[serde(default)]
    pub path: Option<String>,
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Structured result of `upload_archive`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct UploadOutput {
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
pub(super) struct DownloadOutput {
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
    async fn upload_archive(&self, Parameters(args): Parameters<UploadArchiveArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let dest = args.path.as_deref().map(|p| check_path(p, true)).transpose()?.unwrap_or_else(|| ".".into());
        if args.archive.len() > MAX_ARCHIVE / 3 * 4 + 4 {
            return Err(format!("the archive is over {} MiB: upload it in parts", MAX_ARCHIVE >> 20).into());
        }
        // Up to 64 MiB to decode and read: off the runtime's threads.
        let (files, skipped) = {
            let dest = dest.clone();
            tokio::task::spawn_blocking(move || {
                let tar = base64::engine::general_purpose::STANDARD
                    .decode(args.archive.trim())
                    .map_err(|_| "archive is not valid base64".to_owned())?;
                archive::read_upload(&tar, &dest, |p| check_path(p, false))
            })
            .await
            .context("the archive reader stopped")??
        };
        let (session, _) = self.registry.get_or_create(&who, &name, None, &[], &|_| {}).await?;
        let (mut count, mut bytes) = (0u64, 0u64);
        for (path, data) in &files {
            // One file at a time in chunks of the per-call cap; an empty file is one empty write.
            let mut chunks: Vec<&[u8]> = data.chunks(self.cfg.file_cap).collect();
            if chunks.is_empty() {
                chunks.push(&[]);
            }
            for (i, chunk) in chunks.into_iter().enumerate() {
                let b = base64::engine::general_purpose::STANDARD.encode(chunk);
                let what = format!("cannot write {path}");
                if let Err(e) = agent_file(&session, what, |id| Request::Write { id, path, b: &b, append: i > 0 }).await
                {
                    return Err(format!("{e} ({count} files were written before it, the rest were not)").into());
                }
            }
            count += 1;
            bytes += data.len() as u64;
        }
        let mut text = format!("unpacked {} ({bytes} bytes) into {dest}\n", crate::output::count(count, "file"));
        for s in &skipped {
            text.push_str(&format!("[skipped] {s}\n"));
        }
        Ok(structured(&UploadOutput { session: name, files: count, bytes, skipped }, text))
    }

    /// Pack a workspace file or directory (default: the whole workspace) as a tar archive,
    /// returned base64: many files in one call. Regular files and directories only; at most
    /// 64 MiB of content.
    #[tool(annotations(title = "Download archive", read_only_hint = true), output_schema = schema_for_output::<DownloadOutput>())]
    async fn download_archive(
        &self,
        Parameters(args): Parameters<DownloadArchiveArgs>,
        Caller(who): Caller,
    ) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let rel = args.path.as_deref().map(|p| check_path(p, true)).transpose()?.unwrap_or_else(|| ".".into());
        let session = self.registry.get(&who, &name)?;
        let cap = archive::Cap { bytes: MAX_ARCHIVE as u64, files: MAX_FILES };
        let (tar, moved) = session.download_tree(&rel, cap).await?;
        let text = format!(
            "packed {} ({} bytes) of {rel}; the archive is in archive (base64 tar)\n",
            crate::output::count(moved.files, "file"),
            moved.bytes
        );
        let archive = base64::engine::general_purpose::STANDARD.encode(&tar);
        Ok(structured(&DownloadOutput { session: name, archive, files: moved.files, bytes: moved.bytes }, text))
    }
}
