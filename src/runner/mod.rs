//! `pyberth run`: a script or a command in a fresh sandbox, for CI pipelines.
//!
//! The same hardened session container as the MCP server, made for one run and removed after
//! it. Output streams live to our own stdout and stderr (lossless: the program waits for a slow
//! reader, as it would outside a sandbox); the exit status is the program's own, and pyberth's
//! own failures have codes of their own (see [`exit`]).
//!
//! Why this file passes 500 lines: `pyberth run` from argument to exit code, read top to
//! bottom; its one separable part, making output safe for a CI log, is `neutralize.rs`.

use std::collections::{BTreeMap, HashMap};
use std::io::{IsTerminal as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use clap::Args;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::config::SandboxConfig;

use crate::app::{Runtime, Voice};
use crate::docker::archive::{Cap, CopyBack, Moved};
use crate::packages::Error as InstallError;
use crate::protocol::Stream;
use crate::session::registry::{Error as RegistryError, Registry};
use crate::session::{RunOutcome, RunSpec, RunStatus, Session};

mod bridged;
mod neutralize;
use crate::output::one_line;
use neutralize::Neutralizer;

/// Exit codes of `pyberth run` besides the program's own status.
pub mod exit {
    /// Bad invocation: a missing file, a bad requirement, a bad `--env`.
    pub const USAGE: u8 = 2;
    /// The time limit ended the run.
    pub const TIMEOUT: u8 = 124;
    /// pyberth could not run the program: Docker, the image, an install or a transfer failed.
    pub const INFRA: u8 = 125;
    /// Interrupted (Ctrl-C or SIGTERM).
    pub const INTERRUPTED: u8 = 130;
    /// The program ran out of memory (the limit is `--memory-mb`).
    pub const OOM: u8 = 137;
}

/// Arguments of `pyberth run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Python script to run (`-` reads it from stdin). Without it, the words after `--` are a
    /// command run in the workspace (e.g. `-- python -m pytest -q`).
    pub file: Option<PathBuf>,
    /// The script's arguments, or the command.
    #[arg(last = true)]
    pub args: Vec<String>,
    /// A requirement to install first (repeatable); PEP 723 `dependencies` count too.
    #[arg(long = "with", value_name = "REQUIREMENT")]
    pub with: Vec<String>,
    /// Time limit of the run in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 600.0)]
    pub timeout: f64,
    /// An environment variable for the program (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    pub env: Vec<String>,
    /// Upload this directory as the workspace first (without `.git`).
    #[arg(long, value_name = "DIR")]
    pub project: Option<PathBuf>,
    /// Copy the files the run created or changed back into this directory. Version-control
    /// metadata (`.git`, …) never comes back, nor does a file over one the run was not given.
    #[arg(long, value_name = "DIR")]
    pub output: Option<PathBuf>,
    /// With --output: also replace existing files the run was not given.
    #[arg(long, requires = "output")]
    pub output_overwrite: bool,
    /// With --output: never copy back paths matching this pattern (repeatable; `*`, `?`, `**`;
    /// without `/` it matches any one component, e.g. `.github`, `Makefile`, `*.sh`).
    #[arg(long, value_name = "GLOB", requires = "output")]
    pub output_exclude: Vec<String>,
    /// Print a JSON result on stdout instead of streaming the output.
    #[arg(long)]
    pub json: bool,
    /// Pass the program's output through untouched. By default, lines that start a CI runner
    /// command (`::`, `##[`, `##vso[`, `##teamcity[`) or `[pyberth]` get a `\` in front, and
    /// escape sequences and other control bytes are written as `\xNN`.
    #[arg(long)]
    pub raw_output: bool,
    /// Environment to run in (see `[environments]` in the config file; built in: default,
    /// python3.11, python3.13).
    #[arg(long, value_name = "NAME")]
    pub environment: Option<String>,
    /// Cap on the bytes uploaded by --project and copied back by --output, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 1024)]
    pub transfer_cap_mb: u64,
    /// Cap on the files uploaded by --project and copied back by --output.
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    pub transfer_max_files: u64,
    /// The sandbox: the same settings as `pyberth serve`'s (those of a server alone are hidden).
    #[command(flatten, next_help_heading = "Sandbox")]
    pub cfg: SandboxConfig,
}

