//! Configuration: flags, environment variables and a TOML file.
//!
//! Precedence is flag > environment variable > file > default: clap resolves the first two
//! and the default, then [`apply_file`] fills in what clap took from a default. Every value is
//! validated by [`SandboxConfig::validate`] before the server touches Docker.
//!
//! Why this file passes 500 lines: one struct is the flag, the variable and the file key of
//! every setting, each with its check; splitting it would split each setting from its check.

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use crate::docker::engine::SeccompMode;
pub use crate::docker::image::{DEFAULT_BASE, DEFAULT_RELEASE};

/// The size of a session's workspace (`--workspace-mb`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkspaceSize {
    /// A tmpfs-backed volume of half the session's memory.
    Auto,
    /// The engine's volume disk, without a per-session bound (`disk`, or 0).
    Disk,
    /// A tmpfs-backed volume of this many MiB.
    Mb(u64),
}

impl std::fmt::Display for WorkspaceSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Disk => f.write_str("disk"),
            Self::Mb(mb) => write!(f, "{mb}"),
        }
    }
}

impl std::str::FromStr for WorkspaceSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "disk" | "0" => Ok(Self::Disk),
            n => n.parse::<u64>().map(Self::Mb).map_err(|_| format!("{s:?} is not a size in MiB, auto or disk")),
        }
    }
}

impl serde::Serialize for WorkspaceSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Mb(mb) => s.serialize_u64(*mb),
            other => s.collect_str(other),
        }
    }
}

impl<'de> serde::Deserialize<'de> for WorkspaceSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(0) => Ok(Self::Disk),
            Raw::Number(mb) => Ok(Self::Mb(mb)),
            Raw::Word(w) => w.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Where sandboxes run (`--engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// A Docker engine.
    #[default]
    Docker,
    /// Pods of a Kubernetes cluster.
    Kubernetes,
}

/// How the Kubernetes engine gets a session's pod (`--k8s-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum K8sMode {
    /// Pods made by pyberth itself, and its own warm pool of them.
    #[default]
    Pods,
    /// kubernetes-sigs/agent-sandbox: a SandboxTemplate and SandboxWarmPool per environment,
    /// a SandboxClaim per session (docs/kubernetes.md).
    AgentSandbox,
}

fn default_warm_pool() -> u32 {
    2
}

fn default_egress_image() -> String {
    "pyberth:latest".into()
}

/// Which tools the MCP server offers (`--tools`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolProfile {
    /// The handful a model needs to run code: run_python, install_packages, list_packages,
    /// read_file, write_file, list_files, job_status, cancel_job.
    Core,
    /// Every tool: sessions, snapshots, archives, environments, jobs, egress too.
    #[default]
    All,
}

