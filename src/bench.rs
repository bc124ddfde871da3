//! `pyberth bench`: pyberth's figures beside the raw Docker floors measured in the same run,
//! so every figure also reads as a ratio. It drives the real binary over MCP stdio, as a
//! desktop agent does. It fails only when something breaks, never on a missed target.
//!
//! Why this file passes 500 lines: one harness, read top to bottom, each figure beside the
//! Docker floor it is measured against; splitting it would scatter the pairs.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, ListContainersOptionsBuilder, RemoveContainerOptionsBuilder, StatsOptionsBuilder,
};
use futures::StreamExt;
use pyberth::docker::Engine;
use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use pyberth::config::SandboxConfig;
use pyberth::docker::{LABEL_INSTANCE, LABEL_MANAGED, image};

/// p50 and p95 of a set of durations, in milliseconds.
fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= q <= 1: an index in range
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(i).map(|d| d.as_secs_f64() * 1e3).unwrap_or(f64::NAN)
    };
    (at(0.50), at(0.95))
}

/// Latency rows, and figure rows placed after the latency row they follow.
struct Table(Vec<(String, f64, f64, String)>, Vec<(usize, String, String, String)>);

impl Table {
    fn add(&mut self, what: &str, samples: &mut [Duration], note: String) -> (f64, f64) {
        let (p50, p95) = percentiles(samples);
        self.0.push((what.to_owned(), p50, p95, note));
        (p50, p95)
    }

    /// A row with one figure that is not a latency.
    fn text(&mut self, what: &str, figure: String, note: String) {
        self.1.push((self.0.len(), what.to_owned(), figure, note));
    }

    /// Sets the note of the last latency row.
    fn note(&mut self, note: String) {
        if let Some(row) = self.0.last_mut() {
            row.3 = note;
        }
    }

    fn print(&self) {
        let mut out = String::new();
        out.push_str(&format!("{:<58} {:>10} {:>10}  {}\n", "measurement", "p50 ms", "p95 ms", "note"));
        for i in 0..=self.0.len() {
            for (_, what, figure, note) in self.1.iter().filter(|r| r.0 == i) {
                out.push_str(&format!("{what:<58} {figure:>21}  {note}\n"));
            }
            if let Some((what, p50, p95, note)) = self.0.get(i) {
                out.push_str(&format!("{what:<58} {p50:>10.3} {p95:>10.3}  {note}\n"));
            }
        }
        #[allow(clippy::print_stdout)] // the table is the command's output
        {
            print!("{out}");
        }
    }
}

/// What to measure beyond the basics.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchArgs {
    /// Warm runs to time.
    #[arg(long, default_value_t = 200)]
    pub runs: usize,
    /// Concurrent sessions to drive at once, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "8,32,128")]
    pub concurrency: Vec<usize>,
    /// Calls each concurrent session makes.
    #[arg(long, default_value_t = 10)]
    pub calls_per_session: usize,
    /// Sizes of stdout to stream through one run, MiB.
    #[arg(long, value_delimiter = ',', default_value = "10,100")]
    pub stdout_mib: Vec<usize>,
    /// Measure only the durable-session figures (snapshot, restore, fork, hibernate, wake).
    #[arg(long)]
    pub durable_only: bool,
    /// Measure only the first installs beside their floors (uv and pip in a plain container).
    #[arg(long, conflicts_with = "durable_only")]
    pub installer_only: bool,
}

/// `pyberth serve` as a child speaking over pipes, with extra environment.
/// The layer store of this bench run's servers: cold at the start, removed at the end.
fn bench_store() -> String {
    format!("pyberth-layers-bench-{}", std::process::id())
}

