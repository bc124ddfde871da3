//! `pyberth bench`: pyberth's figures beside the raw Docker floors measured in the same run,
//! so every figure also reads as a ratio. It drives the real binary over MCP stdio, as a
//! desktop agent does. It fails only when something breaks, never on a missed target.
//!
//! Each row is printed as soon as it is measured, with a progress line on stderr
//! (`table.rs`). The parts: `drive.rs` the servers it drives, `floors.rs` the engine's own
//! costs (and both runtimes side by side), `rows.rs` pyberth's figures through one server,
//! `install.rs` first installs beside uv and pip in a plain container, `durable.rs`
//! snapshots, forks, wakes and the reattach after a restart, `burst.rs` many new sessions at
//! once (`--burst N`).

use std::time::{Duration, Instant};

use pyberth::docker::Engine;

use pyberth::config::SandboxConfig;
use pyberth::docker::image;

mod burst;
mod cpu;
mod drive;
mod durable;
mod floors;
mod install;
mod parts;
mod rows;
mod table;
mod upstream;

use drive::{Server, bench_store, fresh_samples, raw_warm};
use table::Table;

/// What to measure beyond the basics.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchArgs {
    /// Warm runs to time.
    #[arg(long, default_value_t = 200)]
    pub runs: usize,
    /// Concurrent sessions to drive at once, one level after another [default: 8,32,128;
    /// with --quick, 8].
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Option<Vec<usize>>,
    /// Calls each concurrent session makes [default: 10; with --quick, 3].
    #[arg(long)]
    pub calls_per_session: Option<usize>,
    /// Sizes of stdout to stream through one run, MiB.
    #[arg(long, value_delimiter = ',', default_value = "10,100")]
    pub stdout_mib: Vec<usize>,
    /// Measure only the durable-session figures (snapshot, restore, fork, hibernate, wake).
    #[arg(long)]
    pub durable_only: bool,
    /// Measure only the first installs beside their floors (uv and pip in a plain container).
    #[arg(long, conflicts_with = "durable_only")]
    pub installer_only: bool,
    /// A first look in under a minute: the floors, a warm run, new sessions with and without
    /// the pool, 8 sessions at once, idle memory and 10 MiB of stdout, with fewer samples; no
    /// installs (no index needed), no durable sessions, no second runtime. Overrides --runs
    /// and --stdout-mib.
    #[arg(long, conflicts_with_all = ["durable_only", "installer_only"])]
    pub quick: bool,
    /// Measure only N new sessions asked for at once (at most 200): p50, p95, p99 of the time
    /// to each one's first result, from cold (the pool at --pool-size), then after that burst
    /// taught the pool; with what the pool held.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=burst::MOST),
          conflicts_with_all = ["durable_only", "installer_only", "quick"])]
    pub burst: Option<u16>,
    /// Code mode: time SERVER.TOOL (an upstream of the config file) called from Python in a
    /// session beside a direct MCP call to it, in the same run (with --quick too).
    #[arg(long, value_name = "SERVER.TOOL", conflicts_with_all = ["durable_only", "installer_only"])]
    pub upstream_bench: Option<String>,
    /// The tool's arguments, a JSON object.
    #[arg(long, value_name = "JSON", default_value = "{}", requires = "upstream_bench")]
    pub upstream_bench_args: String,
    /// The environment whose sessions make the bridged calls; it must allow the tool.
    #[arg(long, value_name = "NAME", default_value = "default", requires = "upstream_bench")]
    pub upstream_bench_environment: String,
}

/// How much of each is measured: the arguments, or `--quick`'s smaller set.
#[derive(Debug)]
pub(crate) struct Plan {
    runs: usize,
    concurrency: Vec<usize>,
    calls_per_session: usize,
    stdout_mib: Vec<usize>,
    /// Containers made (and removed) for the create floors.
    containers: usize,
    /// Execs timed for the exec floors.
    execs: usize,
    /// New sessions timed per fresh-session row.
    fresh: usize,
    /// Installs, the installer's floors, durable sessions, both runtimes.
    everything: bool,
}

impl Plan {
    fn of(args: &BenchArgs) -> Self {
        if args.quick {
            return Self {
                runs: 50,
                concurrency: args.concurrency.clone().unwrap_or_else(|| vec![8]),
                calls_per_session: args.calls_per_session.unwrap_or(3),
                stdout_mib: vec![10],
                containers: 3,
                execs: 6,
                fresh: 3,
                everything: false,
            };
        }
        Self {
            runs: args.runs.max(10),
            concurrency: args.concurrency.clone().unwrap_or_else(|| vec![8, 32, 128]),
            calls_per_session: args.calls_per_session.unwrap_or(10),
            stdout_mib: args.stdout_mib.clone(),
            containers: 8,
            execs: 20,
            fresh: 8,
            everything: true,
        }
    }