/// The `--json` result.
#[derive(Debug, Serialize)]
struct JsonResult {
    status: RunStatus,
    exit_code: u8,
    stdout: String,
    stderr: String,
    truncated: bool,
    duration_ms: f64,
    cpu_ms: Option<f64>,
    peak_memory_kb: Option<u64>,
    output_files: Option<u64>,
    /// What came back, workspace-relative.
    output_paths: Option<Vec<String>>,
    /// What the run made but was not copied back, and why.
    output_held_back: Option<Vec<HeldBackJson>>,
    notices: Vec<String>,
    /// Code-mode tool calls, made and refused.
    tool_calls: crate::bridge::CallCounts,
}

#[derive(Debug, Serialize)]
struct HeldBackJson {
    path: String,
    why: &'static str,
}

/// A failure before or around the program, with its exit code.
#[derive(Debug)]
pub struct Failure {
    /// Exit code.
    pub code: u8,
    /// What happened and what to do.
    pub message: String,
    /// The program's own exit code, when it ran to the end before the failure (the copy back).
    pub program_exit: Option<u8>,
}

fn usage(message: impl Into<String>) -> Failure {
    Failure { code: exit::USAGE, message: message.into(), program_exit: None }
}

fn infra(message: impl Into<String>) -> Failure {
    Failure { code: exit::INFRA, message: message.into(), program_exit: None }
}

/// What runs: a script (workspace path and its bytes, if not already uploaded) or a command.
enum Target {
    Script { rel: String, data: Option<Vec<u8>> },
    Command(Vec<String>),
}

/// Long steps (image build, installs) as one rewritten status line on a terminal, plain
/// lines otherwise.
struct Status {
    tty: bool,
    shown: Mutex<bool>,
}

impl Status {
    fn new() -> Self {
        Self { tty: std::io::stderr().is_terminal(), shown: Mutex::new(false) }
    }

    fn line(&self, text: &str) {
        let mut err = std::io::stderr().lock();
        if self.tty {
            let short: String = text.chars().filter(|c| !c.is_control()).take(100).collect();
            let _ = write!(err, "\r\x1b[2K[pyberth] {short}");
            if let Ok(mut s) = self.shown.lock() {
                *s = true;
            }
        } else {
            let _ = writeln!(err, "[pyberth] {}", one_line(text));
        }
        let _ = err.flush();
    }

    fn clear(&self) {
        if let Ok(mut s) = self.shown.lock()
            && *s
        {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
            *s = false;
        }
    }
}

/// Parses `--env KEY=VALUE` words.
fn parse_env(words: &[String]) -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    for w in words {
        let Some((k, v)) = w.split_once('=') else {
            return Err(format!("--env {w:?}: write KEY=VALUE"));
        };
        env.insert(k.to_owned(), v.to_owned());
    }
    crate::checks::check_env(&env)?;
    Ok(env)
}

/// Works out what to run, reading the script.
fn target(args: &RunArgs, code_cap: usize) -> Result<Target, Failure> {
    let Some(file) = &args.file else {
        if args.args.is_empty() {
            return Err(usage("give a script to run, or a command after `--` (pyberth run -- python -m pytest)"));
        }
        return Ok(Target::Command(args.args.clone()));
    };
    if file.as_os_str() == "-" {
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut std::io::Read::take(std::io::stdin(), code_cap as u64 + 1), &mut data)
            .map_err(|e| usage(format!("cannot read the script from stdin: {e}")))?;
        if data.len() > code_cap {
            return Err(usage(format!("the script is over {code_cap} bytes (--code-cap)")));
        }
        return Ok(Target::Script { rel: "__main__.py".into(), data: Some(data) });
    }
    // A script inside the project runs where it is, next to its modules.
    if let Some(project) = &args.project
        && let (Ok(p), Ok(f)) = (project.canonicalize(), file.canonicalize())
        && let Ok(rel) = f.strip_prefix(&p)
    {
        let rel = rel.to_str().ok_or_else(|| usage(format!("{} is not a UTF-8 path", file.display())))?;
        return Ok(Target::Script { rel: rel.to_owned(), data: None });
    }
    let data = std::fs::read(file).map_err(|e| usage(format!("cannot read {}: {e}", file.display())))?;
    if data.len() > code_cap {
        return Err(usage(format!("{} is over {code_cap} bytes (--code-cap)", file.display())));
    }
    let name = file.file_name().and_then(|n| n.to_str()).unwrap_or("script.py").to_owned();
    Ok(Target::Script { rel: name, data: Some(data) })
}