/// Settings shared by every command that starts sandboxes.
#[derive(Debug, Clone, clap::Args, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    /// Docker engine to use: unix:///path or tcp://host:port. Default: the local socket.
    #[arg(long, env = "DOCKER_HOST")]
    pub docker_host: Option<String>,

    /// Where sandboxes run: `docker` (the engine at `docker_host`) or `kubernetes` (one pod per
    /// session in `k8s_namespace`; plain Pods, docs/kubernetes.md says what works there yet).
    #[arg(long, env = "PYBERTH_ENGINE", value_enum, default_value_t = EngineKind::Docker)]
    #[serde(default)]
    pub engine: EngineKind,

    /// Kubernetes: `pods` (pyberth makes each session's pod) or `agent-sandbox` (a claim per
    /// session on agent-sandbox's warm pools; pyberth keeps no pool of its own then).
    #[arg(long, env = "PYBERTH_K8S_MODE", value_enum, default_value_t = K8sMode::Pods)]
    #[serde(default)]
    pub k8s_mode: K8sMode,

    /// Kubernetes, agent-sandbox mode: sandboxes each environment's SandboxWarmPool keeps
    /// ready (at least 1: a claim must name a warm pool).
    #[arg(long, env = "PYBERTH_K8S_WARM_POOL", default_value_t = 2)]
    #[serde(default = "default_warm_pool")]
    pub k8s_warm_pool: u32,

    /// Kubernetes: the namespace of session pods.
    #[arg(long, env = "PYBERTH_K8S_NAMESPACE", default_value = "pyberth")]
    pub k8s_namespace: String,

    /// Kubernetes: a kubeconfig file. Default: the pod's service account in a cluster, else
    /// `~/.kube/config`.
    #[arg(long, env = "PYBERTH_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Kubernetes: the kubeconfig context. Default: its current one.
    #[arg(long, env = "PYBERTH_K8S_CONTEXT")]
    pub k8s_context: Option<String>,

    /// Kubernetes: where snapshots and hibernated sessions are kept (on a cluster, a volume
    /// claim mounted into the server's pod). Default: `k8s-snapshots` in the state dir.
    #[arg(long, env = "PYBERTH_K8S_SNAPSHOT_DIR")]
    pub k8s_snapshot_dir: Option<PathBuf>,

    /// Kubernetes: `runtimeClassName` of session pods (e.g. `gvisor`). Default: the cluster's.
    #[arg(long, env = "PYBERTH_K8S_RUNTIME_CLASS")]
    pub k8s_runtime_class: Option<String>,

    /// Kubernetes: the image of the egress proxy pod, which must carry this server's
    /// executable at /usr/local/bin/pyberth: the server's own image (deploy/kubernetes/).
    #[arg(long, env = "PYBERTH_K8S_EGRESS_IMAGE", default_value = "pyberth:latest")]
    #[serde(default = "default_egress_image")]
    pub k8s_egress_image: String,

    /// OTLP/HTTP endpoint to export traces to (opt-in; `serve` only), e.g.
    /// http://127.0.0.1:4318 (`/v1/traces` is added to a URL without a path). Plain http: a
    /// local collector or agent forwards them on.
    #[arg(long, env = "PYBERTH_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,

    /// Sandbox image to run instead of the one built from images/python (must contain the agent).
    #[arg(long, env = "PYBERTH_IMAGE")]
    pub image: Option<String>,

    /// Base image for building the sandbox image, pulled from a registry when absent.
    #[arg(long, env = "PYBERTH_BASE_IMAGE", default_value = DEFAULT_BASE)]
    pub base_image: String,

    /// Debian release bootstrapped with debootstrap when the base image cannot be pulled.
    #[arg(long, env = "PYBERTH_FALLBACK_RELEASE", default_value = DEFAULT_RELEASE)]
    pub fallback_release: String,

    /// Debian mirror for the offline fallback base.
    #[arg(long, env = "PYBERTH_DEBIAN_MIRROR", default_value = "http://deb.debian.org/debian")]
    pub debian_mirror: String,

    /// Memory limit of a session container, MiB (swap is disabled: swap limit = memory limit).
    #[arg(long, env = "PYBERTH_MEMORY_MB", default_value_t = 512)]
    pub memory_mb: u64,

    /// CPU share of a session container, in CPUs.
    #[arg(long, env = "PYBERTH_CPUS", default_value_t = 1.0)]
    pub cpus: f64,

    /// Maximum number of processes and threads in a session container.
    #[arg(long, env = "PYBERTH_PIDS", default_value_t = 256)]
    pub pids: i64,

    /// Size of the /tmp tmpfs of a session container, MiB (counts against its memory).
    #[arg(long, env = "PYBERTH_TMP_MB", default_value_t = 64)]
    pub tmp_mb: u64,

    /// Size of each session's workspace in MiB, as a tmpfs-backed volume whose pages count
    /// against the session's memory (inodes bounded too: 256 per MiB). `auto`: half of
    /// --memory-mb. `disk` (or 0): on the Docker volume disk instead, unbounded per session
    /// where the filesystem has no project quotas (ext4).
    #[arg(long, env = "PYBERTH_WORKSPACE_MB", default_value = "auto")]
    pub workspace_mb: WorkspaceSize,

    /// The uids (and gids) sandboxed code may run as, FIRST-LAST: each sandbox gets one of its
    /// own at random, so no per-uid kernel limit is shared with another session or a host user.
    #[arg(long, env = "PYBERTH_UID_RANGE", default_value = crate::docker::identity::DEFAULT_RANGE)]
    pub uid_range: crate::docker::identity::UidRange,

    /// Default time limit of one run, seconds.
    #[arg(long, env = "PYBERTH_TIMEOUT", default_value_t = 60)]
    pub timeout_s: u64,

    /// Largest time limit a caller may ask for, seconds.
    #[arg(long, env = "PYBERTH_MAX_TIMEOUT", default_value_t = 3600)]
    pub max_timeout_s: u64,

    /// After an interrupt, how long code may take to stop before its processes are killed, seconds.
    #[arg(long, env = "PYBERTH_INTERRUPT_GRACE", default_value_t = 1.0)]
    pub interrupt_grace_s: f64,

    /// Idle sessions are closed after this many seconds.
    #[arg(long, env = "PYBERTH_IDLE_TTL", default_value_t = 86400)]
    pub idle_ttl_s: u64,

    /// Seconds idle after which a session is hibernated: snapshotted (files and what of its
    /// interpreter state pickles) and its container removed; the next call wakes it. 0: never.
    #[arg(long, env = "PYBERTH_HIBERNATE_AFTER_S", default_value_t = 600)]
    pub hibernate_after_s: u64,

    /// Total size of the snapshots kept (snapshot_session, fork_session), MiB; least recently
    /// used snapshots are removed above it.
    #[arg(long, env = "PYBERTH_SNAPSHOT_CACHE_MB", default_value_t = 4096)]
    pub snapshot_cache_mb: u64,

    /// Most snapshots one caller (principal) keeps, its hibernated sessions included. Past it
    /// a new snapshot is refused (delete_snapshot frees one) and an idle session stays awake
    /// instead of hibernating; nothing kept is removed for it.
    #[arg(long, env = "PYBERTH_MAX_SNAPSHOTS_PER_CALLER", default_value_t = 40)]
    pub max_snapshots_per_caller: usize,

    /// Total size of one caller's snapshots, its hibernated sessions included, MiB; past it
    /// as --max-snapshots-per-caller.
    #[arg(long, env = "PYBERTH_SNAPSHOT_MB_PER_CALLER", default_value_t = 2048)]
    pub snapshot_mb_per_caller: u64,

    /// Most sessions one caller (principal) may have open at once.
    #[arg(long, env = "PYBERTH_MAX_SESSIONS", default_value_t = 32)]
    pub max_sessions: usize,

    /// Most sessions open at once on the whole server, across callers.
    #[arg(long, env = "PYBERTH_MAX_SESSIONS_TOTAL", default_value_t = 256)]
    pub max_sessions_total: usize,

    /// Bytes of stdout and of stderr kept per run; the rest is counted and dropped.
    #[arg(long, env = "PYBERTH_OUTPUT_CAP", default_value_t = 1 << 20)]
    pub output_cap: usize,

    /// Characters of output a run's text shows a model (the text content of a result; most
    /// clients show a model nothing else): longer output keeps its head and tail, says at the
    /// top how much was cut, and where the whole of it can be read (docs/output.md).
    #[arg(long, env = "PYBERTH_TEXT_BUDGET", default_value_t = 20_000)]
    pub text_budget: usize,

    /// Most bytes one write_file or read_file call moves.
    #[arg(long, env = "PYBERTH_FILE_CAP", default_value_t = 8 << 20)]
    pub file_cap: usize,

    /// Largest code accepted in one run, bytes.
    #[arg(long, env = "PYBERTH_CODE_CAP", default_value_t = 1 << 20)]
    pub code_cap: usize,

    /// Package index URL for installs (fallbacks: PIP_INDEX_URL, UV_INDEX_URL; default PyPI).
    #[arg(long, env = "PYBERTH_INDEX_URL")]
    pub index_url: Option<String>,

    /// Extra package index URL (fallbacks: PIP_EXTRA_INDEX_URL, UV_EXTRA_INDEX_URL).
    #[arg(long, env = "PYBERTH_EXTRA_INDEX_URL")]
    pub extra_index_url: Option<String>,

    /// CA bundle the installer trusts, for TLS-intercepting proxies (fallbacks: SSL_CERT_FILE,
    /// PIP_CERT, REQUESTS_CA_BUNDLE, then the host's system bundle).
    #[arg(long, env = "PYBERTH_CA_BUNDLE")]
    pub ca_bundle: Option<PathBuf>,

    /// Time limit of one package install, seconds.
    #[arg(long, env = "PYBERTH_INSTALL_TIMEOUT", default_value_t = 600)]
    pub install_timeout_s: u64,

    /// Total size of cached dependency layers (beyond their base) kept; least recently used
    /// layers are removed above it. MiB.
    #[arg(long, env = "PYBERTH_LAYER_CACHE_MB", default_value_t = 10240)]
    pub layer_cache_mb: u64,

    /// Packages the installer may build from source (sdists), comma-separated, or `:all:`.
    /// Installs are wheels only otherwise: building an sdist runs the package's own code in
    /// the installer, which has the network. A set naming an allowed package is installed
    /// with sdists allowed for its whole resolution, and without the shared download cache.
    #[arg(long, env = "PYBERTH_ALLOW_SDIST", value_delimiter = ',', value_name = "PKG,...")]
    #[serde(default)]
    pub allow_sdist: Vec<String>,

    /// The uv the installer fetches from the package index, once per base image and index,
    /// into a tool volume only installers mount (a requirement such as uv==0.13.9); `none`:
    /// install with pip. When uv cannot be had, installs fall back to pip and say why.
    #[arg(long, env = "PYBERTH_INSTALLER_UV", default_value = "uv")]
    pub installer_uv: String,

    /// Bound of the download cache installers share (wheels-only installs only), MiB: after
    /// an install that leaves it larger, it is emptied. 0: no shared cache.
    #[arg(long, env = "PYBERTH_INSTALLER_CACHE_MB", default_value_t = 2048)]
    pub installer_cache_mb: u64,

    /// Most packages accepted in one request.
    #[arg(long, env = "PYBERTH_MAX_PACKAGES", default_value_t = 50)]
    pub max_packages: usize,

    /// Started, hardened containers kept ready for new sessions of the default environment
    /// (0 disables the warm pool).
    #[arg(long, env = "PYBERTH_POOL_SIZE", default_value_t = 2)]
    pub pool_size: usize,

    /// Most containers the warm pool holds when recent demand asks for more than
    /// `--pool-size` (it follows the peak of new sessions per 10 s, halving each idle minute;
    /// never below `--pool-size`).
    #[arg(long, env = "PYBERTH_POOL_MAX", default_value_t = 16)]
    pub pool_max: usize,

    /// Runs (foreground and jobs) one caller may have going at once, across its sessions.
    #[arg(long, env = "PYBERTH_MAX_RUNS_PER_CALLER", default_value_t = 8)]
    pub max_runs_per_caller: usize,

    /// Seccomp profile of sandboxes: auto (ours on engines older than 25, whose default
    /// profile allows io_uring; Docker's otherwise), pyberth (always ours), docker (always Docker's).
    #[arg(long, env = "PYBERTH_SECCOMP", value_enum, default_value_t = SeccompMode::Auto)]
    pub seccomp: SeccompMode,

    /// Refuse to start on an engine or runc with known container escapes (instead of warning).
    #[arg(long, env = "PYBERTH_STRICT_ENGINE")]
    pub strict_engine: bool,

    /// OCI runtime for sandboxes: a runtime the engine has, e.g. runsc (gVisor), or auto (gVisor
    /// when the engine has it, else the engine's default). Default: the engine's default (runc).
    #[arg(long, env = "PYBERTH_RUNTIME")]
    pub runtime: Option<String>,

    /// Tools the MCP server offers: `all`, or `core` for clients that want fewer tool
    /// descriptions in their context (docs/output.md measures both). A setting of the
    /// server, not of an environment: a client lists tools before it opens any session.
    #[arg(long, env = "PYBERTH_TOOLS", value_enum, default_value_t = ToolProfile::All)]
    #[serde(default)]
    pub tools: ToolProfile,

    /// Environment of sessions whose caller names none.
    #[arg(long, env = "PYBERTH_ENVIRONMENT", default_value = "default")]
    pub default_environment: String,

    /// Environments defined by the operator (config file only: `[environments.NAME]`).
    #[arg(skip)]
    #[serde(default)]
    pub environments: std::collections::BTreeMap<String, crate::environment::spec::EnvironmentSpec>,

    /// Upstream MCP servers sessions may call in code mode (config file only:
    /// `[upstreams.NAME]`), each reached over stdio or streamable HTTP; environments say which
    /// of their tools their sessions may call (`tools = ["NAME:*"]`).
    #[arg(skip)]
    #[serde(default)]
    pub upstreams: std::collections::BTreeMap<String, crate::bridge::spec::UpstreamSpec>,

    /// Per principal, the upstream tools its sessions may call at most (config file only:
    /// `[principals.NAME] tools = ["time:*"]`): narrows each environment's list, never widens it.
    #[arg(skip)]
    #[serde(default)]
    pub principals: std::collections::BTreeMap<String, crate::bridge::spec::PrincipalSpec>,

    /// Directory for the liveness locks that tell a live server from a dead one's leftovers.
    #[arg(long, env = "PYBERTH_STATE_DIR")]
    pub state_dir: Option<PathBuf>,

    /// How long another server's heartbeat must have been stopped before its sessions count as
    /// leftovers and are removed, seconds (docs/design.md D9). Covers a server whose connection
    /// to a remote engine broke for a while: it starts a new heartbeat when it is back.
    #[arg(long, env = "PYBERTH_LEFTOVER_GRACE_S", default_value_t = 300)]
    pub leftover_grace_s: u64,

    /// How long sessions outlive a server stopped by a signal (SIGTERM, SIGINT) over HTTP,
    /// seconds: a server started again within it, with the same state dir, adopts them with
    /// their variables, threads and open files; after it they are removed (docs/design.md
    /// D12). 0 removes them at the stop, as over stdio.
    #[arg(long, env = "PYBERTH_ADOPT_GRACE_S", default_value_t = 600)]
    pub adopt_grace_s: u64,

    /// Over stdio too, leave sessions running for --adopt-grace-s when the client leaves or a
    /// signal stops the server, for the next server to adopt.
    #[arg(long, env = "PYBERTH_KEEP_SESSIONS")]
    pub keep_sessions: bool,

    /// Label the metrics of runs and new sessions with the caller's principal (off: one
    /// series for all callers). Principals come from the tokens file; past 100 they share
    /// the label "other" (docs/observability.md).
    #[arg(long, env = "PYBERTH_METRICS_PRINCIPAL")]
    pub metrics_principal: bool,
    /// Connections one session with egress may have open at once through the proxy.
    #[arg(long, env = "PYBERTH_EGRESS_MAX_CONNS", default_value_t = 32)]
    pub egress_max_conns: usize,

    /// Bytes one run may move through the egress proxy (both ways), MiB; 0: unbounded.
    #[arg(long, env = "PYBERTH_EGRESS_MAX_MB", default_value_t = 1024)]
    pub egress_max_mb: u64,

    /// Names the egress proxy resolves to a fixed address instead of asking DNS (config file
    /// only: `[egress_pin] "svc.internal" = "10.0.0.5"`). A pinned address is the operator's
    /// choice, so it is not refused for being private; the name must still be allowed.
    #[arg(skip)]
    #[serde(default)]
    pub egress_pin: std::collections::BTreeMap<String, String>,

    /// DNS servers the egress proxy asks, comma-separated IP addresses, at most 3 (its
    /// container's `HostConfig.Dns`; default: the engine's choice, the host's resolvers or
    /// Google's when those are on loopback). For a host whose resolver containers cannot reach,
    /// split-horizon names, or a filtering resolver. Every answer is still checked.
    #[arg(long, env = "PYBERTH_EGRESS_DNS", value_delimiter = ',', value_name = "IP,...")]
    #[serde(default)]
    pub egress_dns: Vec<String>,

    /// Audit log (docs/observability.md): a file that JSON lines are appended to, rotated by
    /// size, or `-` for standard output (HTTP mode only: over stdio, stdout is the MCP channel).
    #[arg(long, env = "PYBERTH_AUDIT_LOG", value_name = "PATH")]
    pub audit_log: Option<PathBuf>,

    /// Size past which the audit log file is rotated (PATH becomes PATH.1...), MiB.
    #[arg(long, env = "PYBERTH_AUDIT_LOG_MB", default_value_t = 64)]
    pub audit_log_mb: u64,

    /// Rotated audit log files kept (PATH.1 ... PATH.N); older ones are removed.
    #[arg(long, env = "PYBERTH_AUDIT_LOG_KEEP", default_value_t = 5)]
    pub audit_log_keep: usize,

    /// Name of this server instance in container labels (default: random). For tests.
    #[arg(long, env = "PYBERTH_INSTANCE", hide = true)]
    pub instance: Option<String>,
}

