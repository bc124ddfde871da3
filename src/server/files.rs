//! Workspace tools: files in and out of a session's `/workspace`, and running scripts there.
//! Paths are checked here before any Docker call; the agent checks again inside the
//! container, where symlinks made by the code resolve (never on the host).

use std::collections::BTreeMap;

use base64::Engine as _;
use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Resource};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, tool, tool_router};
use serde::{Deserialize, Serialize};

use super::jobs::check_wait;
use super::{Caller, SandboxServer, check_timeout, principal_of, session_name, structured, tool_error};
use crate::protocol::{FileEntry, Request};
use crate::session::Session;
use crate::session::jobs::JobSpec;
use crate::workspace::{self, check_path};

/// How `content` is encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// UTF-8 text.
    #[default]
    Text,
    /// Base64 of arbitrary bytes.
    Base64,
}

/// Arguments of `write_file`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    /// Path relative to the workspace, e.g. "src/main.py". Parent directories are created.
    pub path: String,
    /// The content (text, or base64 with encoding "base64").
    pub content: String,
    /// Append to the file instead of replacing it: write long files in several calls.
    #[serde(default)]
    pub append: bool,
    /// "text" (default) or "base64".
    #[serde(default)]
    pub encoding: Encoding,
    /// Session name. Omit for the default session; a new name creates the session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `read_file`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// Path relative to the workspace.
    pub path: String,
    /// First byte to read (default 0).
    #[serde(default)]
    pub offset: Option<u64>,
    /// Most bytes to read (default and maximum: 1 MiB unless the server says otherwise).
    #[serde(default)]
    pub length: Option<u64>,
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `list_files`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// Directory relative to the workspace (default: the workspace itself).
    #[serde(default)]
    pub path: Option<String>,
    /// Include subdirectories.
    #[serde(default)]
    pub recursive: bool,
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `delete_file`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteFileArgs {
    /// File or directory relative to the workspace (directories are removed with their contents).
    pub path: String,
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `run_file`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunFileArgs {
    /// Script path relative to the workspace.
    pub path: String,
    /// Command-line arguments (sys.argv[1:]).
    #[serde(default)]
    pub args: Vec<String>,
    /// Time limit in seconds (default 60).
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Environment variables for this run.
    #[serde(default)]
    pub env: Option<BTreeMap<String, String>>,
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
    /// Wait at most this many seconds, then return a job handle with the output so far.
    #[serde(default)]
    pub wait_s: Option<f64>,
    /// Start the run as a background job and return its handle at once.
    #[serde(default)]
    pub background: bool,
}

/// Structured result of `write_file`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct WriteOutput {
    /// Session.
    pub session: String,
    /// Path written.
    pub path: String,
    /// Bytes written by this call.
    pub written: u64,
    /// Size of the file afterwards.
    pub size: u64,
}

/// Structured result of `read_file`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct ReadOutput {
    /// Session.
    pub session: String,
    /// Path read.
    pub path: String,
    /// First byte returned.
    pub offset: u64,
    /// Bytes returned.
    pub length: u64,
    /// Size of the whole file.
    pub size: u64,
    /// True when the read reached the end of the file.
    pub eof: bool,
    /// "text" when the bytes are UTF-8, else "base64".
    pub encoding: Encoding,
    /// The bytes, as text or base64.
    pub content: String,
}

/// Structured result of `list_files`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub struct ListOutput {
    /// Session.
    pub session: String,
    /// Entries, paths relative to the workspace.
    pub entries: Vec<FileEntry>,
    /// True when the listing stopped at its limit (1000 entries).
    pub truncated: bool,
}

impl SandboxServer {
    fn existing(&self, who: &str, name: &str) -> Result<std::sync::Arc<Session>, CallToolResult> {
        self.registry.get(who, name).map_err(|e| tool_error(e.to_string()))
    }