fn serve_command(
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
struct Server {
    child: tokio::process::Child,
    client: rmcp::service::RunningService<rmcp::RoleClient, ()>,
    pid: u32,
}

impl Server {
    async fn start(cfg: &SandboxConfig, instance: &str, env: &[(&str, String)]) -> anyhow::Result<Self> {
        let mut child = serve_command(cfg, instance, env)?.spawn().context("cannot start pyberth serve")?;
        let (Some(stdout), Some(stdin), Some(pid)) = (child.stdout.take(), child.stdin.take(), child.id()) else {
            bail!("no pipes to the server");
        };
        let client = ().serve((stdout, stdin)).await.context("MCP initialise")?;
        Ok(Self { child, client, pid })
    }

    /// One `run_python` call that must succeed; returns its text.
    async fn run(&self, session: &str, code: &str, packages: &[&str]) -> anyhow::Result<String> {
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

    /// Resident and peak resident memory of the server process, KiB.
    fn memory_kb(&self) -> (Option<u64>, Option<u64>) {
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
    fn reset_peak(&self) {
        let _ = std::fs::write(format!("/proc/{}/clear_refs", self.pid), "5");
    }

    async fn stop(mut self) {
        let _ = self.client.cancel().await;
        let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
    }
}

fn mib(kb: Option<u64>) -> String {
    kb.map(|k| format!("{:.1} MiB", k as f64 / 1024.0)).unwrap_or_else(|| "n/a".into())
}

/// Runs the benchmark and prints its figures.
pub(crate) async fn run(mut cfg: SandboxConfig, args: BenchArgs) -> anyhow::Result<()> {
    let host = pyberth::app::Host::open(&cfg).await?;
    // Settles the runtime (`auto` included) and says whether gVisor is there, as serve does.
    let engine = host.check(&mut cfg, pyberth::app::Voice::Loud).await?;
    let docker = host.docker;
    let progress = |line: &str| tracing::info!(target: "pyberth::image", "{line}");
    let img = image::ensure(&docker, &cfg, &progress).await?;
    let mut table = Table(Vec::new(), Vec::new());
    let runs = args.runs.max(10);
    let runtime = cfg.runtime.clone();

    if args.durable_only {
        let result = durable(&docker, &cfg, &img, &format!("bench-{}", std::process::id()), &mut table).await;
        let result = match result {
            Ok(()) => durable_reattach(&cfg, &format!("bench-{}", std::process::id()), &mut table).await,
            e => e,
        };
        let opts = bollard::query_parameters::RemoveVolumeOptionsBuilder::default().force(true).build();
        let _ = docker.remove_volume(&bench_store(), Some(opts)).await;
        result?;
        table.print();
        return Ok(());
    }

    if args.installer_only {
        let result = installer_rows(&cfg, &docker, &img, &mut table).await;
        // The server's pooled containers mount the store and may still be going: retried.
        for _ in 0..20 {
            let opts = bollard::query_parameters::RemoveVolumeOptionsBuilder::default().force(true).build();
            match docker.remove_volume(&bench_store(), Some(opts)).await {
                Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                _ => break,
            }
        }
        result?;
        table.print();
        return Ok(());
    }

    // Floors: the engine alone, under the runtime sandboxes get.
    let container = floor_container(&docker, &img, runtime.as_deref()).await?;
    let floors = floors(&docker, &img, &container, runs, &mut table).await;
    remove(&docker, &container).await;
    let (create_p50, stream_p50) = floors?;

    // pyberth over MCP stdio, with the pool as configured and room for every bench session.
    let instance = format!("bench-{}", std::process::id());
    let most = args.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let sessions_needed: usize = args.concurrency.iter().sum::<usize>() + 32;
    let env = [
        ("PYBERTH_POOL_SIZE", cfg.pool_size.to_string()),
        ("PYBERTH_MAX_SESSIONS", sessions_needed.to_string()),
        ("PYBERTH_MAX_RUNS_PER_CALLER", most.to_string()),
    ];
    let t0 = Instant::now();
    let server = Server::start(&cfg, &instance, &env).await?;
    server.run("bench", "1", &[]).await?;
    let mut startup = [t0.elapsed()];
    table.add(
        "server start to first result (existing image)",
        &mut startup,
        "process spawn, MCP init, new session, run".into(),
    );

    let mut warm = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        server.run("bench", "x = 1\nx + 1", &[]).await?;
        warm.push(t.elapsed());
    }
    let (warm_p50, _) =
        table.add(&format!("warm run_python through MCP stdio ({runs} calls)"), &mut warm, String::new());
    table.note(format!("{:.1}x the attached-stream floor; rmcp client", warm_p50 / stream_p50));
    let mut raw = raw_warm(&cfg, &format!("{instance}-raw"), runs, &[]).await?;
    let (raw_p50, _) =
        table.add(&format!("warm run_python, raw JSON-RPC lines ({runs} calls)"), &mut raw, String::new());
    table.note(format!("{:.1}x the floor; the server's share, no client library", raw_p50 / stream_p50));

    if cfg.pool_size > 0 {
        let mut fresh = fresh_samples(&server, "pooled", cfg.pool_size).await?;
        let what = format!("first call in a new session ({} sessions, pool {})", fresh.len(), cfg.pool_size);
        let (p50, _) = table.add(&what, &mut fresh, String::new());
        table.note(format!("{:.2}x container create+start", p50 / create_p50));
    }

    // Dependency layers: a cold install, then the same set from the cache. The bench's servers
    // share a layer store of their own (`bench_store`), so first installs are first; the
    // installer runs under the engine's default runtime, so under gVisor too.
    layers_rows(&server, &mut table).await?;
    cached_set_rows(&server, cfg.pool_size, &mut table).await?;
    installer_rows(&cfg, &docker, &img, &mut table).await?;
    concurrency_and_memory(&docker, &server, &instance, &args, &mut table).await?;
    server.stop().await;

    // The same fresh-session figure without the pool, from a server that has none.
    let plain = Server::start(&cfg, &format!("{instance}-nopool"), &[("PYBERTH_POOL_SIZE", "0".into())]).await?;
    plain.run("first", "1", &[]).await?;
    let mut fresh = fresh_samples(&plain, "plain", 0).await?;
    let (p50, _) = table.add(
        &format!("first call in a new session ({} sessions, pool 0)", fresh.len()),
        &mut fresh,
        String::new(),
    );
    table.note(format!("{:.2}x container create+start", p50 / create_p50));
    plain.stop().await;

    output_volume(&cfg, &instance, &args, &mut table).await?;
    durable(&docker, &cfg, &img, &instance, &mut table).await?;
    durable_reattach(&cfg, &instance, &mut table).await?;
    table.print();

    // Both runtimes side by side, on what a runtime changes, when the engine has gVisor.
    if let Some(g) = &engine.gvisor {
        let other = if engine.runtime == g.name { &engine.default_runtime } else { &engine.runtime };
        if other != &g.name {
            side_by_side(&docker, &cfg, &img, &instance, runs, [other, &g.name]).await?;
        }
    }
    // Last: the side-by-side servers use the bench's store too.
    let opts = bollard::query_parameters::RemoveVolumeOptionsBuilder::default().force(true).build();
    let _ = docker.remove_volume(&bench_store(), Some(opts)).await;
    Ok(())
}

/// A cold install, then the same set from the cache.
async fn layers_rows(server: &Server, table: &mut Table) -> anyhow::Result<()> {
    let t = Instant::now();
    server.run("deps-cold", "import tomli", &["tomli"]).await?;
    let mut cold = [t.elapsed()];
    table.add(
        "new session with packages=[tomli], first install",
        &mut cold,
        "installer container + store write".into(),
    );
    let mut hits = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        server.run(&format!("deps-hit{i}"), "import tomli", &["tomli"]).await?;
        hits.push(t.elapsed());
    }
    table.add("new session with packages=[tomli], cached layer", &mut hits, String::new());
    Ok(())
}

/// A cached set attached (docs/design.md D6), each beside its floor from the same server: a new
/// session asking for it beside a new session asking for nothing (both from the pool when
/// there is one), and a running session adding it beside a warm run in that session.
async fn cached_set_rows(server: &Server, pool: usize, table: &mut Table) -> anyhow::Result<()> {
    let close = |name: String| async move {
        let args = json!({ "session": name });
        let params =
            CallToolRequestParams::new("close_session").with_arguments(args.as_object().cloned().unwrap_or_default());
        let _ = server.client.call_tool(params).await;
    };
    server.run("set-warmup", "import tomli", &["tomli"]).await?;
    close("set-warmup".into()).await;
    let (mut floor, mut fresh, mut live_floor, mut live) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..8 {
        for (name, packages) in [(format!("set-floor{i}"), &[][..]), (format!("set-new{i}"), &["tomli"][..])] {
            if pool > 0 {
                tokio::time::sleep(Duration::from_millis(1500)).await; // the pool has refilled
            }
            let t = Instant::now();
            server.run(&name, "import sys", packages).await?;
            if packages.is_empty() {
                floor.push(t.elapsed())
            } else {
                fresh.push(t.elapsed())
            }
            close(name).await;
        }
        let name = format!("set-live{i}");
        server.run(&name, "x = 1", &[]).await?;
        let t = Instant::now();
        server.run(&name, "x", &[]).await?;
        live_floor.push(t.elapsed());
        let t = Instant::now();
        server.run(&name, "import tomli\nx", &["tomli"]).await?;
        live.push(t.elapsed());
        close(name).await;
    }
    let (floor_p50, _) = table.add(&format!("new session, no packages (pool {pool})"), &mut floor, "floor".into());
    let (p50, _) = table.add("new session asking for a cached set", &mut fresh, String::new());
    table.note(format!("target <= 50 ms; floor + {:.1} ms", p50 - floor_p50));
    let (floor_p50, _) = table.add("warm run in a running session", &mut live_floor, "floor".into());
    let (p50, _) = table.add("running session adding a cached set", &mut live, String::new());
    table.note(format!("target <= 100 ms; floor + {:.1} ms", p50 - floor_p50));
    Ok(())
}

/// Many sessions at once, each making its calls one after another; then the memory per idle
/// session they leave.
async fn concurrency_and_memory(
    docker: &dyn Engine,
    server: &Server,
    instance: &str,
    args: &BenchArgs,
    table: &mut Table,
) -> anyhow::Result<()> {
    let (rss_before, _) = server.memory_kb();
    let mut made = 0;
    for &n in &args.concurrency {
        let names: Vec<String> = (0..n).map(|i| format!("c{n}-{i}")).collect();
        // Sessions exist before the clock starts: this measures calls, not container creation.
        let created: Vec<anyhow::Result<String>> =
            futures::stream::iter(names.iter()).map(|s| server.run(s, "0", &[])).buffer_unordered(8).collect().await;
        created.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        made += n;
        let calls = args.calls_per_session.max(1);
        let t = Instant::now();
        let per_session = futures::future::join_all(names.iter().map(|s| {
            let server = &server;
            async move {
                let mut lat = Vec::with_capacity(calls);
                for k in 0..calls {
                    let t = Instant::now();
                    server.run(s, &format!("{k} * 2"), &[]).await?;
                    lat.push(t.elapsed());
                }
                anyhow::Ok(lat)
            }
        }))
        .await;
        let elapsed = t.elapsed();
        let mut lat: Vec<Duration> = Vec::new();
        for l in per_session {
            lat.extend(l?);
        }
        let total = lat.len();
        table.add(&format!("{n} sessions x {calls} calls at once"), &mut lat, String::new());
        table.note(format!("{:.0} calls/s", total as f64 / elapsed.as_secs_f64()));
    }

    // Memory per idle session: the server's growth over the sessions just made, plus what
    // each of its containers holds (pool containers included: they are idle sessions too).
    let (rss_after, _) = server.memory_kb();
    if made > 0 {
        let server_kb = match (rss_before, rss_after) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) / made as u64),
            _ => None,
        };
        let (count, bytes) = containers_memory(docker, instance).await?;
        let container_kb = (count > 0).then(|| bytes / 1024 / count as u64);
        let total = server_kb.zip(container_kb).map(|(a, b)| a + b);
        table.text(
            &format!("memory per idle session ({count} containers)"),
            mib(total),
            format!("server {} + container {}", mib(server_kb), mib(container_kb)),
        );
    }
    Ok(())
}