/// A setting out of range.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting {key} (`{}` in the config file): {why}", key.trim_start_matches('-').replace('-', "_"))]
pub struct Invalid {
    key: &'static str,
    why: String,
}

fn check(ok: bool, key: &'static str, why: impl Into<String>) -> Result<(), Invalid> {
    if ok { Ok(()) } else { Err(Invalid { key, why: why.into() }) }
}

impl SandboxConfig {
    /// Checks every value; the error names the flag.
    pub fn validate(&self) -> Result<(), Invalid> {
        self.validate_limits()?;
        self.validate_egress()?;
        self.validate_packages()?;
        if let Some(endpoint) = &self.otlp_endpoint {
            crate::telemetry::traces_url(endpoint).map_err(|why| Invalid { key: "--otlp-endpoint", why })?;
        }
        check(
            self.k8s_namespace.len() <= 63
                && !self.k8s_namespace.is_empty()
                && self.k8s_namespace.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "--k8s-namespace",
            "must be a Kubernetes namespace name: 1 to 63 lowercase letters, digits or dashes",
        )?;
        check(
            (1..=100).contains(&self.k8s_warm_pool),
            "--k8s-warm-pool",
            "must be 1 to 100 (sandboxes kept ready per environment; a claim must name a warm pool)",
        )?;
        if let Some(instance) = &self.instance {
            check(
                !instance.is_empty()
                    && instance.len() <= 40
                    && instance.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
                "--instance",
                "must be 1 to 40 letters, digits or dashes",
            )?;
        }
        Ok(())
    }

