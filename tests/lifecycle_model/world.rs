//! The world a sequence runs in: a private state dir, the current server of it (a new
//! instance name after each restart, one prefix for them all), and the model of what each
//! session and snapshot must hold.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult};
use serde_json::{Value, json};

use crate::common::{Server, text};
use crate::ops::Stop;

/// A step's failure: a short kind (shrinking keeps failures of the same kind) and what.
#[derive(Debug, Clone)]
pub struct Broke {
    pub kind: &'static str,
    pub what: String,
}

pub fn broke(kind: &'static str, what: impl Into<String>) -> Broke {
    Broke { kind, what: what.into() }
}

/// A background job the model waits for.
#[derive(Debug, Clone)]
pub struct PendingJob {
    pub id: String,
    pub var: String,
    pub val: u64,
    /// The server generation that started it.
    pub generation: u32,
}

/// What a session (or a snapshot) must hold.
#[derive(Debug, Clone, Default)]
pub struct Holds {
    pub vars: BTreeMap<String, u64>,
    pub files: BTreeMap<String, String>,
    pub job: Option<PendingJob>,
    /// Its container was removed: the next result in it must say its state is gone.
    pub owed_report: bool,
}

impl Holds {
    /// What a copy (fork, snapshot, restore) holds: the data, no job, nothing owed.
    pub fn copy(&self) -> Holds {
        Holds { vars: self.vars.clone(), files: self.files.clone(), job: None, owed_report: false }
    }
}

#[derive(Debug, Default)]
pub struct Model {
    pub sessions: BTreeMap<u8, Holds>,
    pub snaps: BTreeMap<u8, Holds>,
}

/// The settings every server of the model gets: sessions kept across restarts, a short
/// hibernation, a small memory limit (the OOM operation).
pub const MEMORY_MB: &str = "200";
pub const HIBERNATE_AFTER_S: &str = "4";

pub struct World {
    pub prefix: String,
    pub state: PathBuf,
    pub generation: u32,
    pub server: Option<Server>,
    pub model: Model,
    /// The last step was Idle: its sessions are left asleep (read after the next step).
    pub asleep: bool,
}

impl World {
    pub async fn new(prefix: String) -> Result<World, Broke> {
        let state = std::env::temp_dir().join(format!("pyberth-model-{prefix}"));
        let _ = std::fs::remove_dir_all(&state);
        std::fs::create_dir_all(&state).map_err(|e| broke("setup", format!("state dir: {e}")))?;
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| broke("setup", format!("state dir mode: {e}")))?;
        let mut w = World { prefix, state, generation: 0, server: None, model: Model::default(), asleep: false };
        w.start().await;
        Ok(w)
    }

    /// The instance name of the current server.
    pub fn instance(&self) -> String {
        format!("{}-g{}", self.prefix, self.generation)
    }

    async fn start(&mut self) {
        let state = self.state.to_string_lossy().into_owned();
        let env = [
            ("PYBERTH_STATE_DIR", state.as_str()),
            ("PYBERTH_KEEP_SESSIONS", "true"),
            ("PYBERTH_HIBERNATE_AFTER_S", HIBERNATE_AFTER_S),
            ("PYBERTH_MEMORY_MB", MEMORY_MB),
        ];
        self.server = Some(Server::start_as(&self.instance(), &env).await);
    }

    /// Stops the server as `how` says, then starts the next one on the same state dir.
    pub async fn restart(&mut self, how: Stop) -> Result<(), Broke> {
        self.stop(how).await?;
        self.generation += 1;
        self.start().await;
        Ok(())
    }

    /// Stops the current server; its sessions are left for the next (--keep-sessions).
    pub async fn stop(&mut self, how: Stop) -> Result<(), Broke> {
        let Some(mut s) = self.server.take() else { return Ok(()) };
        match how {
            Stop::Eof => {
                if let Some(c) = s.client.take() {
                    let _ = c.cancel().await;
                }
            }
            Stop::Term => {
                let pid = s.child.id().ok_or_else(|| broke("stop", "the server already exited"))?;
                let _ = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
            }
            Stop::Kill => {
                let _ = s.child.start_kill();
            }
        }
        let waited = tokio::time::timeout(Duration::from_secs(60), s.child.wait()).await;
        if let Some(c) = s.client.take() {
            drop(c);
        }
        match waited {
            Ok(Ok(_)) => Ok(()),
            _ => Err(broke("stop", format!("the server did not exit within 60 s of {how:?}"))),
        }
    }

    /// Calls a tool of the current server; a protocol error or a hang is a failure.
    pub async fn call(&self, tool: &'static str, args: Value) -> Result<CallToolResult, Broke> {
        let client = self.server.as_ref().and_then(|s| s.client.as_ref()).ok_or_else(|| broke("op", "no server"))?;
        let args = args.as_object().cloned().unwrap_or_default();
        let call = client.call_tool(CallToolRequestParams::new(tool).with_arguments(args));
        match tokio::time::timeout(Duration::from_secs(180), call).await {
            Err(_) => Err(broke("hang", format!("{tool}: no answer within 180 s"))),
            Ok(Err(e)) => Err(broke("protocol", format!("{tool}: protocol error: {e}"))),
            Ok(Ok(r)) => Ok(r),
        }
    }

    /// Calls a tool that must succeed; returns its structured content.
    pub async fn ok(&self, tool: &'static str, args: Value) -> Result<Value, Broke> {
        let r = self.call(tool, args.clone()).await?;
        if r.is_error != Some(false) {
            return Err(broke("op", format!("{tool} {args} failed: {}", excerpt(&text(&r)))));
        }
        Ok(r.structured_content.unwrap_or(Value::Null))
    }

    /// `list_sessions`: each session's state.
    pub async fn listed(&self) -> Result<BTreeMap<String, String>, Broke> {
        let sc = self.ok("list_sessions", json!({})).await?;
        let mut out = BTreeMap::new();
        for s in sc["sessions"].as_array().into_iter().flatten() {
            let name = s["session"].as_str().unwrap_or_default().to_owned();
            out.insert(name, s["state"].as_str().unwrap_or_default().to_owned());
        }
        Ok(out)
    }

    /// The names of the snapshots `list_snapshots` shows.
    pub async fn snapshots(&self) -> Result<Vec<String>, Broke> {
        let sc = self.ok("list_snapshots", json!({})).await?;
        let list = sc["snapshots"].as_array().cloned().unwrap_or_default();
        Ok(list.iter().filter_map(|s| s["snapshot"].as_str().or(s["name"].as_str()).map(str::to_owned)).collect())
    }

    /// The last lines of the current server's log, for a failure's report.
    pub fn log_tail(&self, lines: usize) -> String {
        let Some(s) = &self.server else { return String::new() };
        let log = s.log.read();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].iter().map(|l| excerpt(l)).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for World {
    /// Whatever happened, nothing of this world stays: the server stops (leaving its
    /// sessions, as asked), then everything labelled with the prefix is removed, and the state dir.
    fn drop(&mut self) {
        drop(self.server.take());
        crate::audit::sweep_blocking(&self.prefix);
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// At most 400 characters of `s`.
pub fn excerpt(s: &str) -> String {
    if s.chars().count() <= 400 {
        return s.to_owned();
    }
    let head: String = s.chars().take(400).collect();
    format!("{head}… ({} bytes in all)", s.len())
}

/// Session and snapshot names as the tools see them.
pub fn sname(s: u8) -> String {
    format!("s{s}")
}

pub fn pname(p: u8) -> String {
    format!("p{p}")
}