/// Output volume: the cap raised to its 4 MiB ceiling, then more than that printed.
async fn output_volume(cfg: &SandboxConfig, instance: &str, args: &BenchArgs, table: &mut Table) -> anyhow::Result<()> {
    let cap = 4usize << 20;
    let loud = Server::start(
        cfg,
        &format!("{instance}-out"),
        &[("PYBERTH_POOL_SIZE", "0".into()), ("PYBERTH_OUTPUT_CAP", cap.to_string())],
    )
    .await?;
    loud.run("out", "1", &[]).await?;
    let (idle_rss, _) = loud.memory_kb();
    for &m in &args.stdout_mib {
        loud.reset_peak();
        let code =
            format!("import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range({}):\n    sys.stdout.write(line)", m * 1024);
        let t = Instant::now();
        let text = loud.run("out", &code, &[]).await?;
        let mut took = [t.elapsed()];
        let (_, peak) = loud.memory_kb();
        table.add(&format!("{m} MiB of stdout in one run (cap 4 MiB)"), &mut took, String::new());
        table.note(format!(
            "{:.0} MiB/s, server peak {} (idle {}), result {:.1} MiB",
            m as f64 / took[0].as_secs_f64(),
            mib(peak),
            mib(idle_rss),
            text.len() as f64 / (1 << 20) as f64
        ));
    }
    loud.stop().await;
    Ok(())
}