    /// The limits of a session and of its runs.
    fn validate_limits(&self) -> Result<(), Invalid> {
        check(self.memory_mb >= 64, "--memory-mb", "must be at least 64")?;
        check(self.cpus > 0.0 && self.cpus <= 1024.0, "--cpus", "must be above 0")?;
        check(self.pids >= 16, "--pids", "must be at least 16")?;
        check(self.tmp_mb >= 1 && self.tmp_mb < self.memory_mb, "--tmp-mb", "must be between 1 and --memory-mb")?;
        check(
            match self.workspace_mb {
                WorkspaceSize::Mb(mb) => mb >= 1 && mb < self.memory_mb,
                WorkspaceSize::Auto | WorkspaceSize::Disk => true,
            },
            "--workspace-mb",
            "must be auto, disk (or 0), or between 1 and --memory-mb (its pages count against the session's memory)",
        )?;
        check(self.timeout_s >= 1, "--timeout-s", "must be at least 1")?;
        // Name the flag that is set past the other, with both values: raising a default is the
        // more likely intent than lowering the maximum.
        check(
            self.timeout_s <= self.max_timeout_s,
            "--timeout-s",
            format!(
                "{} is over --max-timeout-s ({}): give a smaller --timeout-s, or raise --max-timeout-s",
                self.timeout_s, self.max_timeout_s
            ),
        )?;
        check(
            self.interrupt_grace_s > 0.0 && self.interrupt_grace_s <= 60.0,
            "--interrupt-grace-s",
            "must be between 0 and 60",
        )?;
        check(self.idle_ttl_s >= 1, "--idle-ttl-s", "must be at least 1")?;
        check(self.leftover_grace_s >= 1, "--leftover-grace-s", "must be at least 1")?;
        check(self.max_sessions >= 1, "--max-sessions", "must be at least 1")?;
        check(self.audit_log_mb >= 1, "--audit-log-mb", "must be at least 1")?;
        check(self.max_sessions_total >= 1, "--max-sessions-total", "must be at least 1")?;
        check(
            self.output_cap >= 1024 && self.output_cap <= 4 << 20,
            "--output-cap",
            "must be between 1024 and 4 MiB (a result must fit one MCP message; write more to a file)",
        )?;
        check(
            self.text_budget >= 2000 && self.text_budget <= 1_000_000,
            "--text-budget",
            "must be between 2000 and 1000000 characters",
        )?;
        check(self.code_cap >= 1 && self.code_cap <= 16 << 20, "--code-cap", "must be between 1 and 16 MiB")?;
        check(
            DEBIAN_SUITES.contains(&self.fallback_release.as_str()),
            "--fallback-release",
            format!(
                "{:?} is not a Debian suite pyberth knows: use one of {}",
                self.fallback_release,
                DEBIAN_SUITES.join(", ")
            ),
        )?;
        check(self.file_cap >= 1024 && self.file_cap <= 8 << 20, "--file-cap", "must be between 1 KiB and 8 MiB")?;
        check(self.install_timeout_s >= 10, "--install-timeout-s", "must be at least 10")?;
        check(self.max_packages >= 1, "--max-packages", "must be at least 1")?;
        Ok(())
    }