    /// Reads up to `length` bytes; used by read_file and resources/read.
    pub(super) async fn read_bytes(
        &self,
        session: &Session,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<(Vec<u8>, u64), String> {
        match session.file(|id| Request::Read { id, path, offset, length }).await {
            Ok(reply) => Ok((reply.data, reply.size.unwrap_or(0))),
            Err(crate::session::Error::Refused(e)) => Err(format!("cannot read {path}: {e}")),
            Err(e) => Err(format!("cannot read {path}: {e}")),
        }
    }
}

#[tool_router(router = files_router, vis = "pub(super)")]
impl SandboxServer {
    /// Write a file into the session's workspace (/workspace, the code's working directory),
    /// creating parent directories. With append=true the content is added to the end, so long
    /// files can be written in several calls and then run with run_file or imported. Binary
    /// content goes as base64 with encoding="base64". At most 8 MiB per call.
    #[tool(annotations(title = "Write file", destructive_hint = true), output_schema = schema_for_output::<WriteOutput>())]
    async fn write_file(&self, Parameters(args): Parameters<WriteFileArgs>, Caller(who): Caller) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let path = match check_path(&args.path, false) {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let data = match args.encoding {
            Encoding::Text => args.content.into_bytes(),
            Encoding::Base64 => match base64::engine::general_purpose::STANDARD.decode(args.content.trim()) {
                Ok(d) => d,
                Err(_) => return tool_error("content is not valid base64 (encoding is \"base64\")"),
            },
        };
        if data.len() > self.cfg.file_cap {
            return tool_error(format!(
                "content is {} bytes, over the limit of {} per call: write it in parts with append=true",
                data.len(),
                self.cfg.file_cap
            ));
        }
        let (session, _) = match self.registry.get_or_create(&who, &name, None, &[], &|_| {}).await {
            Ok(s) => s,
            Err(e) => return tool_error(e.to_string()),
        };
        let written = data.len() as u64;
        let b = base64::engine::general_purpose::STANDARD.encode(&data);
        drop(data);
        let path_ref = path.as_str();
        match session.file(|id| Request::Write { id, path: path_ref, b, append: args.append }).await {
            Ok(reply) => {
                let out = WriteOutput { session: name, path: path.clone(), written, size: reply.size.unwrap_or(0) };
                let text = format!("wrote {written} bytes to {path} (size now {} bytes)", out.size);
                structured(&out, text)
            }
            Err(crate::session::Error::Refused(e)) => tool_error(format!("cannot write {path}: {e}")),
            Err(e) => tool_error(format!("cannot write {path}: {e}")),
        }
    }

    /// Read a file from the session's workspace: text as text, binary as base64. Reads at most
    /// 1 MiB per call by default; use offset and length to page through larger files.
    #[tool(annotations(title = "Read file", read_only_hint = true), output_schema = schema_for_output::<ReadOutput>())]
    async fn read_file(&self, Parameters(args): Parameters<ReadFileArgs>, Caller(who): Caller) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let path = match check_path(&args.path, false) {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let cap = self.cfg.file_cap as u64;
        let length = args.length.unwrap_or(cap.min(1 << 20));
        if length == 0 || length > cap {
            return tool_error(format!("length must be between 1 and {cap} bytes"));
        }
        let offset = args.offset.unwrap_or(0);
        let session = match self.existing(&who, &name) {
            Ok(s) => s,
            Err(e) => return e,
        };
        let (data, size) = match self.read_bytes(&session, &path, offset, length).await {
            Ok(r) => r,
            Err(e) => return tool_error(e),
        };
        let got = data.len() as u64;
        let (encoding, content) = match String::from_utf8(data) {
            Ok(t) => (Encoding::Text, t),
            Err(e) => (Encoding::Base64, base64::engine::general_purpose::STANDARD.encode(e.into_bytes())),
        };
        let out = ReadOutput {
            session: name.clone(),
            path: path.clone(),
            offset,
            length: got,
            size,
            eof: offset + got >= size,
            encoding,
            content,
        };
        let mut text = if encoding == Encoding::Text {
            out.content.clone()
        } else {
            format!("[{got} bytes of binary data, base64 in structuredContent.content]")
        };
        if !out.eof {
            text.push_str(&format!(
                "\n[read {got} of {size} bytes from offset {offset}; continue with offset {}]",
                offset + got
            ));
        }
        let mut result = structured(&out, text);
        result.content.push(ContentBlock::resource_link(
            Resource::new(workspace::resource_uri(&name, &path), path.clone()).with_size(size),
        ));
        result
    }

