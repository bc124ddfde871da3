//! The bench's servers: `pyberth serve` children driven over MCP stdio (with rmcp's client, or
//! bare JSON-RPC lines), and what they hold.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bollard::query_parameters::{ListContainersOptionsBuilder, StatsOptionsBuilder};
use futures::StreamExt;
use pyberth::docker::Engine;
use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use pyberth::config::SandboxConfig;
use pyberth::docker::LABEL_INSTANCE;

/// The layer store of this bench run's servers: cold at the start, removed at the end.
pub(super) fn bench_store() -> String {
    format!("pyberth-layers-bench-{}", std::process::id())
}

/// `pyberth serve` as a child speaking over pipes, with extra environment.
pub(super) fn serve_command(
    cfg: &SandboxConfig,
    instance: &str,
    env: &[(&str, String)],
) -> anyhow::Result<tokio::process::Command> {
    let exe = std::env::current_exe().context("cannot find the pyberth binary")?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("serve")
        .env("PYBERTH_INSTANCE", instance)
        // Engine warnings were printed by this process already; failures still show.
        // PYBERTH_BENCH_SERVER_LOG: the servers' own filter, for a breakdown of their steps.
        .env("RUST_LOG", std::env::var("PYBERTH_BENCH_SERVER_LOG").unwrap_or_else(|_| "error".into()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        // The runtime settled at start (`auto` resolved); empty is the engine's default.
        .env("PYBERTH_RUNTIME", cfg.runtime.as_deref().unwrap_or_default())
        .env("PYBERTH_LAYER_STORE", bench_store());
    for (k, v) in env {
        cmd.env(k, v);
    }
    if let Some(h) = &cfg.docker_host {
        cmd.env("DOCKER_HOST", h);
    }
    Ok(cmd)
}

/// One `pyberth serve` child driven over MCP stdio.
pub(super) struct Server {
    child: tokio::process::Child,
    pub(super) client: rmcp::service::RunningService<rmcp::RoleClient, ()>,
    pid: u32,
}

impl Server {
    pub(super) async fn start(cfg: &SandboxConfig, instance: &str, env: &[(&str, String)]) -> anyhow::Result<Self> {
        let mut child = serve_command(cfg, instance, env)?.spawn().context("cannot start pyberth serve")?;
        let (Some(stdout), Some(stdin), Some(pid)) = (child.stdout.take(), child.stdin.take(), child.id()) else {
            bail!("no pipes to the server");
        };
        let client = ().serve((stdout, stdin)).await.context("MCP initialise")?;
        Ok(Self { child, client, pid })
    }

    /// One `run_python` call that must succeed; returns its text.
    pub(super) async fn run(&self, session: &str, code: &str, packages: &[&str]) -> anyhow::Result<String> {
        let args = json!({ "session": session, "code": code, "packages": packages });
        let params =
            CallToolRequestParams::new("run_python").with_arguments(args.as_object().cloned().unwrap_or_default());
        let r = self.client.call_tool(params).await.context("run_python failed at the protocol level")?;
        let text: String = r.content.iter().filter_map(|c| c.as_text()).map(|t| t.text.as_str()).collect();
        if r.is_error != Some(false) {
            bail!("run_python returned an error: {}", text.chars().take(500).collect::<String>());
        }
        Ok(text)
    }

    /// The server's process id (the bench's CPU rows read its threads).
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Resident and peak resident memory of the server process, KiB.
    pub(super) fn memory_kb(&self) -> (Option<u64>, Option<u64>) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        let field = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Resets the peak-RSS mark (Linux 4.0+), so a later peak belongs to what ran since.
    pub(super) fn reset_peak(&self) {
        let _ = std::fs::write(format!("/proc/{}/clear_refs", self.pid), "5");
    }

    pub(super) async fn stop(mut self) {
        let _ = self.client.cancel().await;
        // A server closing a hundred sessions on two loaded cores takes a while: killed
        // before it ends, it would leave them for the next server's sweep.
        let _ = tokio::time::timeout(Duration::from_secs(180), self.child.wait()).await;
    }
}

impl Server {
    /// One tool call that must succeed; returns its text and structured content.
    pub(super) async fn tool(
        &self,
        tool: &'static str,
        args: serde_json::Value,
    ) -> anyhow::Result<(String, serde_json::Value)> {
        let params = CallToolRequestParams::new(tool).with_arguments(args.as_object().cloned().unwrap_or_default());
        let r = self.client.call_tool(params).await.with_context(|| format!("{tool} failed at the protocol level"))?;
        let text: String = r.content.iter().filter_map(|c| c.as_text()).map(|t| t.text.as_str()).collect();
        if r.is_error != Some(false) {
            bail!("{tool} returned an error: {}", text.chars().take(500).collect::<String>());
        }
        Ok((text, r.structured_content.unwrap_or_default()))
    }
}

pub(super) fn mib(kb: Option<u64>) -> String {
    kb.map(|k| format!("{:.1} MiB", k as f64 / 1024.0)).unwrap_or_else(|| "n/a".into())
}

/// Warm runs timed with a minimal client that writes JSON-RPC lines and reads the answer
/// line, so the figure is the server's (and the sandbox's) cost without a client library's.
pub(super) async fn raw_warm(
    cfg: &SandboxConfig,
    instance: &str,
    runs: usize,
    env: &[(&str, String)],
) -> anyhow::Result<Vec<Duration>> {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut env = env.to_vec();
    env.push(("PYBERTH_POOL_SIZE", "0".into()));
    let mut cmd = serve_command(cfg, instance, &env)?;
    let mut child = cmd.spawn().context("cannot start pyberth serve")?;
    let (Some(stdout), Some(mut stdin)) = (child.stdout.take(), child.stdin.take()) else {
        bail!("no pipes to the server");
    };
    let mut lines = BufReader::new(stdout).lines();
    let mut exchange = async |id: u64, msg: serde_json::Value| -> anyhow::Result<serde_json::Value> {
        let mut line = msg.to_string().into_bytes();
        line.push(b'\n');
        stdin.write_all(&line).await?;
        stdin.flush().await?;
        if id == 0 {
            return Ok(serde_json::Value::Null); // a notification: no answer
        }
        loop {
            let Some(line) = lines.next_line().await? else { bail!("the server closed its stdout") };
            let v: serde_json::Value = serde_json::from_str(&line)?;
            if v["id"] == id {
                return Ok(v);
            }
        }
    };
    let init = json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": { "name": "bench", "version": "0" } } });
    exchange(1, init).await?;
    exchange(0, json!({ "jsonrpc": "2.0", "method": "notifications/initialized" })).await?;
    let mut samples = Vec::with_capacity(runs);
    for i in 0..runs + 20 {
        let id = 2 + i as u64;
        let call = json!({ "jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": { "name": "run_python", "arguments": { "session": "raw", "code": "x = 1\nx + 1" } } });
        let t = Instant::now();
        let v = exchange(id, call).await?;
        if v["result"]["isError"] != false {
            bail!("run_python failed: {v}");
        }
        if i >= 20 {
            samples.push(t.elapsed()); // the first calls create the session and warm up
        }
    }
    drop(stdin);
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    Ok(samples)
}

/// First calls in `n` new sessions, spaced so a pool (if any) has refilled between them.
pub(super) async fn fresh_samples(
    server: &Server,
    prefix: &str,
    pool: usize,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut fresh = Vec::with_capacity(n);
    for i in 0..n {
        if pool > 0 {
            // New sessions arriving now and then, not in a burst: the pool has refilled.
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
        let t = Instant::now();
        server.run(&format!("{prefix}{i}"), "1", &[]).await?;
        fresh.push(t.elapsed());
    }
    Ok(fresh)
}

/// Containers of one server instance and the memory they hold (page cache not counted).
pub(super) async fn containers_memory(docker: &dyn Engine, instance: &str) -> anyhow::Result<(usize, u64)> {
    let ids = containers_of(docker, instance).await?;
    let usages: Vec<Option<u64>> = futures::stream::iter(ids.iter())
        .map(|id| async move {
            let opts = StatsOptionsBuilder::default().stream(false).one_shot(true).build();
            let s = docker.stats(id, Some(opts)).next().await?.ok()?;
            let m = s.memory_stats?;
            let stats = m.stats.unwrap_or_default();
            let cache = stats.get("total_inactive_file").or_else(|| stats.get("inactive_file")).copied().unwrap_or(0);
            Some(m.usage?.saturating_sub(cache))
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let known: Vec<u64> = usages.into_iter().flatten().collect();
    Ok((known.len(), known.iter().sum()))
}

/// The running containers of a server instance.
pub(super) async fn containers_of(docker: &dyn Engine, instance: &str) -> anyhow::Result<Vec<String>> {
    let label = format!("{LABEL_INSTANCE}={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().filters(&filters).build();
    Ok(docker.list_containers(Some(opts)).await?.into_iter().filter_map(|c| c.id).collect())
}