    /// The egress settings: budgets, pins, resolvers.
    fn validate_egress(&self) -> Result<(), Invalid> {
        check(self.egress_max_conns >= 1, "--egress-max-conns", "must be at least 1")?;
        for (name, addr) in &self.egress_pin {
            check(
                crate::egress::policy::normalize_host(name).is_some() && addr.parse::<std::net::IpAddr>().is_ok(),
                "egress_pin",
                format!("{name:?} = {addr:?}: give a host name and an IP address"),
            )?;
        }
        check(self.egress_dns.len() <= 3, "--egress-dns", "at most 3 servers (the C library asks no more)")?;
        for ip in &self.egress_dns {
            check(
                ip.parse::<std::net::IpAddr>()
                    .is_ok_and(|a| !a.is_loopback() && !a.is_unspecified() && !a.is_multicast()),
                "--egress-dns",
                format!(
                    "{ip:?} is not an address the proxy can ask: give IP addresses the proxy's container reaches \
                     (a loopback address would be the container's own)"
                ),
            )?;
        }
        Ok(())
    }

    /// The package settings: sdists, the installer, the index, its CA bundle.
    fn validate_packages(&self) -> Result<(), Invalid> {
        for p in &self.allow_sdist {
            check(
                p == ":all:" || crate::deps::parse(p).is_ok_and(|r| r.canonical == r.name),
                "--allow-sdist",
                format!("{p:?} is not a package name (or :all:)"),
            )?;
        }
        check(
            self.installer_uv == "none"
                || crate::deps::parse(&self.installer_uv).is_ok_and(|r| r.name == "uv" && !r.canonical.contains(';')),
            "--installer-uv",
            "must be none, or a requirement on uv such as uv or uv==0.13.9",
        )?;
        for (key, url) in [("--index-url", self.index_url()), ("--extra-index-url", self.extra_index_url())] {
            if let Some(url) = url {
                check(
                    (url.starts_with("https://") || url.starts_with("http://"))
                        && !url.chars().any(|c| c.is_whitespace() || c.is_control()),
                    key,
                    "must be an http(s) URL",
                )?;
            }
        }
        if let Some(ca) = self.ca_bundle() {
            check(ca.is_file(), "--ca-bundle", format!("{} is not a readable file", ca.display()))?;
        }
        Ok(())
    }