    /// The steps `run` takes, for the progress line.
    fn steps(&self, pool: bool) -> usize {
        let base = 5 + usize::from(pool);
        if self.everything { base + 4 } else { base }
    }
}

/// Runs the benchmark and prints its figures as they come. `config_file`: the one the
/// command read, for the servers it starts.
pub(crate) async fn run(
    mut cfg: SandboxConfig,
    args: BenchArgs,
    config_file: Option<std::path::PathBuf>,
) -> anyhow::Result<()> {
    let host = pyberth::app::Host::open(&cfg).await?;
    // Settles the runtime (`auto` included) and says whether gVisor is there, as serve does.
    let engine = host.check(&mut cfg, pyberth::app::Voice::Loud).await?;
    let docker = host.docker;
    let progress = |line: &str| tracing::info!(target: "pyberth::image", "{line}");
    let img = image::ensure(&docker, &cfg, &progress).await?;
    let instance = format!("bench-{}", std::process::id());
    let plan = Plan::of(&args);
    let result = if args.durable_only {
        let mut table = Table::new(2);
        table.step("durable sessions: snapshot, restore, fork, wake");
        let r = durable::durable(&docker, &cfg, &img, &instance, &mut table).await;
        let r = match r {
            Ok(()) => {
                table.step("reattach after a server restart");
                durable::durable_reattach(&docker, &cfg, &img, &instance, &mut table).await
            }
            e => e,
        };
        table.finish();
        r
    } else if let Some(n) = args.burst {
        let mut table = Table::new(3);
        let r = burst::burst(&docker, &cfg, &format!("{instance}-burst"), n.into(), &mut table).await;
        table.finish();
        r
    } else if args.installer_only {
        let mut table = Table::new(1);
        table.step("first installs beside uv and pip in a plain container");
        let r = install::installer_rows(&cfg, &docker, &img, &mut table).await;
        table.finish();
        r
    } else {
        let bridged = args.upstream_bench.as_deref();
        let mut table = Table::new(plan.steps(cfg.pool_size > 0) + usize::from(bridged.is_some()));
        let r = whole(&docker, &cfg, &img, &instance, &plan, &mut table).await;
        let r = match r {
            Ok(()) if bridged.is_some() => {
                table.step("code mode: a bridged call beside a direct one");
                upstream::rows(&cfg, config_file.as_deref(), &instance, &args, plan.runs, &mut table).await
            }
            r => r,
        };
        let r = match (r, &engine.gvisor) {
            // Both runtimes side by side, on what a runtime changes, when the engine has gVisor.
            (Ok(()), Some(g)) if plan.everything => {
                let other = if engine.runtime == g.name { &engine.default_runtime } else { &engine.runtime };
                if other == &g.name {
                    Ok(())
                } else {
                    table.step("both runtimes side by side");
                    floors::side_by_side(&docker, &cfg, &img, &instance, plan.runs, [other, &g.name], &mut table).await
                }
            }
            (r, _) => r,
        };
        table.finish();
        r
    };
    remove_store(&docker).await;
    result
}

/// Every step but the second runtime's, in order.
async fn whole(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    img: &str,
    instance: &str,
    plan: &Plan,
    table: &mut Table,
) -> anyhow::Result<()> {
    // Floors: the engine alone, under the runtime sandboxes get.
    table.step("Docker floors: containers, execs, an attached stream");
    let container = floors::floor_container(docker, img, cfg.runtime.as_deref()).await?;
    let floors = floors::floors(docker, img, &container, plan, table).await;
    floors::remove(docker, &container).await;
    let floors = floors?;
    if plan.everything {
        // Before the first server: its pool, grown by the rows before, went on making
        // containers (four at once) through the first installs (idna's was floor + 1.5-1.8 s
        // there, + 0.6 s here), against floors measured on a quiet engine. The installer's
        // server is alone here, as with --installer-only.
        table.step("first installs beside uv and pip in a plain container");
        install::installer_rows(cfg, docker, img, table).await?;
    }
    let server = first_server(cfg, instance, plan, floors, table).await?;
    let measured = with_first_server(docker, cfg, instance, plan, floors.create, &server, table).await;
    server.stop().await;
    measured?;
    table.step("new sessions without the pool");
    let plain = Server::start(cfg, &format!("{instance}-nopool"), &[("PYBERTH_POOL_SIZE", "0".into())]).await?;
    plain.run("first", "1", &[]).await?;
    let mut fresh = fresh_samples(&plain, "plain", 0, plan.fresh).await?;
    let what = format!("first call in a new session ({} sessions, pool 0)", fresh.len());
    let (p50, _) = table.add(&what, &mut fresh, String::new());
    table.note(first_python_ratio(p50, floors));
    plain.stop().await;
    table.step("output volume");
    rows::output_volume(cfg, instance, plan, table).await?;
    if plan.everything {
        table.step("durable sessions: snapshot, restore, fork, wake");
        durable::durable(docker, cfg, img, instance, table).await?;
        table.step("reattach after a server restart");
        durable::durable_reattach(docker, cfg, img, instance, table).await?;
    }
    Ok(())
}

