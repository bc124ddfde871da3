//! What the proxy holds in force: per session (by the proxy's address on its network) the
//! allow-list, the headers and their masked forms, connection slots, the byte budget and the
//! refusal rate; and the settings of the whole proxy. Changed only by the server's commands.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use super::mitm::Mitm;
use super::scrub::secret_forms;
pub(super) use super::splice::Budget;
use super::wire::Command;
use crate::egress::policy::Rule;

/// Refusals one session has answered at once; past them, [`REFUSAL_RATE`] a second.
pub(super) const REFUSAL_BURST: f64 = 64.0;

/// Refusals a second one session has answered at once, past the burst.
pub(super) const REFUSAL_RATE: f64 = 16.0;

/// How long a refusal past the rate waits, holding one of the session's connection slots:
/// code that opens refused connections in a loop gets at most `--egress-max-conns` / this
/// answered a second (320 with the default 32) instead of thousands.
pub(super) const REFUSAL_PENALTY: Duration = Duration::from_millis(100);

/// One session's policy.
pub(super) struct Policy {
    pub(super) session: String,
    pub(super) principal: String,
    /// Its allow-list.
    pub(super) rules: Vec<Rule>,
    /// Headers set on requests, by host.
    pub(super) headers: HashMap<String, Vec<(String, String)>>,
    /// Every header value: scrubbed from what upstreams send back.
    pub(super) secrets: Vec<Vec<u8>>,
    /// Connections open at once (`--egress-max-conns`), refusals past the rate included.
    pub(super) conns: Arc<Semaphore>,
    pub(super) budget: Arc<Budget>,
    pub(super) refusals: Arc<RefusalRate>,
    /// Keyed by peer: the `Proxy-Authorization` its connections must carry.
    pub(super) pass: Option<String>,
}

/// A session's refusals: a token bucket of [`REFUSAL_BURST`] filled at [`REFUSAL_RATE`].
pub(super) struct RefusalRate(std::sync::Mutex<(f64, Instant)>);

impl RefusalRate {
    fn new() -> Self {
        Self(std::sync::Mutex::new((REFUSAL_BURST, Instant::now())))
    }