    /// The workspace's bound in MiB, or `None` for a workspace on the volume disk.
    pub fn workspace_bound_mb(&self) -> Option<u64> {
        match self.workspace_mb {
            WorkspaceSize::Auto => Some(self.memory_mb / 2),
            WorkspaceSize::Disk => None,
            WorkspaceSize::Mb(mb) => Some(mb),
        }
    }

    /// Default run time limit.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_s)
    }

    /// Interrupt grace.
    pub fn grace(&self) -> Duration {
        Duration::from_secs_f64(self.interrupt_grace_s)
    }

    /// Idle TTL.
    pub fn idle_ttl(&self) -> Duration {
        Duration::from_secs(self.idle_ttl_s)
    }

    /// Idle time before a session hibernates; `None` when hibernation is off.
    pub fn hibernate_after(&self) -> Option<Duration> {
        (self.hibernate_after_s > 0).then(|| Duration::from_secs(self.hibernate_after_s))
    }

    /// How long a stopped heartbeat waits before its instance counts as dead.
    pub fn leftover_grace(&self) -> Duration {
        Duration::from_secs(self.leftover_grace_s)
    }

    /// How long a sandbox outlives its server before it saves its state and stops: the
    /// adoption grace, or with adoption off the leftover grace (docs/design.md D12).
    pub fn orphan_after(&self) -> Duration {
        Duration::from_secs(if self.adopt_grace_s > 0 { self.adopt_grace_s } else { self.leftover_grace_s })
    }

    /// How long sessions left by a stopped server may still be adopted.
    pub fn adopt_grace(&self) -> Duration {
        Duration::from_secs(self.adopt_grace_s)
    }

    /// Index URL, honouring the pip and uv conventions.
    pub fn index_url(&self) -> Option<String> {
        self.index_url.clone().or_else(|| env_any(&["PIP_INDEX_URL", "UV_INDEX_URL"]))
    }

    /// Extra index URL, honouring the pip and uv conventions.
    pub fn extra_index_url(&self) -> Option<String> {
        self.extra_index_url.clone().or_else(|| env_any(&["PIP_EXTRA_INDEX_URL", "UV_EXTRA_INDEX_URL"]))
    }

    /// CA bundle: the flag, the usual variables, else the host's system bundle. Desktop MCP
    /// clients start servers with almost no environment, so `SSL_CERT_FILE` is often lost; the
    /// system bundle carries the CAs the host trusts, a TLS-intercepting proxy's included.
    pub fn ca_bundle(&self) -> Option<PathBuf> {
        self.ca_bundle
            .clone()
            .or_else(|| env_any(&["SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE"]).map(PathBuf::from))
            .or_else(|| SYSTEM_CA_BUNDLES.iter().map(PathBuf::from).find(|p| p.is_file()))
    }

    /// Install time limit.
    pub fn install_timeout(&self) -> Duration {
        Duration::from_secs(self.install_timeout_s)
    }

    /// Where liveness locks, the build lock and layer use times live: `--state-dir`, or a
    /// directory of this user's own ([`crate::state_dir::default_dir`]), never one a shared
    /// name lets another user create first.
    pub fn state_dir(&self) -> PathBuf {
        if let Some(dir) = &self.state_dir {
            return dir.clone();
        }
        crate::state_dir::default_dir()
    }

    /// Creates the state dir (mode 0700) or checks the one there: ours, a real directory, and
    /// writable by no one else. Another user's directory could feed us forged locks or lead our
    /// writes through symlinks.
    pub fn secure_state_dir(&self) -> Result<PathBuf, String> {
        let dir = self.state_dir();
        secure_dir(&dir, rustix::process::geteuid().as_raw())?;
        Ok(dir)
    }
}