/// The server most rows go through, with the pool as configured and room for every bench
/// session; its start to a first result, then warm runs through rmcp and as bare lines.
async fn first_server(
    cfg: &SandboxConfig,
    instance: &str,
    plan: &Plan,
    floors: floors::Floors,
    table: &mut Table,
) -> anyhow::Result<Server> {
    let stream_p50 = floors.stream;
    table.step("server start, warm runs");
    let most = plan.concurrency.iter().copied().max().unwrap_or(1).max(1);
    let sessions_needed: usize = plan.concurrency.iter().sum::<usize>() + 32;
    let env = [
        ("PYBERTH_POOL_SIZE", cfg.pool_size.to_string()),
        ("PYBERTH_MAX_SESSIONS", sessions_needed.to_string()),
        ("PYBERTH_MAX_RUNS_PER_CALLER", most.to_string()),
    ];
    let t0 = Instant::now();
    let server = Server::start(cfg, instance, &env).await?;
    server.run("bench", "1", &[]).await?;
    let mut startup = [t0.elapsed()];
    let note = "process spawn, MCP init, new session, run".into();
    let (p50, _) = table.add("server start to first result (existing image)", &mut startup, note);
    table.note(first_python_ratio(p50, floors));
    let runs = plan.runs;
    let mut warm = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        server.run("bench", "x = 1\nx + 1", &[]).await?;
        warm.push(t.elapsed());
    }
    let (warm_p50, _) =
        table.add(&format!("warm run_python through MCP stdio ({runs} calls)"), &mut warm, String::new());
    table.note(format!("{:.1}x the attached-stream floor; rmcp client", warm_p50 / stream_p50));
    let mut raw = raw_warm(cfg, &format!("{instance}-raw"), runs, &[]).await?;
    let (raw_p50, _) =
        table.add(&format!("warm run_python, raw JSON-RPC lines ({runs} calls)"), &mut raw, String::new());
    table.note(format!("{:.1}x the floor; the server's share, no client library", raw_p50 / stream_p50));
    Ok(server)
}

/// The rows through the first server: pooled sessions, layers and installs (unless quick),
/// concurrency and idle memory.
async fn with_first_server(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    instance: &str,
    plan: &Plan,
    create_p50: f64,
    server: &Server,
    table: &mut Table,
) -> anyhow::Result<()> {
    if cfg.pool_size > 0 {
        table.step("new sessions from the warm pool");
        let mut fresh = fresh_samples(server, "pooled", cfg.pool_size, plan.fresh).await?;
        let what = format!("first call in a new session ({} sessions, pool {})", fresh.len(), cfg.pool_size);
        let (p50, _) = table.add(&what, &mut fresh, String::new());
        table.note(format!("{:.2}x container create+start", p50 / create_p50));
    }
    if plan.everything {
        // Dependency layers: a cold install, then the same set from the cache. The bench's
        // servers share a layer store of their own (`bench_store`), so first installs are
        // first; the installer runs under the engine's default runtime, so under gVisor too.
        table.step("dependency layers: a first install, cached sets");
        rows::layers_rows(server, table).await?;
        rows::cached_set_rows(server, cfg.pool_size, table).await?;
    }
    table.step("sessions at once, idle memory");
    // The breakdowns read the host's /proc: only when the engine runs here, and its
    // containers' processes are host processes (under gVisor `docker top` names the sandbox's).
    let local = cfg.docker_host.as_deref().is_none_or(|h| h.is_empty() || h.starts_with("unix://"))
        && !cfg.runtime.as_deref().is_some_and(|r| r.contains("runsc"));
    rows::concurrency_and_memory(docker, server, instance, plan, local, table).await
}

/// The bench's layer store; pooled containers mounting it may still be going: retried.
async fn remove_store(docker: &dyn Engine) {
    for _ in 0..20 {
        let opts = bollard::query_parameters::RemoveVolumeOptionsBuilder::default().force(true).build();
        match docker.remove_volume(&bench_store(), Some(opts)).await {
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            _ => break,
        }
    }
}

/// A new container's first result against both floors: the engine's create and start, and
/// those with a first interpreter run to its end.
fn first_python_ratio(p50: f64, floors: floors::Floors) -> String {
    format!(
        "{:.2}x container create+start, {:.2}x with a first python3 run",
        p50 / floors.create,
        p50 / floors.first_python
    )
}
