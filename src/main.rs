//! The `pyberth` command line: `serve` (MCP over stdio or HTTP), `run` (CI), `image`,
//! `layers`, `envs`, `gc`, `bench`, `k8s manifests`.

use std::sync::Arc;

mod bench;
mod envs;
mod images_cli;

use anyhow::Context as _;
use clap::{CommandFactory as _, FromArgMatches as _, Parser, Subcommand};
use pyberth::app::Runtime;
use pyberth::config::{self, SandboxConfig};
use pyberth::docker::image;
use pyberth::http::HttpArgs;
use pyberth::packages as layers;
use pyberth::{Registry, SandboxServer};
use rmcp::ServiceExt as _;

/// Runs Python for AI agents in hardened Docker containers, over MCP.
#[derive(Debug, Parser)]
#[command(name = "pyberth", version)]
struct Cli {
    /// TOML configuration file: keys are the long flags with `_` for `-` (memory_mb = 1024).
    /// Flags and environment variables override it.
    #[arg(long, env = "PYBERTH_CONFIG", global = true, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once at start
enum Command {
    /// Serve MCP over stdio (what desktop agents launch), or over HTTP with --http.
    Serve {
        #[command(flatten)]
        cfg: SandboxConfig,
        #[command(flatten)]
        http: HttpArgs,
    },
    /// Manage the sandbox image.
    Image {
        #[command(subcommand)]
        action: ImageAction,
    },
    /// Manage dependency layers (cached package sets).
    Layers {
        #[command(subcommand)]
        action: LayersAction,
    },
    /// Run a script, or a command after `--`, in a fresh sandbox and exit with its status
    /// (for CI). 124: timeout, 125: pyberth or Docker failed, 130: interrupted, 137: out of memory.
    Run(pyberth::runner::RunArgs),
    /// List the environments sessions and `pyberth run --environment` can use: base, limits,
    /// packages, read-only folders, network.
    Envs {
        #[command(flatten)]
        cfg: SandboxConfig,
    },
    /// Measure pyberth through MCP stdio (warm runs, new sessions with and without the pool,
    /// concurrency, idle memory, output volume) beside the raw Docker floors.
    Bench {
        #[command(flatten)]
        cfg: SandboxConfig,
        #[command(flatten)]
        args: bench::BenchArgs,
    },
    /// List containers, volumes and networks of dead servers that no record of this state
    /// dir keeps for a next server (orphans); with --yes, remove them. Live servers' are kept.
    Gc {
        #[command(flatten)]
        cfg: SandboxConfig,
        #[command(flatten)]
        args: pyberth::gc::GcArgs,
    },
    /// Kubernetes deployment.
    K8s {
        #[command(subcommand)]
        action: K8sAction,
    },
    /// The egress proxy, run by the server inside its own container (policies on stdin,
    /// connection records on stdout). Not for people.
    #[command(hide = true)]
    EgressProxy,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once at start
enum ImageAction {
    /// Build the sandbox image (pulling the base, or bootstrapping it offline with debootstrap).
    Build {
        #[command(flatten)]
        cfg: SandboxConfig,
        /// Rebuild even if the image exists.
        #[arg(long)]
        force: bool,
        /// Build the image of every environment (offline too: each one's Debian base).
        #[arg(long, conflicts_with = "environment")]
        all: bool,
        /// Build this environment's image (default: the default environment's), and the layer
        /// of the packages it preinstalls (e.g. `--environment datascience`).
        #[arg(long, value_name = "NAME")]
        environment: Option<String>,
    },
    /// Print the tag of the sandbox image this binary uses.
    Tag,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once at start
enum K8sAction {
    /// Print the manifests for this configuration (namespace, RBAC, the server's Deployment,
    /// Service and ConfigMap, NetworkPolicies; in agent-sandbox mode each environment's
    /// template and warm pool) as YAML, for `kubectl apply -f -`. Reaches no cluster.
    Manifests {
        #[command(flatten)]
        cfg: SandboxConfig,
    },
}

#[derive(Debug, Subcommand)]
enum LayersAction {
    /// List layers, most recently used first.
    List {
        #[command(flatten)]
        cfg: SandboxConfig,
    },
    /// Remove layers, least recently used first, until their own size is at most --keep-mb
    /// (0: all). Layers in use by a session are kept.
    Prune {
        #[command(flatten)]
        cfg: SandboxConfig,
        /// Size to keep, MiB.
        #[arg(long, default_value_t = 0)]
        keep_mb: u64,
    },
}

/// Settings of a server that `pyberth run` hides and refuses, with what to use instead.
const SERVER_ONLY: &[(&str, &str)] = &[
    ("timeout_s", "its time limit is --timeout"),
    ("idle_ttl_s", "it is a server setting"),
    ("max_sessions", "it is a server setting"),
    ("max_sessions_total", "it is a server setting"),
    ("pool_size", "it is a server setting"),
    ("pool_max", "it is a server setting"),
    ("pool_memory_mb", "it is a server setting"),
    ("max_runs_per_caller", "it is a server setting"),
    ("max_snapshots_per_caller", "it is a server setting"),
    ("snapshot_mb_per_caller", "it is a server setting"),
    ("adopt_grace_s", "it is a server setting"),
    ("keep_sessions", "it is a server setting"),
    ("audit_log", "it is a server setting"),
    ("audit_log_mb", "it is a server setting"),
    ("audit_log_keep", "it is a server setting"),
];

/// Parses the command line, then fills in from the config file what flags and environment
/// left at their defaults.
fn parse() -> anyhow::Result<Cli> {
    // `pyberth run` makes one sandbox for one run: the settings of a server mean nothing there.
    let command = Cli::command()
        .mut_subcommand("run", |run| SERVER_ONLY.iter().fold(run, |run, (id, _)| run.mut_arg(*id, |a| a.hide(true))));
    let matches = command.get_matches();
    if let Some(("run", run)) = matches.subcommand() {
        for (id, instead) in SERVER_ONLY {
            if run.value_source(id) == Some(clap::parser::ValueSource::CommandLine) {
                let flag = format!("--{}", id.replace('_', "-"));
                anyhow::bail!("{flag} does not apply to `pyberth run`: {instead}");
            }
        }
    }
    let mut cli = Cli::from_arg_matches(&matches)?;
    let Some(path) = cli.config.clone() else { return Ok(cli) };
    let file = config::file::read_file(&path).map_err(anyhow::Error::msg)?;
    // The settings live in the innermost subcommand (`image build`, `layers prune`).
    let mut sub = &matches;
    while let Some((_, m)) = sub.subcommand() {
        sub = m;
    }
    let mut known = std::collections::BTreeSet::new();
    let (cfg, http) = match &mut cli.command {
        Command::Serve { cfg, http } => (Some(cfg), Some(http)),
        Command::Image { action: ImageAction::Build { cfg, .. } }
        | Command::Layers { action: LayersAction::List { cfg } | LayersAction::Prune { cfg, .. } }
        | Command::Bench { cfg, .. }
        | Command::Envs { cfg }
        | Command::K8s { action: K8sAction::Manifests { cfg } }
        | Command::Gc { cfg, .. } => (Some(cfg), None),
        Command::Run(args) => (Some(&mut args.cfg), None),
        Command::Image { action: ImageAction::Tag } | Command::EgressProxy => (None, None),
    };
    let with_path = |e: String| anyhow::anyhow!("in {}: {e}", path.display());
    if let Some(cfg) = cfg {
        known.extend(config::file::apply_file(cfg, sub, &file).map_err(with_path)?);
    }
    if let Some(http) = http {
        known.extend(config::file::apply_file(http, sub, &file).map_err(with_path)?);
    }
    // Keys of either kind are fine in any command (one file serves them all); others are typos.
    let all = config::file::keys_of(&HttpArgs::default()).into_iter().chain(SandboxConfig::keys());
    known.extend(all);
    if let Some(unknown) = file.keys().find(|k| !known.contains(*k)) {
        anyhow::bail!("{}: unknown key `{unknown}` (keys are long flags with _ for -, e.g. memory_mb)", path.display());
    }
    Ok(cli)
}

fn main() -> std::process::ExitCode {
    // Every HTTPS client of the process on ring (see pyberth::https).
    pyberth::https::install_provider();
    let cli = match parse() {
        Ok(cli) => cli,
        Err(e) => {
            eprintln!("pyberth: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    // `pyberth run` shares stderr with the program it runs: only errors of our own there (its
    // notices come as [pyberth] lines), and code mode's audit (one line per bridged tool call).
    // `pyberth bench` is an MCP client too: rmcp would log every notification it receives (a
    // 1 MiB progress message whole) over the figures.
    let default_level = match cli.command {
        Command::Run(_) => "error,pyberth::bridge=info,pyberth::bridge::upstream=warn",
        Command::Bench { .. } => "info,rmcp=warn",
        // Its stdout is the server's channel; only real trouble goes to stderr.
        Command::EgressProxy => "warn",
        // rmcp logs each initialize and notification at INFO as Rust debug structs: its
        // warnings and errors only, unless RUST_LOG asks.
        _ => "info,rmcp=warn",
    };
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // rmcp logs every new MCP session id at INFO ("create new session", and a span naming it),
    // and over HTTP an id is a bearer secret: its session module logs warnings only, unless
    // RUST_LOG names rmcp itself.
    if !std::env::var("RUST_LOG").is_ok_and(|v| v.contains("rmcp"))
        && let Ok(quiet) = "rmcp::transport::streamable_http_server::session=warn".parse()
    {
        filter = filter.add_directive(quiet);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pyberth: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // Traces are a server's (opt-in); the exporter POSTs on the runtime.
    let otlp = match &cli.command {
        Command::Serve { cfg, .. } => cfg.otlp_endpoint.as_deref(),
        _ => None,
    };
    let telemetry = match pyberth::telemetry::Telemetry::install(filter, otlp, runtime.handle()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("pyberth: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => std::process::ExitCode::from(pyberth::runner::run(args).await),
            command => match run(command, cli.config).await {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    std::process::ExitCode::FAILURE
                }
            },
        }
    });
    // The last spans go out while the runtime still runs (the exporter POSTs on it).
    telemetry.shutdown();
    // rmcp reads stdin on a blocking thread that only returns on input; waiting for it
    // would keep a server that was told to stop alive. Cleanup is done by now.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    code
}

/// `config_path`: the config file read, if any (`pyberth bench` passes it to its servers).
async fn run(command: Command, config_path: Option<std::path::PathBuf>) -> anyhow::Result<()> {
    match command {
        Command::Serve { cfg, http } => serve(cfg, http).await,
        Command::EgressProxy => Ok(pyberth::egress::proxy::run().await?),
        Command::Image { action: ImageAction::Tag } => {
            #[allow(clippy::print_stdout)] // the tag is the command's output
            {
                println!("{}", image::sandbox_tag());
            }
            Ok(())
        }
        Command::Image { action: ImageAction::Build { cfg, force, all, environment } } => {
            images_cli::image_build(cfg, force, all, environment.as_deref()).await
        }
        Command::Bench { cfg, args } => bench::run(cfg, args, config_path).await,
        Command::K8s { action: K8sAction::Manifests { cfg } } => {
            let out = pyberth::k8s::render::manifests(&cfg).map_err(anyhow::Error::msg)?;
            #[allow(clippy::print_stdout)] // the manifests are the command's output
            {
                print!("{out}");
            }
            Ok(())
        }
        Command::Envs { cfg } => {
            let out = envs::listing(&cfg)?;
            #[allow(clippy::print_stdout)] // the listing is the command's output
            {
                print!("{out}");
            }
            Ok(())
        }
        Command::Gc { cfg, args } => {
            let out = pyberth::gc::run(&cfg, &args).await?;
            #[allow(clippy::print_stdout)] // the listing is the command's output
            {
                print!("{out}");
            }
            Ok(())
        }
        Command::Run(_) => Ok(()), // handled in main, for its exit code
        Command::Layers { action: LayersAction::List { cfg } } => {
            let (docker, img, instance, state_dir) = images_cli::layer_store_access(&cfg).await?;
            let mut out = String::new();
            for l in layers::list_by_use(&docker, &img, &instance.owner, &state_dir).await? {
                let size = images_cli::human_size(i64::try_from(l.size).unwrap_or(i64::MAX));
                let key = if l.key.is_empty() { "?" } else { &l.key };
                out.push_str(&format!("{key}\t{size}\t{}\n", l.requirements.join(" ")));
            }
            #[allow(clippy::print_stdout)] // the listing is the command's output
            {
                print!("{out}");
            }
            Ok(())
        }
        Command::Layers { action: LayersAction::Prune { cfg, keep_mb } } => {
            let (docker, img, instance, state_dir) = images_cli::layer_store_access(&cfg).await?;
            for l in layers::prune(&docker, &img, &instance.owner, &state_dir, keep_mb << 20, &[]).await? {
                eprintln!("removed {} ({})", l.key, l.requirements.join(" "));
            }
            // Layers of pyberth before the store were images.
            for tag in layers::prune_old_images(&docker).await? {
                eprintln!("removed old layer image {tag}");
            }
            Ok(())
        }
    }
}

async fn serve(mut cfg: SandboxConfig, http: HttpArgs) -> anyhow::Result<()> {
    if http.http.is_none() && std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        eprintln!(
            "pyberth serve speaks MCP on stdin and stdout, for an MCP client to start (see the README's \
             client configuration); for a service, use --http 127.0.0.1:8080. Ctrl-D quits."
        );
    }
    // Over HTTP, a stopped server leaves its sessions for the next one (docs/design.md D12);
    // over stdio they end with the client unless asked.
    if http.http.is_some() {
        cfg.keep_sessions = true;
    }
    pyberth::app::settle_for_kubernetes(&mut cfg);
    let leave = cfg.keep_sessions && cfg.adopt_grace_s > 0;
    if http.http.is_none() && cfg.audit_log.as_ref().is_some_and(|p| p.as_os_str() == "-") {
        anyhow::bail!(
            "--audit-log - writes the audit log to standard output, which is the MCP channel over stdio: give a file \
             path (--audit-log /var/log/pyberth/audit.log), or serve over HTTP (--http)"
        );
    }
    // Tokens, limits and the address before anything starts: a refused start says why last.
    let listening = match http.http {
        Some(addr) => Some(pyberth::http::Listening::bind(&http, addr, cfg.ca_bundle().as_deref()).await?),
        None => None,
    };
    let metrics = match http.metrics_addr {
        Some(addr) => Some(
            pyberth::http::scrape::Listening::bind(addr)
                .await
                .with_context(|| format!("cannot listen on {addr} (--metrics-addr)"))?,
        ),
        None => None,
    };
    let runtime = Runtime::serve(cfg).await?;
    let (registry, cfg) = (runtime.registry.clone(), runtime.cfg.clone());
    if let Some(metrics) = metrics {
        runtime.spawn(metrics.serve(registry.clone(), runtime.shutdown_token()));
    }
    let served = match listening {
        Some(listening) => {
            let stop = runtime.shutdown_token();
            let signal = runtime.spawn(async move {
                pyberth::shutdown_signal().await;
                tracing::info!("signal received; shutting down");
                stop.cancel();
            });
            listening.serve(registry, cfg, runtime.shutdown_token()).await;
            signal.abort();
            Ok(())
        }
        None => serve_stdio(registry, cfg).await,
    };
    runtime.stop(leave).await;
    tracing::info!("pyberth stopped");
    served
}

/// Serves the one client on stdin/stdout until it leaves or a signal comes.
async fn serve_stdio(registry: Arc<Registry>, cfg: Arc<SandboxConfig>) -> anyhow::Result<()> {
    let server = SandboxServer::new(registry, cfg).traced();
    // Both streams pipes (as MCP clients start servers): read and written on tokio's reactor,
    // not a blocking-pool thread per read and per write; anything else falls back to that.
    let running = match server.serve(rmcp::transport::stdio_pipes()).await {
        Ok(r) => r,
        // Input ended before any client spoke: nothing went wrong, there was just no one.
        Err(
            rmcp::service::ServerInitializeError::ConnectionClosed(_)
            | rmcp::service::ServerInitializeError::ExpectedInitializeRequest(None),
        ) => {
            tracing::info!("stdin closed before a client initialized; stopping");
            return Ok(());
        }
        Err(e) => return Err(e).context("MCP initialisation failed"),
    };
    let cancel = running.cancellation_token();
    tokio::select! {
        r = running.waiting() => {
            if let Err(e) = r {
                tracing::warn!(error = %e, "MCP service ended with an error");
            }
        }
        _ = pyberth::shutdown_signal() => {
            tracing::info!("signal received; shutting down");
            cancel.cancel();
        }
    }
    Ok(())
}