impl crate::docker::image::Recipe for SandboxConfig {
    fn pinned(&self) -> Option<&str> {
        self.image.as_deref()
    }
    fn base_image(&self) -> &str {
        &self.base_image
    }
    fn fallback_release(&self) -> &str {
        &self.fallback_release
    }
    fn debian_mirror(&self) -> &str {
        &self.debian_mirror
    }
    fn lock_dir(&self) -> PathBuf {
        self.state_dir()
    }
}

impl SandboxConfig {
    /// What the engine check is asked: the runtime, the seccomp choice, strictness.
    pub fn engine_ask(&self) -> crate::docker::engine::Ask {
        crate::docker::engine::Ask {
            runtime: self.runtime.clone(),
            seccomp: self.seccomp,
            strict: self.strict_engine,
            state_dir: self.state_dir(),
        }
    }
}

/// Debian suites debootstrap can make a base of (codenames and their aliases).
const DEBIAN_SUITES: [&str; 10] =
    ["buster", "bullseye", "bookworm", "trixie", "forky", "sid", "oldstable", "stable", "testing", "unstable"];

/// Where distributions keep the system's CA bundle: Debian and Ubuntu, Fedora and RHEL,
/// openSUSE, Alpine and macOS.
pub(crate) const SYSTEM_CA_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// See [`SandboxConfig::secure_state_dir`].
fn secure_dir(dir: &Path, uid: u32) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
    let shown = dir.display();
    match std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) => return Err(format!("cannot create the state dir {shown}: {e} (set --state-dir)")),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("cannot read the state dir {shown}: {e}"))?;
    let refuse = |why: String| {
        Err(format!(
            "refusing the state dir {shown}: {why}. Remove it, or pass --state-dir with a directory of your own"
        ))
    };
    if !meta.is_dir() {
        return refuse("it is not a directory (a symlink?)".into());
    }
    if meta.uid() != uid {
        return refuse(format!("it belongs to uid {}, not to us (uid {uid})", meta.uid()));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!("others may write to it (mode {:o})", meta.mode() & 0o7777));
    }
    Ok(())
}

/// Settings from flags alone, as a command line would give them: for the tests of the modules
/// that take a [`SandboxConfig`].
#[cfg(test)]
pub(crate) fn from_flags(args: &[&str]) -> SandboxConfig {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        c: SandboxConfig,
    }
    let mut all = vec!["pyberth"];
    all.extend_from_slice(args);
    <Cli as clap::Parser>::parse_from(all).c
}

