//! Configuration: flags, environment variables and a TOML file.
//!
//! Precedence is flag > environment variable > file > default: clap resolves the first two
//! and the default, then [`file::apply_file`] fills in what clap took from a default. Every value is
//! validated by [`SandboxConfig::validate`] before the server touches Docker.
//!
//! The struct is the flag, the variable and the file key of every setting; their checks are in
//! `validate.rs`, the file's reading in `file.rs`. Why this file still passes 500 lines: that
//! one struct, each setting with its documentation, is 340 of them.

use std::path::{Path, PathBuf};
use std::time::Duration;

pub mod file;
#[cfg(test)]
mod tests;
pub mod validate;

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

    /// Kubernetes: the ReadWriteMany PersistentVolumeClaim of the namespace that holds the
    /// layer store (deploy/kubernetes/25-layers.yaml). Unset: package installs are refused.
    #[arg(long, env = "PYBERTH_K8S_LAYER_CLAIM")]
    pub k8s_layer_claim: Option<String>,

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

    /// Started, hardened containers kept ready for new sessions of the default environment;
    /// other environments' pools follow their demand alone (0 disables every warm pool).
    #[arg(long, env = "PYBERTH_POOL_SIZE", default_value_t = 2)]
    pub pool_size: usize,

    /// Most containers the warm pool holds when recent demand asks for more than
    /// `--pool-size` (it follows the peak of new sessions per 10 s, halving each idle minute;
    /// never below `--pool-size`).
    #[arg(long, env = "PYBERTH_POOL_MAX", default_value_t = 16)]
    pub pool_max: usize,

    /// Most memory the warm pools of all environments hold together, MiB: each environment's
    /// idle container is measured, and the pools shrink to fit (about 13 MiB each here).
    #[arg(long, env = "PYBERTH_POOL_MEMORY_MB", default_value_t = 1024)]
    pub pool_memory_mb: u64,

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

impl SandboxConfig {
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