/// Runs `pyberth run`; returns the process exit code.
pub async fn run(args: RunArgs) -> u8 {
    let status = Status::new();
    match run_inner(&args, &status, Instant::now()).await {
        Ok(code) => code,
        Err(f) => {
            status.clear();
            if args.json {
                let json = serde_json::json!({
                    "status": "failed", "exit_code": f.code, "error": f.message, "program_exit_code": f.program_exit,
                });
                #[allow(clippy::print_stdout)] // --json: the result is the command's output
                {
                    println!("{json}");
                }
            }
            eprintln!("pyberth: {}", f.message);
            f.code
        }
    }
}

/// `begun`: when the command started, for the closing line's whole wall time.
async fn run_inner(args: &RunArgs, status: &Status, begun: Instant) -> Result<u8, Failure> {
    let cfg = &args.cfg;
    cfg.validate().map_err(|e| usage(e.to_string()))?;
    if !(args.timeout.is_finite() && args.timeout > 0.0 && args.timeout <= cfg.max_timeout_s as f64) {
        return Err(usage(format!("--timeout must be above 0 and at most {} seconds", cfg.max_timeout_s)));
    }
    let env = parse_env(&args.env).map_err(usage)?;
    for (flag, dir) in [("--project", &args.project)] {
        if let Some(dir) = dir
            && !dir.is_dir()
        {
            return Err(usage(format!("{flag} {}: no such directory", dir.display())));
        }
    }
    let target = target(args, cfg.code_cap)?;
    let script_text = match &target {
        Target::Script { data: Some(d), .. } => Some(String::from_utf8_lossy(d).into_owned()),
        Target::Script { rel, data: None } => {
            let project = args.project.as_deref().unwrap_or(Path::new("."));
            std::fs::read(project.join(rel)).ok().map(|d| String::from_utf8_lossy(&d).into_owned())
        }
        Target::Command(_) => None,
    };
    let packages =
        crate::checks::wanted_packages(Some(&args.with), script_text.as_deref(), cfg.max_packages).map_err(usage)?;

    let runtime = Runtime::start(cfg.clone(), Voice::Quiet).await.map_err(|e| match e {
        crate::app::Error::Settings(e) => usage(e),
        crate::app::Error::Engine(e) => infra(e),
    })?;
    let registry = runtime.registry.clone();
    let result = in_session(args, status, &registry, &packages, target, env, begun).await;
    status.clear();
    drop(registry);
    runtime.stop(false).await;
    result
}

async fn in_session(
    args: &RunArgs,
    status: &Status,
    registry: &Arc<Registry>,
    packages: &[String],
    target: Target,
    env: BTreeMap<String, String>,
    begun: Instant,
) -> Result<u8, Failure> {
    let progress = |l: &str| status.line(l);
    // A bad name is a bad invocation, found before any container is made.
    registry
        .environments
        .get(args.environment.as_deref())
        .map_err(|e| usage(format!("{e} (pyberth envs describes them)")))?;
    let (session, _) =
        registry.get_or_create("cli", "run", args.environment.as_deref(), packages, &progress).await.map_err(|e| {
            match e {
                // The installer's lines are already above, one [pyberth] line each: say why once.
                RegistryError::Install(InstallError::Installer { what, .. }) if !status.tty => {
                    infra(format!("install failed: {what}; the installer's output is above"))
                }
                e => infra(e.to_string()),
            }
        })?;
    status.clear();
    let cap = Cap { bytes: args.transfer_cap_mb << 20, files: args.transfer_max_files };
    let mut given = match &args.project {
        Some(dir) => session.upload_dir(dir, cap).await.map_err(infra)?.manifest,
        None => Default::default(),
    };
    let (file, cmd) = match target {
        Target::Script { rel, data } => {
            if let Some(data) = data {
                // Its stamp joins the inputs: the script never comes back with --output.
                let stamp = session.upload_file(&rel, &data).await.map_err(infra)?;
                given.insert(PathBuf::from(&rel), stamp);
            }
            (Some(rel), Vec::new())
        }
        Target::Command(cmd) => (None, cmd),
    };
    // Code mode: a script runs in the interpreter that holds the agent channel (`bridged.rs`).
    let bridge = registry.grant(&session);
    let (file, code) = match file {
        Some(rel) if bridge.is_some() => (None, bridged::in_process(&rel, &args.args)),
        file => (file, String::new()),
    };
    let ct = CancellationToken::new();
    let interrupted = ct.clone();
    let watcher = tokio::spawn(async move {
        crate::shutdown_signal().await;
        interrupted.cancel();
    });
    let json = args.json;
    let echo = Echo::new(args.raw_output);
    let observer = |stream: Stream, bytes: &[u8]| {
        if !json {
            echo.write(stream, bytes);
        }
    };
    let started = SystemTime::now();
    let spec = RunSpec {
        args: if file.is_some() { args.args.clone() } else { Vec::new() },
        code,
        file,
        cmd,
        env,
        bridge,
        on_start: None,
    };
    let timeout = Duration::from_secs_f64(args.timeout);
    let ran = session.run(spec, timeout, &ct, &observer).await;
    watcher.abort();
    let mid_line = echo.finish();
    let outcome = ran.map_err(|e| infra(format!("the run could not complete: {e}")))?;
    let code = exit_code(&outcome);
    let copied = match &args.output {
        Some(out) => Some(copy_back(args, &session, out, given, started, cap, &outcome).await?),
        None => None,
    };
    report(args, &outcome, code, copied.as_ref(), mid_line, begun.elapsed());
    Ok(code)
}

