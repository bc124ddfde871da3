//! Code mode (issue 30): Python in a session calls the operator's MCP tools through the
//! agent channel, and the server enforces everything, since the code can forge any message.
//!
//! - `spec.rs`: `[upstreams.NAME]` in the config file, secrets resolved on the host;
//! - `policy.rs`: an environment's allow-list, write opt-ins and budget (pure);
//! - `upstream.rs`: one MCP client per upstream, started lazily, restarted after failures;
//! - `calls.rs`: a run's calls ([`RunCalls`]): the allow-list on every call, argument and result
//!   caps, the run's call budget (count and time), the per-call timeout, calls in flight per
//!   session, and an audit line per call. Dropping a [`RunCalls`] (the run ended, was
//!   interrupted or timed out) drops its calls in flight, which cancels them upstream. One
//!   [`RunCalls`] serves a run across reattaches (its budget holds, its calls in flight go on);
//! - `recent.rs`: the latest replies sent ([`Recent`]), sent again after a reattach.

mod calls;
pub mod policy;
mod recent;
pub mod spec;
pub mod upstream;

use std::collections::HashMap;
use std::sync::Arc;

pub use calls::{CallCounts, Reply, RunCalls};
use policy::{Policy, Refusal};
pub use recent::Recent;
use upstream::Upstreams;

/// Largest arguments of one call accepted, bytes of JSON.
pub const MAX_ARGS: usize = 256 << 10;
/// Largest catalogue sent to the agent, bytes of JSON.
const MAX_CATALOGUE: usize = 4 << 20;
/// Catalogue requests one run may make (the Python side keeps what it got).
const MAX_LISTS: u32 = 50;
/// Refusals of one run logged line by line; the rest are counted in one line at its end.
const LOGGED_REFUSALS: u32 = 10;
/// A name from the sandbox is shown in logs cut to this many bytes.
const NAME_SHOWN: usize = 128;

/// The upstreams of a server: built once from the configuration, shared by every session.
#[derive(Debug, Default)]
pub struct Bridge {
    upstreams: Upstreams,
    /// Principals' own lists, which narrow their environments'.
    principals: HashMap<String, Vec<policy::Pattern>>,
    /// The server's metrics: bridged calls are counted there.
    metrics: Arc<crate::metrics::Metrics>,
}

impl Bridge {
    /// Resolves `[upstreams.*]` (secrets read now, from the server's environment and files).
    pub fn from_config(cfg: &crate::config::SandboxConfig) -> Result<Self, String> {
        let var = |k: &str| std::env::var(k).ok();
        let file = |p: &str| std::fs::read_to_string(p).map_err(|e| e.to_string());
        let mut all = Vec::new();
        for (name, s) in &cfg.upstreams {
            all.push(spec::resolve(name, s, &var, &file)?);
        }
        let known = |s: &str| cfg.upstreams.contains_key(s);
        let mut principals = HashMap::new();
        for (who, p) in &cfg.principals {
            // An entry with quotas only narrows nothing.
            let Some(tools) = &p.tools else { continue };
            let list = tools
                .iter()
                .map(|t| policy::Pattern::parse(t, &known))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("principals.{who}.tools: {e}"))?;
            principals.insert(who.clone(), list);
        }
        let over_http = all.iter().any(|u| matches!(u.transport, spec::Transport::Http { .. }));
        let client = if over_http { Some(upstream::http_client(cfg.ca_bundle().as_deref())?) } else { None };
        Ok(Self { upstreams: Upstreams::new(all, client), principals, metrics: Arc::default() })
    }

    /// The same, its calls counted in `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// `policy` as `principal` may use it: narrowed by the principal's own list, if any.
    pub fn narrowed(&self, policy: &Policy, principal: &str) -> Policy {
        Policy { narrow: self.principals.get(principal).cloned(), ..policy.clone() }
    }

    /// What a session of `principal` may call in its runs, under `policy`; `None` when the
    /// policy allows nothing.
    pub fn grant(self: &Arc<Self>, policy: &Policy, principal: &str, session: &str) -> Option<Arc<Grant>> {
        (!policy.allow.is_empty()).then(|| {
            Arc::new(Grant {
                bridge: self.clone(),
                policy: self.narrowed(policy, principal),
                principal: principal.to_owned(),
                session: session.to_owned(),
            })
        })
    }

    /// The tools `policy` lets a session call, each with whether it may be called as is,
    /// and the upstreams that could not be reached, with why.
    pub async fn catalogue(&self, policy: &Policy) -> (Vec<Listed>, Vec<(String, String)>) {
        let mut listed = Vec::new();
        let mut unavailable = Vec::new();
        let mut servers: Vec<&str> =
            policy.allow.iter().map(policy::Pattern::server).filter(|s| policy.reaches(s)).collect();
        servers.sort_unstable();
        servers.dedup();
        // Every upstream at once: one slow to start does not hold up the others' lists.
        let lists = futures::future::join_all(
            servers.iter().filter_map(|s| self.upstreams.get(s).map(|link| async move { (*s, link.tools().await) })),
        )
        .await;
        for (server, tools) in lists {
            match tools {
                Ok(tools) => {
                    for t in tools.iter() {
                        match policy.check(&t.server, &t.tool, t.read_only) {
                            Ok(()) => listed.push(Listed { info: t.clone(), callable: true }),
                            Err(Refusal::NotReadOnly) => listed.push(Listed { info: t.clone(), callable: false }),
                            Err(Refusal::NotAllowed) => {}
                        }
                    }
                }
                Err(why) => unavailable.push((server.to_owned(), why)),
            }
        }
        (listed, unavailable)
    }
}

/// A tool a session may see.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Listed {
    /// The tool.
    #[serde(flatten)]
    pub info: upstream::ToolInfo,
    /// False for a tool not marked read-only that the operator did not opt in.
    pub callable: bool,
}

/// What one session's runs may call: its environment's policy, for its principal.
#[derive(Debug)]
pub struct Grant {
    bridge: Arc<Bridge>,
    policy: Policy,
    principal: String,
    session: String,
}
