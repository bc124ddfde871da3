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

use super::error::{Context as _, ToolError, ToolResult};
use super::render::structured;
use super::{Caller, SandboxServer};
use crate::checks::{self, check_path, check_timeout, check_wait, session_name};
use crate::protocol::{FileEntry, Request};
use crate::session::{FileReply, RunSpec, Session};

/// How `content` is encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub(super) enum Encoding {
    /// UTF-8 text.
    #[default]
    Text,
    /// Base64 of arbitrary bytes.
    Base64,
}

/// Arguments of `write_file`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct WriteFileArgs {
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
pub(super) struct ReadFileArgs {
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
pub(super) struct ListFilesArgs {
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
pub(super) struct DeleteFileArgs {
    /// File or directory relative to the workspace (directories are removed with their contents).
    pub path: String,
    /// Session name. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
}

/// Arguments of `run_file`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RunFileArgs {
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
pub(super) struct WriteOutput {
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
pub(super) struct ReadOutput {
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
pub(super) struct ListOutput {
    /// Session.
    pub session: String,
    /// Entries, paths relative to the workspace.
    pub entries: Vec<FileEntry>,
    /// True when the listing stopped at its limit (1000 entries).
    pub truncated: bool,
}

/// A file request to the session's agent; its refusal or failure is told as `what: why`.
pub(super) async fn agent_file<'r>(
    session: &Session,
    what: impl std::fmt::Display,
    make: impl Fn(u64) -> Request<'r>,
) -> Result<FileReply, ToolError> {
    session.file(make).await.context(what)
}

impl SandboxServer {
    /// Reads up to `length` bytes; used by read_file and resources/read.
    pub(super) async fn read_bytes(
        &self,
        session: &Session,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<(Vec<u8>, u64), ToolError> {
        let reply =
            agent_file(session, format!("cannot read {path}"), |id| Request::Read { id, path, offset, length }).await?;
        // The code may answer in the agent's place: never more than was asked for.
        if reply.data.len() as u64 > length {
            return Err(format!(
                "cannot read {path}: the sandbox answered with {} bytes where at most {length} were asked for",
                reply.data.len()
            )
            .into());
        }
        let size = reply.size.unwrap_or(0).max(offset.saturating_add(reply.data.len() as u64));
        Ok((reply.data, size))
    }
}

#[tool_router(router = files_router, vis = "pub(super)")]
impl SandboxServer {
    /// Write a file into the session's workspace (/workspace, the code's working directory),
    /// creating parent directories. With append=true the content is added to the end, so long
    /// files can be written in several calls and then run with run_file or imported. Binary
    /// content goes as base64 with encoding="base64". At most 8 MiB per call.
    #[tool(annotations(title = "Write file", destructive_hint = true), output_schema = schema_for_output::<WriteOutput>())]
    async fn write_file(&self, Parameters(args): Parameters<WriteFileArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let path = check_path(&args.path, false)?;
        let data = match args.encoding {
            Encoding::Text => args.content.into_bytes(),
            Encoding::Base64 => match base64::engine::general_purpose::STANDARD.decode(args.content.trim()) {
                Ok(d) => d,
                Err(_) => return Err("content is not valid base64 (encoding is \"base64\")".into()),
            },
        };
        if data.len() > self.cfg.file_cap {
            return Err(format!(
                "content is {} bytes, over the limit of {} per call: write it in parts with append=true",
                data.len(),
                self.cfg.file_cap
            )
            .into());
        }
        let (session, _) = self.registry.get_or_create(&who, &name, None, &[], &|_| {}).await?;
        let written = data.len() as u64;
        let b = base64::engine::general_purpose::STANDARD.encode(&data);
        drop(data);
        let path_ref = path.as_str();
        let write = |id| Request::Write { id, path: path_ref, b: &b, append: args.append };
        let reply = agent_file(&session, format!("cannot write {path}"), write).await?;
        let out = WriteOutput { session: name, path: path.clone(), written, size: reply.size.unwrap_or(0) };
        let text = format!("wrote {written} bytes to {path} (size now {} bytes)", out.size);
        Ok(structured(&out, text))
    }

    /// Read a file from the session's workspace: text as text, binary as base64. Reads at most
    /// 1 MiB per call by default; use offset and length to page through larger files.
    #[tool(annotations(title = "Read file", read_only_hint = true), output_schema = schema_for_output::<ReadOutput>())]
    async fn read_file(&self, Parameters(args): Parameters<ReadFileArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let path = check_path(&args.path, false)?;
        let cap = self.cfg.file_cap as u64;
        let length = args.length.unwrap_or(cap.min(1 << 20));
        if length == 0 || length > cap {
            return Err(format!("length must be between 1 and {cap} bytes").into());
        }
        let offset = args.offset.unwrap_or(0);
        let session = self.registry.get(&who, &name)?;
        let (data, size) = self.read_bytes(&session, &path, offset, length).await?;
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
            eof: offset.saturating_add(got) >= size,
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
            Resource::new(checks::resource_uri(&name, &path), path.clone()).with_size(size),
        ));
        Ok(result)
    }