/// The program's output on our stdout and stderr, straight through and unbuffered (the
/// pipeline sees output as the program writes it), defused unless raw.
struct Echo {
    raw: bool,
    /// Per stream: the filter, and whether the last byte written ended a line.
    streams: Mutex<[(Neutralizer, bool); 2]>,
}

impl Echo {
    fn new(raw: bool) -> Self {
        Self { raw, streams: Mutex::new([(Neutralizer::default(), true), (Neutralizer::default(), true)]) }
    }

    fn write(&self, stream: Stream, bytes: &[u8]) {
        let Ok(mut streams) = self.streams.lock() else { return };
        let (filter, ended) = &mut streams[stream as usize];
        if self.raw {
            *ended = bytes.last().map_or(*ended, |&b| b == b'\n');
            emit(stream, bytes);
        } else {
            let mut out = Vec::with_capacity(bytes.len());
            filter.feed(bytes, &mut out);
            *ended = filter.at_line_start();
            emit(stream, &out);
        }
    }

    /// Writes what the filters held back; true when a stream was left mid-line.
    fn finish(&self) -> bool {
        let Ok(mut streams) = self.streams.lock() else { return false };
        let mut mid_line = false;
        for (i, (filter, ended)) in streams.iter_mut().enumerate() {
            let mut out = Vec::new();
            filter.finish(&mut out);
            if !out.is_empty() {
                *ended = out.last() == Some(&b'\n');
                emit(if i == 0 { Stream::Stdout } else { Stream::Stderr }, &out);
            }
            mid_line |= !*ended;
        }
        mid_line
    }
}

fn emit(stream: Stream, bytes: &[u8]) {
    let _ = match stream {
        Stream::Stdout => std::io::stdout().lock().write_all(bytes).and_then(|()| std::io::stdout().flush()),
        Stream::Stderr => std::io::stderr().lock().write_all(bytes),
    };
}

/// `--output`: the files the run made or changed since `started`, into `out`. A failure is ours
/// (exit 125), and says the program's own status beside it.
async fn copy_back(
    args: &RunArgs,
    session: &Session,
    out: &Path,
    given: HashMap<PathBuf, (u64, u64)>,
    started: SystemTime,
    cap: Cap,
    outcome: &RunOutcome,
) -> Result<Moved, Failure> {
    // Whole seconds in the archive: anything touched in the run's first second counts.
    let since = started - Duration::from_secs(1);
    let rules = CopyBack { given, overwrite: args.output_overwrite, exclude: args.output_exclude.clone() };
    let code = exit_code(outcome);
    session.download_changed(since, rules, out, cap).await.map_err(|e| Failure {
        program_exit: Some(code),
        ..infra(format!(
            "nothing was copied back, {} is as it was: {e}; the program exited {code} ({})",
            out.display(),
            outcome.status
        ))
    })
}