    /// Takes one refusal; false past the rate.
    pub(super) fn take(&self) -> bool {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, at) = &mut *g;
        *tokens = (*tokens + at.elapsed().as_secs_f64() * REFUSAL_RATE).min(REFUSAL_BURST);
        *at = Instant::now();
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Everything in force: the sessions' policies by the proxy's address on their networks,
/// and the settings of [`Command::Config`].
#[derive(Default)]
pub(super) struct State {
    pub(super) policies: HashMap<IpAddr, Arc<Policy>>,
    pub(super) pinned: HashMap<String, IpAddr>,
    pub(super) own: Vec<IpAddr>,
    pub(super) max_conns: usize,
    pub(super) mitm: Option<Arc<Mitm>>,
    /// Policies are keyed by the connection's source address ([`Command::Config`]).
    pub(super) by_peer: bool,
}

/// The state, read by every connection, written by the control loop.
pub(super) type Shared = Arc<RwLock<State>>;

/// Puts one of the server's commands in force.
pub(super) fn apply(state: &Shared, c: Command) {
    let mut s = state.write().unwrap_or_else(|e| e.into_inner());
    match c {
        Command::Config { pinned, own, max_conns, ca_key, roots, by_peer } => {
            s.mitm = match ca_key.map(|k| Mitm::new(&k, roots.as_deref())) {
                Some(Ok(m)) => Some(Arc::new(m)),
                Some(Err(e)) => {
                    // Hosts with headers then get a plain tunnel: no secret is added, none leaks.
                    tracing::warn!(error = %e, "TLS termination unavailable");
                    None
                }
                None => None,
            };
            s.pinned = pinned;
            s.own = own;
            s.max_conns = max_conns.max(1);
            s.by_peer = by_peer;
        }
        Command::Set { local, session, principal, allow, headers, pass } => {
            let rules = allow.iter().filter_map(|a| Rule::parse(a).ok()).collect();
            // The connection slots, the budget and the refusal rate survive a new list.
            let (conns, budget, refusals) = match s.policies.get(&local) {
                Some(p) => (p.conns.clone(), p.budget.clone(), p.refusals.clone()),
                None => {
                    let b = Budget::default();
                    b.left.store(u64::MAX, Ordering::SeqCst);
                    (Arc::new(Semaphore::new(s.max_conns)), Arc::new(b), Arc::new(RefusalRate::new()))
                }
            };
            let mut secrets: Vec<Vec<u8>> =
                headers.values().flatten().filter(|(_, v)| !v.is_empty()).flat_map(|(_, v)| secret_forms(v)).collect();
            secrets.sort();
            secrets.dedup();
            let pass = pass.map(|p| super::head::basic_auth(&p.0));
            let policy = Policy { session, principal, rules, headers, secrets, conns, budget, refusals, pass };
            s.policies.insert(local, Arc::new(policy));
        }
        Command::Budget { local, bytes } => {
            if let Some(p) = s.policies.get(&local) {
                p.budget.left.store(bytes.unwrap_or(u64::MAX), Ordering::SeqCst);
            }
        }
        Command::Drop { local } => {
            s.policies.remove(&local);
        }
        Command::Sync { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keying by peer is the server's word only: a Config without it (Docker's) keeps keying by
    /// the proxy's own address; with it, the state says so for every connection.
    #[test]
    fn keying_by_peer_only_when_the_config_says_so() {
        let state: Shared = Arc::default();
        let docker = r#"{"op":"config","pinned":{},"own":[],"max_conns":4}"#;
        apply(&state, serde_json::from_str(docker).expect("a config without by_peer"));
        assert!(!state.read().expect("state").by_peer);
        let k8s = r#"{"op":"config","pinned":{},"own":[],"max_conns":4,"by_peer":true}"#;
        apply(&state, serde_json::from_str(k8s).expect("config"));
        assert!(state.read().expect("state").by_peer);
    }

    /// A server knows whether the proxy checks passes from its Ready: an older proxy's says
    /// nothing (and is refused keyed by peer); a Set's pass becomes the header it expects, and
    /// a Set without one (Docker's, or an older server's) expects none.
    #[test]
    fn ready_says_passes_and_a_set_keeps_its_pass_as_the_header_it_wants() {
        use super::super::wire::Report;
        let old: Report = serde_json::from_str(r#"{"ev":"ready"}"#).expect("an older proxy's Ready");
        assert!(matches!(old, Report::Ready { passes: false }));
        let now = serde_json::to_string(&Report::Ready { passes: true }).expect("json");
        assert!(matches!(serde_json::from_str(&now).expect("ready"), Report::Ready { passes: true }));
        let state: Shared = Arc::default();
        let set =
            |pass: Option<&str>| Command::set([10, 0, 0, 9].into(), "p", "s", vec![], HashMap::new()).with_pass(pass);
        apply(&state, set(Some("0123abcd")));
        let wanted = state.read().expect("state").policies[&IpAddr::from([10, 0, 0, 9])].pass.clone();
        assert_eq!(wanted.as_deref(), Some("Basic cHliZXJ0aDowMTIzYWJjZA=="));
        apply(&state, set(None));
        assert!(state.read().expect("state").policies[&IpAddr::from([10, 0, 0, 9])].pass.is_none());
    }

    /// The burst is answered at once, the next refusal is not, and the rate refills it.
    #[test]
    fn refusals_past_the_burst_are_over_the_rate_until_it_refills() {
        let rate = RefusalRate::new();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 64
        let burst = REFUSAL_BURST as usize;
        assert!((0..burst).all(|_| rate.take()));
        assert!(!rate.take());
        rate.0.lock().unwrap_or_else(|e| e.into_inner()).1 -= Duration::from_secs(1);
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 16
        let refilled = REFUSAL_RATE as usize;
        assert!((0..refilled).all(|_| rate.take()));
        assert!(!rate.take());
    }
}