/// The figures a runtime changes, under the engine's default runtime and under gVisor: a
/// container's start, the attached stream, a warm run, a new session without the pool, and an
/// idle session container's memory. Bounded: 8 containers, `runs` round trips and warm runs, and
/// 8 sessions per runtime.
async fn side_by_side(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    img: &str,
    instance: &str,
    runs: usize,
    runtimes: [&str; 2],
) -> anyhow::Result<()> {
    let mut rows: Vec<(String, [String; 2], Option<f64>)> = Vec::new();
    let mut put = |row: usize, what: String, col: usize, figure: String, value: f64| {
        if rows.len() <= row {
            rows.push((what, [String::new(), String::new()], None));
        }
        rows[row].1[col] = figure;
        // The ratio gVisor / default, once both are in.
        rows[row].2 = if col == 0 { Some(value) } else { rows[row].2.map(|d| value / d) };
    };
    for (col, runtime) in runtimes.iter().enumerate() {
        let ms = |p50: f64| format!("{p50:.2}");
        let mut create = Vec::new();
        for _ in 0..8 {
            let t = Instant::now();
            let id = floor_container(docker, img, Some(runtime)).await?;
            create.push(t.elapsed());
            remove(docker, &id).await;
        }
        let (p50, _) = percentiles(&mut create);
        put(0, "floor: container create + start, p50 ms".into(), col, ms(p50), p50);
        let container = floor_container(docker, img, Some(runtime)).await?;
        let trips = round_trips(docker, &container, runs).await;
        remove(docker, &container).await;
        let (p50, _) = percentiles(&mut trips?);
        put(1, "floor: round trip on an attached exec stream, p50 ms".into(), col, ms(p50), p50);
        let under = [("PYBERTH_RUNTIME", (*runtime).to_owned())];
        let mut raw = raw_warm(cfg, &format!("{instance}-rt{col}-raw"), runs, &under).await?;
        let (p50, _) = percentiles(&mut raw);
        put(2, format!("warm run_python, raw JSON-RPC ({runs} calls), p50 ms"), col, ms(p50), p50);
        let name = format!("{instance}-rt{col}");
        let env = [("PYBERTH_POOL_SIZE", "0".to_owned()), under[0].clone()];
        let server = Server::start(cfg, &name, &env).await?;
        server.run("first", "1", &[]).await?;
        let mut fresh = fresh_samples(&server, "fresh", 0).await?;
        let (p50, _) = percentiles(&mut fresh);
        put(3, "first call in a new session (pool 0), p50 ms".into(), col, ms(p50), p50);
        let (count, bytes) = containers_memory(docker, &name).await?;
        let kb = (count > 0).then(|| bytes / 1024 / count as u64);
        put(4, format!("memory of an idle session container ({count})"), col, mib(kb), kb.unwrap_or(0) as f64);
        server.stop().await;
    }
    let mut out = format!(
        "\nruntimes side by side\n{:<58} {:>12} {:>12} {:>8}\n",
        "measurement", runtimes[0], runtimes[1], "ratio"
    );
    for (what, [a, b], ratio) in rows {
        let ratio = ratio.filter(|r| r.is_finite()).map(|r| format!("{r:.1}x")).unwrap_or_default();
        out.push_str(&format!("{what:<58} {a:>12} {b:>12} {ratio:>8}\n"));
    }
    #[allow(clippy::print_stdout)] // the table is the command's output
    {
        print!("{out}");
    }
    Ok(())
}