    /// List files in the session's workspace with sizes and kinds (file, dir, link). Each file
    /// is also linked as an MCP resource (pyberth://sessions/{session}/files/{path}).
    #[tool(annotations(title = "List files", read_only_hint = true), output_schema = schema_for_output::<ListOutput>())]
    async fn list_files(&self, Parameters(args): Parameters<ListFilesArgs>, Caller(who): Caller) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let path = match check_path(args.path.as_deref().unwrap_or(""), true) {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let session = match self.existing(&who, &name) {
            Ok(s) => s,
            Err(e) => return e,
        };
        let path_ref = path.as_str();
        let reply =
            match session.file(|id| Request::List { id, path: path_ref, recursive: args.recursive, limit: 1000 }).await
            {
                Ok(r) => r,
                Err(crate::session::Error::Refused(e)) | Err(crate::session::Error::Install(e)) => {
                    return tool_error(format!("cannot list {path}: {e}"));
                }
                Err(e) => return tool_error(format!("cannot list {path}: {e}")),
            };
        let mut text = String::new();
        for e in &reply.entries {
            text.push_str(&format!("{}\t{}\t{}\n", e.kind, e.size, e.path));
        }
        if reply.entries.is_empty() {
            text.push_str("(empty)\n");
        }
        if reply.truncated {
            text.push_str("[listing cut at 1000 entries]\n");
        }
        let links: Vec<ContentBlock> = reply
            .entries
            .iter()
            .filter(|e| e.kind == "file")
            .take(100)
            .map(|e| {
                ContentBlock::resource_link(
                    Resource::new(workspace::resource_uri(&name, &e.path), e.path.clone()).with_size(e.size),
                )
            })
            .collect();
        let out = ListOutput { session: name, entries: reply.entries, truncated: reply.truncated };
        let mut result = structured(&out, text);
        result.content.extend(links);
        result
    }

    /// Delete a file or directory (with its contents) from the session's workspace.
    #[tool(annotations(title = "Delete file", destructive_hint = true))]
    async fn delete_file(&self, Parameters(args): Parameters<DeleteFileArgs>, Caller(who): Caller) -> CallToolResult {
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let path = match check_path(&args.path, false) {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let session = match self.existing(&who, &name) {
            Ok(s) => s,
            Err(e) => return e,
        };
        let path_ref = path.as_str();
        match session.file(|id| Request::Delete { id, path: path_ref }).await {
            Ok(_) => CallToolResult::success(vec![ContentBlock::text(format!("deleted {path}"))]),
            Err(crate::session::Error::Refused(e)) => tool_error(format!("cannot delete {path}: {e}")),
            Err(e) => tool_error(format!("cannot delete {path}: {e}")),
        }
    }

    /// Run a Python script from the workspace as __main__ in a fresh interpreter process inside
    /// the session's container, with sys.argv = [path] + args. The session's variables are
    /// neither used nor changed; its files and installed packages are. The result is that of
    /// run_python, with exit_code set to the script's exit status.
    #[tool(
        annotations(title = "Run file", destructive_hint = false, open_world_hint = false),
        output_schema = schema_for_output::<super::RunOutput>()
    )]
    async fn run_file(
        &self,
        Parameters(args): Parameters<RunFileArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> CallToolResult {
        let who = principal_of(&ctx);
        let name = match session_name(args.session.as_deref()) {
            Ok(n) => n,
            Err(e) => return tool_error(e),
        };
        let path = match check_path(&args.path, false) {
            Ok(p) => p,
            Err(e) => return tool_error(e),
        };
        let timeout = match check_timeout(args.timeout_s, &self.cfg) {
            Ok(t) => t,
            Err(e) => return tool_error(e),
        };
        let wait = match check_wait(args.wait_s, args.background, &self.cfg) {
            Ok(w) => w,
            Err(e) => return tool_error(e),
        };
        let env = args.env.unwrap_or_default();
        if let Err(e) = workspace::check_env(&env) {
            return tool_error(e);
        }
        if args.args.len() > 1000 || args.args.iter().any(|a| a.contains('\0')) {
            return tool_error("args must be at most 1000 strings without NUL bytes");
        }
        let session = match self.existing(&who, &name) {
            Ok(s) => s,
            Err(e) => return e,
        };
        let timeout = if args.timeout_s.is_none() { session.settings().timeout() } else { timeout };
        let spec = JobSpec { code: String::new(), file: Some(path), args: args.args, env };
        self.execute(&ctx, session, spec, timeout, wait, Vec::new()).await
    }
}