fn env_any(names: &[&str]) -> Option<String> {
    names.iter().find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_dir_of_someone_else_or_open_to_others_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let base = std::env::temp_dir().join(format!("pyberth-statedir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let uid = rustix::process::geteuid().as_raw();
        let fresh = base.join("a/b");
        secure_dir(&fresh, uid).expect("created");
        let mode = std::fs::metadata(&fresh).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let e = secure_dir(&fresh, uid + 1).expect_err("another user's");
        assert!(e.contains("belongs to uid"), "{e}");
        std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(secure_dir(&fresh, uid).expect_err("world-writable").contains("others may write"));
        let link = base.join("link");
        std::os::unix::fs::symlink(&fresh, &link).expect("symlink");
        assert!(secure_dir(&link, uid).expect_err("a symlink").contains("not a directory"));
        let _ = std::fs::remove_dir_all(&base);
    }

    fn parse(args: &[&str]) -> SandboxConfig {
        from_flags(args)
    }

    #[test]
    fn defaults_are_valid() {
        let c = parse(&[]);
        c.validate().expect("defaults");
        assert_eq!(c.timeout_s, 60);
        assert_eq!(c.output_cap, 1 << 20);
        assert_eq!(c.idle_ttl_s, 86400);
        assert_eq!(c.hibernate_after_s, 600);
    }

    #[test]
    fn errors_name_the_flag() {
        let e = parse(&["--memory-mb", "8"]).validate().expect_err("too small");
        assert!(e.to_string().contains("--memory-mb"), "{e}");
        let e = parse(&["--timeout-s", "100", "--max-timeout-s", "10"]).validate().expect_err("max");
        assert!(e.to_string().contains("--max-timeout-s"), "{e}");
        let e = parse(&["--instance", "a b"]).validate().expect_err("instance");
        assert!(e.to_string().contains("--instance"), "{e}");
        let e = parse(&["--fallback-release", "../x"]).validate().expect_err("release");
        assert!(e.to_string().contains("--fallback-release"), "{e}");
    }

    #[test]
    fn egress_dns_takes_up_to_three_addresses_the_proxy_can_reach() {
        let c = parse(&["--egress-dns", "10.0.0.53,2001:db8::53"]);
        c.validate().expect("two addresses");
        assert_eq!(c.egress_dns, ["10.0.0.53", "2001:db8::53"]);
        for bad in ["dns.example.com", "127.0.0.53", "::1", "0.0.0.0", "224.0.0.1", "1.1.1.1,8.8.8.8,9.9.9.9,1.0.0.1"] {
            let e = parse(&["--egress-dns", bad]).validate().expect_err(bad);
            assert!(e.to_string().contains("egress_dns"), "{bad}: {e}");
        }
    }
}

/// The keys a settings struct takes in the config file.
pub fn keys_of<T: serde::Serialize>(value: &T) -> Vec<String> {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

impl SandboxConfig {
    /// The keys [`SandboxConfig`] takes in the config file: its clap ids, which are its fields.
    pub fn keys() -> Vec<String> {
        use clap::Args as _;
        let mut keys: Vec<String> =
            Self::augment_args(clap::Command::new("keys")).get_arguments().map(|a| a.get_id().to_string()).collect();
        keys.push("environments".into());
        keys.push("upstreams".into());
        keys.push("principals".into());
        keys
    }
}

/// Reads a TOML configuration file into a table, with errors that name the file.
pub fn read_file(path: &std::path::Path) -> Result<toml::Table, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read the config file {}: {e}", path.display()))?;
    text.parse::<toml::Table>().map_err(|e| format!("{} is not valid TOML: {e}", path.display()))
}

/// Fills the fields of `target` that clap took from a default with the file's values; keys set
/// by a flag or an environment variable keep those. Returns the keys `target` knows, so the
/// caller can refuse keys nothing knows. Each key is checked alone, so an error names it.
pub fn apply_file<T>(target: &mut T, matches: &clap::ArgMatches, file: &toml::Table) -> Result<Vec<String>, String>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    use clap::parser::ValueSource;
    let mut current = serde_json::to_value(&*target).map_err(|e| e.to_string())?;
    let Some(fields) = current.as_object_mut() else { return Err("settings are not a table".into()) };
    let mut known = Vec::new();
    for (key, value) in file {
        if !fields.contains_key(key) {
            continue;
        }
        known.push(key.clone());
        let explicit = matches!(
            matches.try_get_raw(key).ok().and_then(|_| matches.value_source(key)),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        if explicit {
            continue;
        }
        fields.insert(key.clone(), serde_json::to_value(value).map_err(|e| format!("config key `{key}`: {e}"))?);
        if let Err(e) = serde_json::from_value::<T>(serde_json::Value::Object(fields.clone())) {
            return Err(format!("config key `{key}`: {e}"));
        }
    }
    *target = serde_json::from_value(current).map_err(|e| e.to_string())?;
    Ok(known)
}

#[cfg(test)]
mod file_tests {
    use super::*;
    use clap::{CommandFactory as _, FromArgMatches as _, Parser};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        cfg: SandboxConfig,
    }

    fn load(args: &[&str], file: &str) -> Result<SandboxConfig, String> {
        let matches = Cli::command().try_get_matches_from(args).map_err(|e| e.to_string())?;
        let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let table: toml::Table = file.parse().map_err(|e: toml::de::Error| e.to_string())?;
        apply_file(&mut cli.cfg, &matches, &table)?;
        Ok(cli.cfg)
    }

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let cfg = load(&["x", "--memory-mb", "300"], "memory_mb = 1024\npids = 99\n").expect("valid");
        assert_eq!(cfg.memory_mb, 300, "the flag wins");
        assert_eq!(cfg.pids, 99, "the file beats the default");
        assert_eq!(cfg.tmp_mb, 64, "untouched keys keep their default");
    }

    #[test]
    fn bad_values_name_their_key() {
        let e = load(&["x"], "memory_mb = \"lots\"\n").expect_err("a string for a number");
        assert!(e.to_string().contains("memory_mb"), "{e}");
        let cfg = load(&["x"], "memory_mb = 10\n").expect("parses");
        let e = cfg.validate().expect_err("below the minimum");
        assert!(e.to_string().contains("memory_mb"), "{e}");
    }

    #[test]
    fn the_workspace_is_bounded_by_default_and_disk_is_an_explicit_choice() {
        let cfg = load(&["x"], "").expect("defaults");
        assert_eq!(cfg.workspace_mb, WorkspaceSize::Auto);
        assert_eq!(cfg.workspace_bound_mb(), Some(256), "half of the default 512 MiB");
        let cfg = load(&["x", "--memory-mb", "2048"], "").expect("valid");
        assert_eq!(cfg.workspace_bound_mb(), Some(1024), "half of the session's memory");
        for (args, file, want) in [
            (&["x", "--workspace-mb", "disk"][..], "", None),
            (&["x", "--workspace-mb", "0"][..], "", None),
            (&["x"][..], "workspace_mb = \"disk\"\n", None),
            (&["x"][..], "workspace_mb = 0\n", None),
            (&["x"][..], "workspace_mb = 64\n", Some(64)),
            (&["x", "--workspace-mb", "100"][..], "workspace_mb = \"disk\"\n", Some(100)),
        ] {
            let cfg = load(args, file).expect("valid");
            cfg.validate().expect("valid values");
            assert_eq!(cfg.workspace_bound_mb(), want, "{args:?} {file:?}");
        }
        assert!(load(&["x", "--workspace-mb", "lots"], "").is_err());
        let cfg = load(&["x", "--workspace-mb", "512"], "").expect("parses");
        let e = cfg.validate().expect_err("as large as the memory");
        assert!(e.to_string().contains("workspace_mb"), "{e}");
    }

    #[test]
    fn the_uid_range_has_a_free_default_and_is_checked() {
        let cfg = load(&["x"], "").expect("defaults");
        assert_eq!(cfg.uid_range, crate::docker::identity::UidRange::default());
        let cfg = load(&["x"], "uid_range = \"200000-300000\"\n").expect("from the file");
        assert_eq!((cfg.uid_range.first, cfg.uid_range.last), (200_000, 300_000));
        let e = load(&["x"], "uid_range = \"1000-2000\"\n").expect_err("users' uids");
        assert!(e.contains("uid_range"), "{e}");
        assert!(load(&["x", "--uid-range", "1000-1000"], "").is_err());
    }
}