/// Warm runs timed with a minimal client that writes JSON-RPC lines and reads the answer
/// line, so the figure is the server's (and the sandbox's) cost without a client library's.
async fn raw_warm(
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

/// First calls in 8 new sessions, spaced so a pool (if any) has refilled between them.
async fn fresh_samples(server: &Server, prefix: &str, pool: usize) -> anyhow::Result<Vec<Duration>> {
    let n = 8;
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
async fn containers_memory(docker: &dyn Engine, instance: &str) -> anyhow::Result<(usize, u64)> {
    let label = format!("{LABEL_INSTANCE}={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().filters(&filters).build();
    let ids: Vec<String> = docker.list_containers(Some(opts)).await?.into_iter().filter_map(|c| c.id).collect();
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

fn bench_labels() -> HashMap<String, String> {
    HashMap::from([(LABEL_MANAGED.to_owned(), "1".to_owned()), ("pyberth.bench".to_owned(), "floor".to_owned())])
}

async fn floor_container(docker: &dyn Engine, img: &str, runtime: Option<&str>) -> anyhow::Result<String> {
    let host_config = HostConfig {
        network_mode: Some("none".into()),
        init: Some(true),
        runtime: runtime.map(str::to_owned),
        ..Default::default()
    };
    let body = ContainerCreateBody {
        image: Some(img.into()),
        cmd: Some(vec!["sleep".into(), "infinity".into()]),
        labels: Some(bench_labels()),
        host_config: Some(host_config),
        ..Default::default()
    };
    static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("pyberth-bench-{}-{serial}", std::process::id());
    let c = docker.create_container(Some(CreateContainerOptionsBuilder::default().name(&name).build()), body).await?;
    docker.start_container(&c.id, None).await?;
    Ok(c.id)
}

async fn remove(docker: &dyn Engine, id: &str) {
    let opts = RemoveContainerOptionsBuilder::default().force(true).build();
    let _ = docker.remove_container(id, Some(opts)).await;
}

/// Measures the engine floors; returns p50 of create+start and of a round trip on an
/// attached stream.
async fn floors(
    docker: &dyn Engine,
    img: &str,
    container: &str,
    runs: usize,
    table: &mut Table,
) -> anyhow::Result<(f64, f64)> {
    let runtime = docker.inspect_container(container, None).await?.host_config.and_then(|h| h.runtime);
    let mut create = Vec::new();
    let mut create_rm = Vec::new();
    for _ in 0..8 {
        let t = Instant::now();
        let id = floor_container(docker, img, runtime.as_deref()).await?;
        create.push(t.elapsed());
        remove(docker, &id).await;
        create_rm.push(t.elapsed());
    }
    let (create_p50, _) = table.add("floor: container create + start", &mut create, "raw Docker API".into());
    table.add("floor: container create + start + remove", &mut create_rm, "raw Docker API".into());

    let mut execs = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        exec_to_end(docker, container, vec!["true"]).await?;
        execs.push(t.elapsed());
    }
    table.add("floor: a new exec running `true`", &mut execs, "one exec per run costs at least this".into());

    let mut py = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        exec_to_end(docker, container, vec!["python3", "-c", "print(1)"]).await?;
        py.push(t.elapsed());
    }
    table.add("floor: a new exec running python3 -c 'print(1)'", &mut py, String::new());

    let mut rt = round_trips(docker, container, runs).await?;
    let (stream_p50, _) =
        table.add("floor: round trip on an attached exec stream", &mut rt, "the floor for a warm run".into());
    Ok((create_p50, stream_p50))
}

/// Round trips over an already-attached stream: write a line, read it echoed (after 20 to warm up).
async fn round_trips(docker: &dyn Engine, container: &str, runs: usize) -> anyhow::Result<Vec<Duration>> {
    let echo = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()";
    let opts = CreateExecOptions {
        cmd: Some(vec!["python3", "-u", "-c", echo]),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        ..Default::default()
    };
    let ex = docker.create_exec(container, opts.into()).await?;
    let StartExecResults::Attached { mut output, mut input } = docker.start_exec(&ex.id, None).await? else {
        bail!("exec not attached");
    };
    let mut rt = Vec::with_capacity(runs);
    for i in 0..runs + 20 {
        let t = Instant::now();
        input.write_all(b"print(1)\n").await?;
        input.flush().await?;
        let mut got = 0;
        while got < 9 {
            match output.next().await {
                Some(Ok(LogOutput::StdOut { message })) => got += message.len(),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => bail!("echo exec ended"),
            }
        }
        if i >= 20 {
            rt.push(t.elapsed()); // the first rounds warm the path up
        }
    }
    Ok(rt)
}

async fn exec_to_end(docker: &dyn Engine, container: &str, cmd: Vec<&str>) -> anyhow::Result<()> {
    let opts = CreateExecOptions {
        cmd: Some(cmd),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        ..Default::default()
    };
    let ex = docker.create_exec(container, opts.into()).await?;
    if let StartExecResults::Attached { mut output, .. } = docker.start_exec(&ex.id, None).await? {
        while let Some(frame) = output.next().await {
            frame?;
        }
    }
    Ok(())
}

// ---- The installer: first installs beside the same command in a plain container ----

/// First installs of a small package (idna) and of pandas by pyberth (a new session asking for
/// it, its layer removed first), each beside its floor measured in the same run: the same uv
/// command in a plain container of the sandbox image (default network, a fresh volume for the
/// target, no hardening, no layer), and pip's for pandas. Both sides download cold: the bench
/// server runs with no shared download cache, the floors with `--no-cache`; both take uv from
/// the installer's tool volume, fetched beforehand by a warm-up install.
async fn installer_rows(cfg: &SandboxConfig, docker: &dyn Engine, img: &str, table: &mut Table) -> anyhow::Result<()> {
    let instance = format!("bench-{}-installer", std::process::id());
    // The pool as configured, as a new user has it: the session that asks comes from it.
    let env = [("PYBERTH_INSTALLER_CACHE_MB", "0".to_owned()), ("PYBERTH_POOL_SIZE", cfg.pool_size.to_string())];
    let server = Server::start(cfg, &instance, &env).await?;
    let result = async {
        // Warm-up: the sandbox image's first session, and uv in the tool volume.
        server.run("warm", "import tomli", &["tomli"]).await?;
        let uv = tool_volume(docker, img, cfg).await;
        let mut rows = Vec::new();
        for (package, code) in [("idna", "import idna"), ("pandas", "import pandas")] {
            // pyberth first: whatever a proxy between here and the index caches then favours
            // the floor, never pyberth.
            let t = Instant::now();
            server.run(&format!("first-{package}"), code, &[package]).await?;
            let ours = t.elapsed();
            let floor = floor_install(docker, img, cfg, uv.as_deref(), package, true).await?;
            rows.push((package, floor, ours));
        }
        for (package, floor, ours) in rows {
            let mut f = [floor];
            table.add(&format!("floor: uv pip install {package} in a plain container"), &mut f, "cold download".into());
            let mut o = [ours];
            table.add(&format!("new session with packages=[{package}], first install"), &mut o, String::new());
            let (o, f) = (ours.as_secs_f64(), floor.as_secs_f64());
            table.note(format!("floor + {:.2} s, {:.2}x the floor", o - f, o / f));
        }
        let pip = floor_install(docker, img, cfg, None, "pandas", false).await?;
        let mut p = [pip];
        table.add("floor: pip install pandas in a plain container", &mut p, "uv vs pip, same image".into());
        Ok::<_, anyhow::Error>(())
    }
    .await;
    server.stop().await;
    if tool_volume(docker, img, cfg).await.is_none() {
        table.text("installer floors", "pip".into(), "no uv in the tool volume: the uv floors ran pip".into());
    }
    result
}

/// The installer's shared volume the bench server uses on `img` (base image, index and uv
/// requirement, as its labels record them), if there is one.
async fn tool_volume(docker: &dyn Engine, img: &str, cfg: &SandboxConfig) -> Option<String> {
    let id = docker.inspect_image(img).await.ok()?.id?;
    let labels = [
        format!("pyberth.base-id={id}"),
        format!("pyberth.installer-uv={}", cfg.installer_uv),
        format!("pyberth.installer-index={}", cfg.index_url().unwrap_or_else(|| "default".into())),
        format!("pyberth.installer-extra-index={}", cfg.extra_index_url().unwrap_or_else(|| "none".into())),
    ];
    let mut wanted = vec!["pyberth.installer-volume"];
    wanted.extend(labels.iter().map(String::as_str));
    let filters = HashMap::from([("label", wanted)]);
    let opts = bollard::query_parameters::ListVolumesOptionsBuilder::default().filters(&filters).build();
    docker.list_volumes(Some(opts)).await.ok()?.volumes?.into_iter().next().map(|v| v.name)
}

/// One install of `package` in a plain container of `img`, timed from create to exit: uv from
/// the tool volume `uv` (read-only) when given and `with_uv`, else pip.
async fn floor_install(
    docker: &dyn Engine,
    img: &str,
    cfg: &SandboxConfig,
    uv: Option<&str>,
    package: &str,
    with_uv: bool,
) -> anyhow::Result<Duration> {
    use bollard::models::{Mount, MountType};
    let script = match (uv, with_uv) {
        (Some(_), true) => {
            "/var/tmp/uv/bin/uv pip install --no-config --python \"$(command -v python3)\" --link-mode copy \
             --compile-bytecode --no-cache --only-binary :all: --target /workspace/site -- \"$1\""
        }
        _ => {
            "python3 -m pip install --no-input --disable-pip-version-check --progress-bar off --no-cache-dir \
             --only-binary :all: --target /workspace/site -- \"$1\""
        }
    };
    let mut mounts =
        vec![Mount { target: Some("/workspace".into()), typ: Some(MountType::VOLUME), ..Default::default() }];
    if let Some(v) = uv {
        let read_only = Some(true);
        mounts.push(Mount {
            target: Some("/var/tmp".into()),
            source: Some(v.into()),
            typ: Some(MountType::VOLUME),
            read_only,
            ..Default::default()
        });
    }
    let mut env = vec!["UV_NO_PROGRESS=1".to_owned(), "UV_PYTHON_DOWNLOADS=never".to_owned(), "HOME=/tmp".to_owned()];
    if let Some(ca) = cfg.ca_bundle() {
        mounts.push(Mount {
            target: Some("/ca.pem".into()),
            source: Some(ca.display().to_string()),
            typ: Some(MountType::BIND),
            read_only: Some(true),
            ..Default::default()
        });
        env.extend(["SSL_CERT_FILE=/ca.pem".to_owned(), "PIP_CERT=/ca.pem".to_owned()]);
    }
    let body = ContainerCreateBody {
        image: Some(img.into()),
        cmd: Some(vec!["sh".into(), "-c".into(), script.into(), "floor".into(), package.into()]),
        env: Some(env),
        labels: Some(bench_labels()),
        host_config: Some(HostConfig { mounts: Some(mounts), runtime: cfg.runtime.clone(), ..Default::default() }),
        ..Default::default()
    };
    let t = Instant::now();
    let c = docker.create_container(None::<bollard::query_parameters::CreateContainerOptions>, body).await?;
    let run = async {
        docker.start_container(&c.id, None).await?;
        let mut wait = docker.wait_container(&c.id, None);
        match wait.next().await {
            Some(Ok(_)) => Ok(t.elapsed()),
            Some(Err(e)) => Err(anyhow::anyhow!("the floor install of {package} failed: {e}")),
            None => Err(anyhow::anyhow!("the floor install of {package} did not report its exit")),
        }
    }
    .await;
    let opts = RemoveContainerOptionsBuilder::default().force(true).v(true).build();
    let _ = docker.remove_container(&c.id, Some(opts)).await;
    run
}

impl Server {
    /// One tool call that must succeed; returns its text and structured content.
    async fn tool(&self, tool: &'static str, args: serde_json::Value) -> anyhow::Result<(String, serde_json::Value)> {
        let params = CallToolRequestParams::new(tool).with_arguments(args.as_object().cloned().unwrap_or_default());
        let r = self.client.call_tool(params).await.with_context(|| format!("{tool} failed at the protocol level"))?;
        let text: String = r.content.iter().filter_map(|c| c.as_text()).map(|t| t.text.as_str()).collect();
        if r.is_error != Some(false) {
            bail!("{tool} returned an error: {}", text.chars().take(500).collect::<String>());
        }
        Ok((text, r.structured_content.unwrap_or_default()))
    }
}

/// Durable sessions (issue 18): a snapshot and a restore of a session holding 200 MiB of
/// variables and 100 MiB of workspace files, beside the floor of a plain `docker cp` of the
/// same files out of and into a container; a fork of a small session; hibernate and wake.
/// numpy is not in the sandbox image (built offline from Debian packages), so the variables
/// are 200 bytes objects of 1 MiB each: pickle copies both the same way (one buffer each).
async fn durable(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    img: &str,
    instance: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let env = [
        ("PYBERTH_POOL_SIZE", "2".to_owned()),
        ("PYBERTH_MEMORY_MB", "3072".to_owned()),
        ("PYBERTH_SNAPSHOT_CACHE_MB", "4096".to_owned()),
        ("PYBERTH_HIBERNATE_AFTER_S", "1".to_owned()),
    ];
    let server = Server::start(cfg, &format!("{instance}-durable"), &env).await?;
    let big = "import os\nblobs = [os.urandom(1 << 20) for _ in range(200)]\nos.makedirs('files', exist_ok=True)\n\
               for i in range(100):\n    open('files/f%03d' % i, 'wb').write(os.urandom(1 << 20))";
    // Runs keep the session awake meanwhile: hibernation waits for 1 s of idleness.
    server.run("big", big, &[]).await?;
    let mut snaps = Vec::new();
    let mut restores = Vec::new();
    let (mut copies, mut globals) = (Vec::new(), Vec::new());
    let (mut saves, mut packs) = (Vec::new(), Vec::new());
    let mut state_mib = 0.0;
    for i in 0..3 {
        let t = Instant::now();
        let (_, sc) = server.tool("snapshot_session", json!({"session": "big", "name": format!("big{i}")})).await?;
        snaps.push(t.elapsed());
        saves.push(Duration::from_millis(sc["state_ms"].as_u64().unwrap_or(0)));
        packs.push(Duration::from_millis(sc["copy_ms"].as_u64().unwrap_or(0)));
        state_mib = sc["state_bytes"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 20);
        let t = Instant::now();
        let (_, rc) = server
            .tool("restore_session", json!({"snapshot": format!("big{i}"), "session": format!("copy{i}")}))
            .await?;
        restores.push(t.elapsed());
        copies.push(Duration::from_millis(rc["copy_ms"].as_u64().unwrap_or(0)));
        globals.push(Duration::from_millis(rc["globals_ms"].as_u64().unwrap_or(0)));
        server.tool("close_session", json!({"session": format!("copy{i}")})).await?;
        server.tool("delete_snapshot", json!({"snapshot": format!("big{i}")})).await?;
        server.run("big", "len(blobs)", &[]).await?;
    }
    // The way the state went before the packer, still taken when it does not fit in the
    // workspace: through the agent's stream, re-packed by the server (one round; a restore
    // would not fit either).
    let streamed_env = [
        ("PYBERTH_POOL_SIZE", "1".to_owned()),
        ("PYBERTH_MEMORY_MB", "3072".to_owned()),
        ("PYBERTH_WORKSPACE_MB", "256".to_owned()),
        ("PYBERTH_SNAPSHOT_CACHE_MB", "4096".to_owned()),
        ("PYBERTH_HIBERNATE_AFTER_S", "0".to_owned()),
    ];
    let streamed = Server::start(cfg, &format!("{instance}-streamed"), &streamed_env).await?;
    streamed.run("big", big, &[]).await?;
    let t = Instant::now();
    streamed.tool("snapshot_session", json!({"session": "big", "name": "s"})).await?;
    let mut stream_snaps = vec![t.elapsed()];
    // Not restored: the state does not fit in such a workspace either way.
    streamed.stop().await;
    let total_mib = state_mib + 100.0;
    let (snap_p50, _) =
        table.add("snapshot_session: 200 MiB of variables + 100 MiB of files", &mut snaps, String::new());
    table.note(format!(
        "{:.0} MiB/s ({state_mib:.0} MiB of state; bytes objects, numpy is not in the image); target 1000 ms",
        total_mib / (snap_p50 / 1e3)
    ));
    table.add("  of which the interpreter pickling its state into the workspace", &mut saves, String::new());
    let (pack_p50, _) =
        table.add("  of which the packer copying state and files into the volume", &mut packs, String::new());
    table.note(format!("{:.0} MiB/s, with the packer's container", total_mib / (pack_p50 / 1e3)));
    table.add("restore_session of it, whole call", &mut restores, "new session from the warm pool".into());
    let (copy_p50, _) = table.add("  of which copying state and files into the workspace", &mut copies, String::new());
    table.note(format!("{:.0} MiB/s", total_mib / (copy_p50 / 1e3)));
    table.add("  of which loading the globals", &mut globals, "target 300 ms".into());
    table.add(
        "snapshot_session, the same, state through the agent's stream",
        &mut stream_snaps,
        "a workspace too small for the pickles (--workspace-mb 256); 1 round".into(),
    );

    // The floor: the engine's archive API moving the same amount of files (100 of 1 MiB) into
    // a container and out of it again, as `docker cp` does both ways.
    let mut files = tar::Builder::new(Vec::new());
    for i in 0..100u32 {
        let data: Vec<u8> =
            (0..1u32 << 20).map(|b| (b.wrapping_mul(2_654_435_761).wrapping_add(i) >> 13).to_le_bytes()[0]).collect();
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        files.append_data(&mut h, format!("files/f{i:03}"), &data[..])?;
    }
    let files = bytes::Bytes::from(files.into_inner()?);
    let floor = floor_container(docker, img, cfg.runtime.as_deref()).await?;
    let (mut outs, mut ins) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        let opts = bollard::query_parameters::UploadToContainerOptionsBuilder::default().path("/tmp").build();
        docker.upload_to_container(&floor, Some(opts), pyberth::docker::body_full(files.clone())).await?;
        ins.push(t.elapsed());
        let t = Instant::now();
        let opts = bollard::query_parameters::DownloadFromContainerOptionsBuilder::default().path("/tmp/files").build();
        let mut got = 0usize;
        let mut stream = docker.download_from_container(&floor, Some(opts));
        while let Some(chunk) = stream.next().await {
            got += chunk?.len();
        }
        outs.push(t.elapsed());
        if got < 100 << 20 {
            bail!("the floor's download held {got} bytes");
        }
    }
    remove(docker, &floor).await;
    // The fixed cost of the packer: a container of the image made, run and removed.
    let mut runs = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let c = floor_container(docker, img, cfg.runtime.as_deref()).await?;
        remove(docker, &c).await;
        runs.push(t.elapsed());
    }
    table.add("floor: a container made, started and removed", &mut runs, "what a packer costs before it copies".into());
    let (in_p50, _) = table.add("floor: docker cp of 100 MiB of files into a container", &mut ins, String::new());
    table.note(format!("{:.0} MiB/s", 100.0 / (in_p50 / 1e3)));
    let (out_p50, _) = table.add("floor: docker cp of them out of it", &mut outs, String::new());
    table.note(format!("{:.0} MiB/s", 100.0 / (out_p50 / 1e3)));
    server.tool("close_session", json!({"session": "big"})).await?;

    // A small session: fork, then hibernate and wake.
    server
        .run("small", "import json\nclass P:\n    pass\np = P()\nd = {'a': 1}\nopen('x.txt', 'w').write('x')", &[])
        .await?;
    let mut forks = Vec::new();
    let mut fork_snap = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        let (_, fc) =
            server.tool("fork_session", json!({"session": "small", "new_session": format!("fork{i}")})).await?;
        forks.push(t.elapsed());
        fork_snap.push(Duration::from_millis(fc["snapshot_ms"].as_u64().unwrap_or(0)));
        server.tool("close_session", json!({"session": format!("fork{i}")})).await?;
        server.run("small", "1", &[]).await?;
    }
    table.add(
        "fork_session of a small session",
        &mut forks,
        "snapshot + restore into a pooled container; target 500 ms".into(),
    );
    table.add("  of which the snapshot", &mut fork_snap, String::new());
    let mut wakes = Vec::new();
    let mut server_wakes = Vec::new();
    for _ in 0..5 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (text, _) = server.tool("list_sessions", json!({})).await?;
            if text.contains("small: hibernated") {
                break;
            }
            if Instant::now() > deadline {
                bail!("the small session did not hibernate");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let t = Instant::now();
        let text = server.run("small", "d['a']", &[]).await?;
        wakes.push(t.elapsed());
        let woken = text.split("woken in ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok());
        server_wakes.push(Duration::from_millis(woken.unwrap_or(0)));
    }
    table.add("wake of a hibernated small session: first run_python", &mut wakes, "target 300 ms".into());
    table.add("  of which the wake (container from the pool, restore)", &mut server_wakes, String::new());
    server.stop().await;
    Ok(())
}