/// What `pyberth run` says at the end: the `--json` result, or the copied files, notices and
/// our last line on stderr, with the whole wall time (`wall`: sandbox, installs, transfers
/// included) beside the program's own.
fn report(args: &RunArgs, outcome: &RunOutcome, code: u8, copied: Option<&Moved>, mid_line: bool, wall: Duration) {
    if args.json {
        print_json(outcome, code, copied);
    } else {
        // Our lines start lines: the program's last line may lack its newline.
        if mid_line {
            eprintln!();
        }
        if let (Some(moved), Some(out)) = (copied, &args.output) {
            report_copied(moved, out);
        }
        for n in &outcome.notices {
            eprintln!("[pyberth] {}", one_line(n));
        }
        match outcome.status {
            RunStatus::Timeout => eprintln!("[pyberth] timeout: stopped after {} s", args.timeout),
            RunStatus::Oom => {}
            // The program's own failure speaks for itself (a script run in the interpreter
            // printed its traceback or exit message); anything else is explained.
            RunStatus::Error => {
                if let Some(e) =
                    outcome.error.as_ref().filter(|e| !matches!(e.kind.as_str(), "ExitStatus" | "SystemExit"))
                {
                    eprintln!("[pyberth] {}: {}", one_line(&e.kind), one_line(&e.message));
                }
            }
            _ => {}
        }
        let calls = outcome.tool_calls;
        if calls.made + calls.refused > 0 {
            eprintln!("[pyberth] tool calls: {} made, {} refused", calls.made, calls.refused);
        }
        // Always the last line, and one the program cannot forge: its own lines that start with
        // `[pyberth]` were defused (unless --raw-output).
        eprintln!(
            "[pyberth] exit {code} ({}) after {:.1} s (the program ran {:.1} s)",
            outcome.status,
            wall.as_secs_f64(),
            outcome.duration.as_secs_f64()
        );
    }
}

/// The process exit code for an outcome.
fn exit_code(o: &RunOutcome) -> u8 {
    match o.status {
        RunStatus::Ok => 0,
        RunStatus::Error => o.exit_code.map(|c| u8::try_from(c.clamp(1, 255)).unwrap_or(1)).unwrap_or(1),
        RunStatus::Timeout => exit::TIMEOUT,
        RunStatus::Oom => exit::OOM,
        RunStatus::Cancelled => exit::INTERRUPTED,
        RunStatus::InterpreterRestarted | RunStatus::Running => exit::INFRA,
    }
}

/// Lines listed per kind before the rest is only counted: a run can make 100,000 files.
const LISTED: usize = 50;

/// Says on stderr what came back and what was held back. Names come from the sandbox: control
/// characters are escaped so a file name cannot write into the CI log.
fn report_copied(moved: &Moved, out: &Path) {
    let name = |p: &Path| one_line(&p.to_string_lossy());
    eprintln!("[pyberth] copied back {} file(s) into {}", moved.copied.len(), out.display());
    for p in moved.copied.iter().take(LISTED) {
        eprintln!("[pyberth]   {}", name(p));
    }
    if moved.copied.len() > LISTED {
        eprintln!("[pyberth]   … and {} more", moved.copied.len() - LISTED);
    }
    for (p, why) in moved.held_back.iter().take(LISTED) {
        eprintln!("[pyberth] not copied back: {} ({})", name(p), why.why());
    }
    if moved.held_back.len() > LISTED {
        eprintln!("[pyberth] … and {} more not copied back", moved.held_back.len() - LISTED);
    }
}

fn print_json(o: &RunOutcome, code: u8, copied: Option<&Moved>) {
    let rel = |p: &Path| p.to_string_lossy().into_owned();
    let json = JsonResult {
        status: o.status,
        exit_code: code,
        stdout: o.stdout.render().0,
        stderr: o.stderr.render().0,
        truncated: o.stdout.dropped() > 0 || o.stderr.dropped() > 0,
        duration_ms: (o.duration.as_secs_f64() * 1e6).round() / 1e3,
        cpu_ms: o.cpu_ms.map(f64::round),
        peak_memory_kb: o.peak_memory_kb,
        output_files: copied.map(|m| m.copied.len() as u64),
        output_paths: copied.map(|m| m.copied.iter().map(|p| rel(p)).collect()),
        output_held_back: copied
            .map(|m| m.held_back.iter().map(|(p, w)| HeldBackJson { path: rel(p), why: w.why() }).collect()),
        notices: o.notices.clone(),
        tool_calls: o.tool_calls,
    };
    #[allow(clippy::print_stdout)] // --json: the result is the command's output
    {
        println!("{}", serde_json::to_string(&json).unwrap_or_default());
    }
}