    /// List files in the session's workspace with their kinds (file, dir, link), sizes, and the
    /// storage each takes (allocated: less for a sparse file, more for blocks past its end). Each file
    /// is also linked as an MCP resource (pyberth://sessions/{session}/files/{path}).
    #[tool(annotations(title = "List files", read_only_hint = true), output_schema = schema_for_output::<ListOutput>())]
    async fn list_files(&self, Parameters(args): Parameters<ListFilesArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let path = check_path(args.path.as_deref().unwrap_or(""), true)?;
        let session = self.registry.get(&who, &name)?;
        let path_ref = path.as_str();
        let list = |id| Request::List { id, path: path_ref, recursive: args.recursive, limit: 1000 };
        let mut reply = agent_file(&session, format!("cannot list {path}"), list).await?;
        // Entries were checked as paths (`Session::file`); they must also lie under the
        // directory listed, and be no more than were asked for.
        let before = reply.entries.len();
        reply.entries.retain(|e| path == "." || e.path.strip_prefix(path.as_str()).is_some_and(|r| r.starts_with('/')));
        let dropped = reply.dropped + before - reply.entries.len();
        if reply.entries.len() > 1000 {
            reply.entries.truncate(1000);
            reply.truncated = true;
        }
        // A header names the columns; sizes are bytes.
        let mut text =
            if reply.entries.is_empty() { String::new() } else { "kind\tbytes\tallocated\tpath\n".to_owned() };
        for e in &reply.entries {
            // Names are the code's: escaped, so one cannot add lines to the listing.
            let allocated = e.allocated.map_or_else(|| "-".to_owned(), |a| a.to_string());
            text.push_str(&format!("{}\t{}\t{allocated}\t{}\n", e.kind, e.size, crate::output::one_line(&e.path)));
        }
        if reply.entries.is_empty() {
            text.push_str("(empty)\n");
        }
        if reply.truncated {
            text.push_str("[listing cut at 1000 entries]\n");
        }
        if dropped > 0 {
            text.push_str(&format!("[{dropped} entries the sandbox reported were left out: invalid names]\n"));
        }
        let links: Vec<ContentBlock> = reply
            .entries
            .iter()
            .filter(|e| e.kind == "file")
            .take(100)
            .map(|e| {
                ContentBlock::resource_link(
                    Resource::new(checks::resource_uri(&name, &e.path), e.path.clone()).with_size(e.size),
                )
            })
            .collect();
        let out = ListOutput { session: name, entries: reply.entries, truncated: reply.truncated };
        let mut result = structured(&out, text);
        result.content.extend(links);
        Ok(result)
    }

    /// Delete a file or directory (with its contents) from the session's workspace.
    #[tool(annotations(title = "Delete file", destructive_hint = true))]
    async fn delete_file(&self, Parameters(args): Parameters<DeleteFileArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(args.session.as_deref())?;
        let path = check_path(&args.path, false)?;
        let session = self.registry.get(&who, &name)?;
        let path_ref = path.as_str();
        agent_file(&session, format!("cannot delete {path}"), |id| Request::Delete { id, path: path_ref }).await?;
        Ok(CallToolResult::success(vec![ContentBlock::text(format!("deleted {path}"))]))
    }

    /// Run a Python script from the workspace as __main__ in a fresh interpreter process inside
    /// the session's container, with sys.argv = [path] + args. The session's variables are
    /// neither used nor changed; its files and installed packages are. The result is that of
    /// run_python, with exit_code set to the script's exit status.
    #[tool(
        annotations(title = "Run file", destructive_hint = false, open_world_hint = false),
        output_schema = schema_for_output::<super::RunOutput>()
    )]
    async fn run_file(&self, Parameters(args): Parameters<RunFileArgs>, ctx: RequestContext<RoleServer>) -> ToolResult {
        let who = super::principal_of(&ctx);
        let name = session_name(args.session.as_deref())?;
        let path = check_path(&args.path, false)?;
        // Checked against the server before any container is touched; resolved in `execute`.
        check_timeout(args.timeout_s, &self.cfg)?;
        let wait = check_wait(args.wait_s, args.background, &self.cfg)?;
        let env = args.env.unwrap_or_default();
        checks::check_env(&env)?;
        if args.args.len() > 1000 || args.args.iter().any(|a| a.contains('\0')) {
            return Err("args must be at most 1000 strings without NUL bytes".into());
        }
        let session = self.registry.get(&who, &name)?;
        let spec = RunSpec { file: Some(path), args: args.args, env, ..Default::default() };
        self.execute(&ctx, session, spec, args.timeout_s, wait, Vec::new()).await
    }
}