/// Reattach of a running session after a server restart (issue 18): a server that leaves its
/// sessions stops, the next one of the same state dir and instance adopts them, and its first
/// call reaches the same interpreter through a new relay. The second call after the restart
/// is the floor: the same run with the relay in place, so the difference is the reattach.
async fn durable_reattach(cfg: &SandboxConfig, instance: &str, table: &mut Table) -> anyhow::Result<()> {
    let state = std::env::temp_dir().join(format!("pyberth-bench-reattach-{}", std::process::id()));
    std::fs::create_dir_all(&state)?;
    let env = [
        ("PYBERTH_POOL_SIZE", "0".to_owned()),
        ("PYBERTH_KEEP_SESSIONS", "true".to_owned()),
        ("PYBERTH_STATE_DIR", state.display().to_string()),
    ];
    let name = format!("{instance}-reattach");
    let measured = async {
        let mut server = Server::start(cfg, &name, &env).await?;
        server.run("kept", "x = 42\nimport threading", &[]).await?;
        let (mut firsts, mut seconds, mut reattach) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..5 {
            server.stop().await;
            server = Server::start(cfg, &name, &env).await?;
            let t = Instant::now();
            let text = server.run("kept", "x", &[]).await?;
            let first = t.elapsed();
            if !text.contains("42") {
                bail!("the session was not reattached: {text}");
            }
            let t = Instant::now();
            server.run("kept", "x", &[]).await?;
            let second = t.elapsed();
            firsts.push(first);
            seconds.push(second);
            reattach.push(first.saturating_sub(second));
        }
        table.add("first run_python after a server restart (reattach)", &mut firsts, String::new());
        table.add("  floor: the next run_python, relay in place", &mut seconds, String::new());
        table.add("  reattach itself (first minus next)", &mut reattach, "target 100 ms".into());
        // The last server stops for good: no next one adopts.
        server.tool("close_session", json!({"session": "kept"})).await?;
        server.stop().await;
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&state);
    measured
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_right_samples() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let (p50, p95) = percentiles(&mut v);
        assert!((p50 - 50.0).abs() <= 1.0, "{p50}");
        assert!((p95 - 95.0).abs() <= 1.0, "{p95}");
    }
}
