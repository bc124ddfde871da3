//! Prometheus metrics (issue 32): counters and histograms the owners add to as things happen,
//! gauges the registry sets from its own state at each scrape, and the text a scrape gets.
//! docs/observability.md lists every series.
//!
//! No global registry: the registry owns one [`Metrics`] and hands it to what it owns (the
//! egress manager, the bridge, sessions through their blueprint). Fronts read it only through
//! the registry. Another family is one line: `let f = metrics.family::<L, Gauge>("name", "help");`.

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Metric, Registry, Unit};

mod labels;
mod quota;

pub(crate) use labels::Bounds;
use labels::Who;
pub(crate) use quota::QuotaRow;

/// The content type of the OpenMetrics text prometheus-client writes (Prometheus reads it).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A histogram family with its buckets.
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// How a new session got its container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// From the warm pool.
    Pool,
    /// Made for it (the pool was empty, another environment, or egress).
    Cold,
    /// A hibernated session woke.
    Wake,
    /// Taken over from an earlier server of the state dir.
    Adopt,
}

impl Source {
    fn word(self) -> &'static str {
        match self {
            Self::Pool => "pool",
            Self::Cold => "cold",
            Self::Wake => "wake",
            Self::Adopt => "adopt",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
    environment: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabels {
    status: &'static str,
    environment: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BridgeLabels {
    upstream: String,
    outcome: &'static str,
}

/// One fixed label, `[(name, word)]`.
type One = [(&'static str, &'static str); 1];

/// Every series of the server.
#[derive(Debug)]
pub struct Metrics {
    registry: Mutex<Registry>,
    /// Registered after the rest (`family`), set at each scrape.
    quotas: std::sync::OnceLock<quota::QuotaGauges>,
    bounds: Bounds,
    sessions: Family<StateLabels, Gauge>,
    sessions_created: Family<(One, Who), Counter>,
    session_start: Histograms<One>,
    runs: Family<(RunLabels, Who), Counter>,
    run_duration: Histograms<One>,
    pool_containers: Gauge,
    pool_target: Gauge,
    pool_bytes: Gauge,
    pool_takes: Family<One, Counter>,
    pool_hit_ratio: Gauge<f64, AtomicU64>,
    installs: Family<One, Counter>,
    install_duration: Histograms<One>,
    egress_bytes: Family<One, Counter>,
    egress_connections: Family<One, Counter>,
    snapshots: Gauge,
    snapshot_bytes: Gauge,
    snapshots_taken: Family<One, Counter>,
    snapshot_taken_bytes: Counter,
    bridged_calls: Family<BridgeLabels, Counter>,
    bridged_call_duration: Histogram,
    http_connections: Family<One, Counter>,
    http_open: Gauge,
    http_refusals: Family<One, Counter>,
    engine_errors: Family<One, Counter>,
}

fn session_buckets() -> Histogram {
    Histogram::new([0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0])
}

fn run_buckets() -> Histogram {
    Histogram::new([0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0])
}

fn install_buckets() -> Histogram {
    Histogram::new([0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0])
}

impl Default for Metrics {
    /// Metrics that label nothing the operator configured (for commands without a server).
    fn default() -> Self {
        Self::new(Bounds::default())
    }
}

impl Metrics {
    /// Every family, registered under the `pyberth_` prefix, labels bounded by `bounds`.
    pub(crate) fn new(bounds: Bounds) -> Self {
        let mut r = Registry::with_prefix("pyberth");
        let m = Self {
            sessions: family(&mut r, "sessions", "Sessions now, by state and environment", None),
            sessions_created: family(
                &mut r,
                "sessions_created",
                "New sessions, by where their container came from",
                None,
            ),
            session_start: histograms(&mut r, "session_start", "Time to a usable session, by source", session_buckets),
            runs: family(&mut r, "runs", "Runs ended (foreground and jobs), by status and environment", None),
            run_duration: histograms(&mut r, "run_duration", "Run durations, by status", run_buckets),
            pool_containers: family(&mut r, "pool_containers", "Warm containers ready now", None),
            pool_target: family(&mut r, "pool_target", "Warm containers the pool aims for now (follows demand)", None),
            pool_bytes: family(&mut r, "pool_memory_bytes", "Memory the warm containers hold (as measured)", None),
            pool_takes: family(&mut r, "pool_takes", "Asks for a pooled container, by result (hit, miss)", None),
            pool_hit_ratio: family(&mut r, "pool_hit_ratio", "Hits over asks for a pooled container since start", None),
            installs: family(
                &mut r,
                "installs",
                "Package sets asked for, by result (hit: cached layer, miss, error)",
                None,
            ),
            install_duration: histograms(
                &mut r,
                "install_duration",
                "Time to a package layer, by result",
                install_buckets,
            ),
            egress_bytes: family(&mut r, "egress", "Bytes through the egress proxy, by direction", Some(Unit::Bytes)),
            egress_connections: family(&mut r, "egress_connections", "Egress connections, by verdict", None),
            snapshots: family(&mut r, "snapshots", "Snapshots kept now", None),
            snapshot_bytes: family(&mut r, "snapshot", "Bytes all kept snapshots take now", Some(Unit::Bytes)),
            snapshots_taken: family(
                &mut r,
                "snapshots_taken",
                "Snapshots taken, by kind (save, fork, hibernate)",
                None,
            ),
            snapshot_taken_bytes: family(&mut r, "snapshot_taken", "Bytes of the snapshots taken", Some(Unit::Bytes)),
            bridged_calls: family(&mut r, "bridged_calls", "Code-mode tool calls to upstreams, by outcome", None),
            bridged_call_duration: {
                let h = Histogram::new([0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0]);
                r.register_with_unit("bridged_call_duration", "Time of bridged tool calls", Unit::Seconds, h.clone());
                h
            },
            http_connections: family(
                &mut r,
                "http_connections",
                "HTTP connections, by result (accepted, refused)",
                None,
            ),
            http_open: family(&mut r, "http_open_connections", "HTTP connections open now", None),
            http_refusals: family(&mut r, "http_refusals", "HTTP requests refused before MCP, by reason", None),
            engine_errors: family(&mut r, "engine_errors", "Engine calls that failed, by operation", None),
            registry: Mutex::new(Registry::default()),
            quotas: std::sync::OnceLock::new(),
            bounds,
        };
        *m.registry.lock().unwrap_or_else(|e| e.into_inner()) = r;
        m
    }

    /// Registers another family and returns it (a handle: clones share the series).
    pub fn family<L, M>(&self, name: &str, help: &str) -> Family<L, M>
    where
        L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
        M: Default
            + Metric
            + Clone
            + prometheus_client::metrics::TypedMetric
            + prometheus_client::encoding::EncodeMetric,
    {
        let f = Family::<L, M>::default();
        self.registry.lock().unwrap_or_else(|e| e.into_inner()).register(name, help, f.clone());
        f
    }

    /// The OpenMetrics text of every series.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let r = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &r) {
            tracing::warn!(error = %e, "cannot encode the metrics");
        }
        out
    }

    /// A session got its container from `source`, `took` after it was asked for.
    pub fn session_created(&self, source: Source, principal: &str, took: Duration) {
        let one = [("source", source.word())];
        self.sessions_created.get_or_create(&(one, self.bounds.who(principal))).inc();
        self.session_start.get_or_create(&one).observe(took.as_secs_f64());
    }

    /// A run ended with `status` after `took`.
    pub(crate) fn run_ended(
        &self,
        status: crate::output::RunStatus,
        environment: &str,
        principal: &str,
        took: Duration,
    ) {
        let status = status_word(status);
        let labels = RunLabels { status, environment: self.bounds.environment(environment) };
        self.runs.get_or_create(&(labels, self.bounds.who(principal))).inc();
        self.run_duration.get_or_create(&[("status", status)]).observe(took.as_secs_f64());
    }

    /// A new session asked the pool for a container: `hit` when there was one.
    pub fn pool_take(&self, hit: bool) {
        self.pool_takes.get_or_create(&[("result", if hit { "hit" } else { "miss" })]).inc();
        let hits = self.pool_takes.get_or_create(&[("result", "hit")]).get();
        let misses = self.pool_takes.get_or_create(&[("result", "miss")]).get();
        #[allow(clippy::cast_precision_loss)] // counts far below 2^52
        self.pool_hit_ratio.set(hits as f64 / (hits + misses).max(1) as f64);
    }

    /// A package set was asked for: `cached` when its layer was there; `None` when it failed.
    pub fn install(&self, cached: Option<bool>, took: Duration) {
        let result = [(
            "result",
            match cached {
                Some(true) => "hit",
                Some(false) => "miss",
                None => "error",
            },
        )];
        self.installs.get_or_create(&result).inc();
        self.install_duration.get_or_create(&result).observe(took.as_secs_f64());
    }

    /// A connection through the egress proxy ended (or was refused).
    pub fn egress(&self, allowed: bool, cut: bool, bytes_out: u64, bytes_in: u64) {
        let verdict = if cut {
            "cut"
        } else if allowed {
            "allowed"
        } else {
            "refused"
        };
        self.egress_connections.get_or_create(&[("verdict", verdict)]).inc();
        self.egress_bytes.get_or_create(&[("direction", "out")]).inc_by(bytes_out);
        self.egress_bytes.get_or_create(&[("direction", "in")]).inc_by(bytes_in);
    }

    /// A snapshot of `bytes` was taken (`save`, `fork`, `hibernate`).
    pub fn snapshot_taken(&self, kind: &'static str, bytes: u64) {
        self.snapshots_taken.get_or_create(&[("kind", kind)]).inc();
        self.snapshot_taken_bytes.inc_by(bytes);
    }

    /// A bridged tool call to `upstream` (as the sandbox named it) ended with `outcome`.
    pub fn bridged_call(&self, upstream: &str, outcome: &'static str, took: Duration) {
        let labels = BridgeLabels { upstream: self.bounds.upstream(upstream), outcome };
        self.bridged_calls.get_or_create(&labels).inc();
        self.bridged_call_duration.observe(took.as_secs_f64());
    }

    /// An HTTP connection was accepted or refused (past a connection cap).
    pub fn http_connection(&self, accepted: bool) {
        self.http_connections.get_or_create(&[("result", if accepted { "accepted" } else { "refused" })]).inc();
    }

    /// The gauge of open HTTP connections (held for a connection's life).
    pub fn http_open(&self) -> Gauge {
        self.http_open.clone()
    }

    /// A request was refused before MCP, for `reason` (host, token, mcp_sessions, ...).
    pub fn http_refusal(&self, reason: &'static str) {
        self.http_refusals.get_or_create(&[("reason", reason)]).inc();
    }

    /// The engine failed a call: `op` is the [`crate::docker::Engine`] method's name.
    pub fn engine_error(&self, op: &'static str) {
        self.engine_errors.get_or_create(&[("op", op)]).inc();
    }

    /// The scrape-time gauges, from the registry's state.
    pub(crate) fn set_state(&self, now: &State) {
        self.sessions.clear();
        for ((state, env), n) in &now.sessions {
            let labels = StateLabels { state, environment: self.bounds.environment(env) };
            self.sessions.get_or_create(&labels).inc_by(*n);
        }
        self.pool_containers.set(now.pool);
        self.pool_target.set(now.pool_target);
        self.pool_bytes.set(now.pool_bytes);
        self.snapshots.set(now.snapshots);
        self.snapshot_bytes.set(now.snapshot_bytes);
        self.quotas.get_or_init(|| quota::QuotaGauges::new(self)).set(&now.quotas);
    }
}

/// What the registry holds at a scrape.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Sessions by (state, environment).
    pub(crate) sessions: std::collections::BTreeMap<(&'static str, String), i64>,
    /// Warm containers ready.
    pub(crate) pool: i64,
    /// The pool's target now.
    pub(crate) pool_target: i64,
    /// What the ready containers hold, bytes (each environment's idle container measured).
    pub(crate) pool_bytes: i64,
    /// Snapshots kept.
    pub(crate) snapshots: i64,
    /// Their bytes.
    pub(crate) snapshot_bytes: i64,
    /// Quota use of the principals the configuration names.
    pub(crate) quotas: Vec<QuotaRow>,
}

fn status_word(s: crate::output::RunStatus) -> &'static str {
    use crate::output::RunStatus as S;
    match s {
        S::Ok => "ok",
        S::Error => "error",
        S::Timeout => "timeout",
        S::Cancelled => "cancelled",
        S::InterpreterRestarted => "interpreter_restarted",
        S::Oom => "oom",
        S::Running => "running",
    }
}

fn family<M: Metric + Clone + Default>(r: &mut Registry, name: &str, help: &str, unit: Option<Unit>) -> M {
    let m = M::default();
    match unit {
        Some(u) => r.register_with_unit(name, help, u, m.clone()),
        None => r.register(name, help, m.clone()),
    }
    m
}

fn histograms<L>(r: &mut Registry, name: &str, help: &str, buckets: fn() -> Histogram) -> Histograms<L>
where
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
{
    let f = Family::new_with_constructor(buckets);
    r.register_with_unit(name, help, Unit::Seconds, f.clone());
    f
}
