//! A run's code-mode calls ([`RunCalls`]): every check the server makes on a call the code
//! sends, the calls in flight (dropped, so cancelled upstream, when the run stops), the audit
//! line of each, and the counts the run's result reports.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt as _;
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt as _};
use serde_json::Value;
use sha2::Digest as _;

use super::policy::{self, Policy, Refusal};
use super::upstream::Link;
use super::{Grant, LOGGED_REFUSALS, Listed, MAX_ARGS, MAX_CATALOGUE, MAX_LISTS, NAME_SHOWN, upstream};
use crate::egress::Shown;

/// An answer for the agent: the call's number, then the value or the error's text.
pub type Reply = (u64, Result<Value, String>);

/// The result cap that marks a finished listing (a call's cap is at most 8 MiB).
const LISTING: usize = usize::MAX;

/// A call that finished: its number, how, its result cap ([`LISTING`] for a listing).
type Finished = (u64, Done, usize);

/// How a call finished.
enum Done {
    /// The upstream answered.
    Answer(upstream::Answer),
    /// The upstream could not be asked or did not answer.
    Failed(String),
    /// Refused on the upstream's own word on the tool (not listed, not read-only).
    Refused(String),
}

/// A call in flight.
struct InFlight {
    server: String,
    tool: String,
    args_hash: String,
    started: Instant,
}

/// The calls of one run: its budget, its calls in flight, its counts.
pub struct RunCalls<'a> {
    grant: Option<&'a Grant>,
    made: u32,
    refused: u32,
    lists: u32,
    spent: Duration,
    in_flight: HashMap<u64, InFlight>,
    pending: FuturesUnordered<BoxFuture<'static, Finished>>,
    /// Set when the run is being stopped: no new calls.
    closed: bool,
}

impl std::fmt::Debug for RunCalls<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunCalls").field("made", &self.made).field("refused", &self.refused).finish_non_exhaustive()
    }
}

/// The counts a run's result reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct CallCounts {
    /// Calls that went to an upstream.
    pub made: u32,
    /// Calls refused by the server (not allowed, over budget, too large, ...).
    pub refused: u32,
}

/// The catalogue as the agent gets it, within [`MAX_CATALOGUE`] bytes: when the tools'
/// schemas would pass it, they are left out (`tools.describe` then shows none), then tools.
fn bounded_catalogue(mut listed: Vec<Listed>, unavailable: Vec<(String, String)>) -> Value {
    let size = |l: &[Listed]| serde_json::to_vec(l).map_or(usize::MAX, |v| v.len());
    if size(&listed) > MAX_CATALOGUE {
        for l in &mut listed {
            l.info.input_schema = Value::Object(serde_json::Map::new());
        }
        while size(&listed) > MAX_CATALOGUE {
            listed.truncate(listed.len() / 2);
        }
    }
    serde_json::json!({ "tools": listed, "unavailable": unavailable })
}

/// Hex of the first 8 bytes of SHA-256 of the arguments' JSON: enough to tell calls apart
/// in an audit, nothing of their content.
fn args_hash(args: &Value) -> String {
    let digest = sha2::Sha256::digest(serde_json::to_vec(args).unwrap_or_default());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

impl<'a> RunCalls<'a> {
    /// The calls of a run under `grant` (`None`: code mode is off for the session).
    pub fn new(grant: Option<&'a Grant>) -> Self {
        Self {
            grant,
            made: 0,
            refused: 0,
            lists: 0,
            spent: Duration::ZERO,
            in_flight: HashMap::new(),
            pending: FuturesUnordered::new(),
            closed: false,
        }
    }

    /// What the run's result reports.
    pub fn counts(&self) -> CallCounts {
        CallCounts { made: self.made, refused: self.refused }
    }

    /// Counts a call in the server's metrics (every one: the log shows only the first refusals).
    fn count(&self, server: &str, outcome: &'static str, ms: u128) {
        if let Some(g) = self.grant {
            let took = std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX));
            g.bridge.metrics.bridged_call(server, outcome, took);
        }
    }

    fn audit(&self, server: &str, tool: &str, hash: &str, outcome: &'static str, ms: u128, bytes: usize) {
        if outcome != "refused" {
            self.count(server, outcome, ms);
        }
        let (principal, session) = self.grant.map_or(("?", "?"), |g| (g.principal.as_str(), g.session.as_str()));
        tracing::info!(
            target: "pyberth::bridge",
            principal = ?Shown(principal, NAME_SHOWN),
            session = ?Shown(session, NAME_SHOWN),
            upstream = ?Shown(server, NAME_SHOWN),
            tool = ?Shown(tool, NAME_SHOWN),
            args_hash = %hash,
            outcome,
            ms,
            bytes,
            "bridged tool call"
        );
    }

    fn refuse(&mut self, call: u64, server: &str, tool: &str, hash: &str, why: String) -> Reply {
        self.refused += 1;
        self.count(server, "refused", 0);
        if self.refused <= LOGGED_REFUSALS {
            self.audit(server, tool, hash, "refused", 0, 0);
        }
        (call, Err(why))
    }

    /// A `tool_call` event of the run: an answer now, or a call started (answered through
    /// [`RunCalls::next`]).
    pub fn begin(&mut self, call: u64, op: Option<&str>, tool: Option<&str>, args: Option<Value>) -> Option<Reply> {
        let Some(grant) = self.grant else {
            return Some(
                self.refuse(
                    call,
                    "",
                    tool.unwrap_or_default(),
                    "",
                    "code mode is off for this session: its environment allows no upstream tools (list_bridged_tools \
                 tells which environments do)"
                        .into(),
                ),
            );
        };
        if op == Some("list") {
            return self.list(call, grant);
        }
        let tool = tool.unwrap_or_default();
        let args = args.unwrap_or(Value::Object(serde_json::Map::new()));
        let hash = args_hash(&args);
        let (server, name, link, args, left) = match self.admit(call, grant, tool, args) {
            Ok(admitted) => admitted,
            Err((server, name, why)) => return Some(self.refuse(call, &server, &name, &hash, why)),
        };
        self.made += 1;
        let policy = grant.policy.clone();
        self.in_flight.insert(
            call,
            InFlight { server: server.clone(), tool: name.clone(), args_hash: hash, started: Instant::now() },
        );
        self.pending.push(call_upstream(call, link, server, name, args, policy, left).boxed());
        None
    }

    /// A listing of the tools this run may call, answered through [`RunCalls::next`].
    fn list(&mut self, call: u64, grant: &Grant) -> Option<Reply> {
        self.lists += 1;
        if self.lists > MAX_LISTS {
            return Some(self.refuse(call, "", "", "", format!("more than {MAX_LISTS} tool listings in one run")));
        }
        let (bridge, policy) = (grant.bridge.clone(), grant.policy.clone());
        self.pending.push(
            async move {
                let (listed, unavailable) = bridge.catalogue(&policy).await;
                let value = bounded_catalogue(listed, unavailable);
                (call, Done::Answer(upstream::Answer { value, is_error: false }), LISTING)
            }
            .boxed(),
        );
        None
    }

    /// The checks of one call before it starts: the allow-list, the arguments, the budgets.
    /// Ok: the call's upstream, its arguments and the time left; Err: (server, tool, why).
    #[allow(clippy::type_complexity)] // named once, here
    fn admit(
        &self,
        call: u64,
        grant: &Grant,
        tool: &str,
        args: Value,
    ) -> Result<(String, String, Arc<Link>, serde_json::Map<String, Value>, Duration), (String, String, String)> {
        let Some((server, name)) = tool.split_once('.') else {
            return Err((String::new(), tool.to_owned(), format!("{tool:?} is not server.tool")));
        };
        let (server, name) = (server.to_owned(), name.to_owned());
        let Some(link) = grant.bridge.upstreams.get(&server).filter(|_| grant.policy.reaches(&server)).cloned() else {
            let why = format!("{server}.{name} is not on this session's allow-list");
            return Err((server, name, why));
        };
        let Value::Object(args) = args else {
            return Err((server, name, "arguments must be keyword arguments".into()));
        };
        let size = serde_json::to_vec(&args).map_or(usize::MAX, |v| v.len());
        if size > MAX_ARGS {
            let why = format!("arguments of {size} bytes, over the {} KiB limit", MAX_ARGS >> 10);
            return Err((server, name, why));
        }
        if self.closed {
            return Err((server, name, "the run is being stopped".into()));
        }
        if self.in_flight.contains_key(&call) {
            // Forged: every call must be audited and counted once, under its own number.
            return Err((server, name, format!("call number {call} is already in flight")));
        }
        if self.made >= grant.policy.calls {
            let why = format!("call budget spent: a run may make {} tool calls", grant.policy.calls);
            return Err((server, name, why));
        }
        let left = grant.policy.time.saturating_sub(self.spent);
        if left.is_zero() {
            let why =
                format!("time budget spent: a run's tool calls may take {} s together", grant.policy.time.as_secs());
            return Err((server, name, why));
        }
        if self.in_flight.len() >= policy::CONCURRENT_CALLS {
            let why = format!("{} tool calls already in flight in this session", policy::CONCURRENT_CALLS);
            return Err((server, name, why));
        }
        Ok((server, name, link, args, left))
    }

    /// The next call to finish, as an answer for the agent; pending forever when none is
    /// in flight (for `select!`).
    pub async fn next(&mut self) -> Reply {
        let Some((call, done, max)) = self.pending.next().await else {
            return std::future::pending().await;
        };
        if max == LISTING {
            // A listing: not a call, not audited.
            return match done {
                Done::Answer(a) => (call, Ok(a.value)),
                Done::Failed(why) | Done::Refused(why) => (call, Err(why)),
            };
        }
        let Some(f) = self.in_flight.remove(&call) else {
            return (call, Err("the call was dropped".into()));
        };
        let took = f.started.elapsed();
        self.spent += took;
        let ms = took.as_millis();
        let reply = match done {
            Done::Refused(why) => {
                self.made -= 1;
                return self.refuse(call, &f.server, &f.tool, &f.args_hash, why);
            }
            Done::Answer(a) => {
                let bytes = serde_json::to_vec(&a.value).map_or(usize::MAX, |v| v.len());
                if bytes > max {
                    self.audit(&f.server, &f.tool, &f.args_hash, "too_large", ms, bytes);
                    Err(format!(
                        "the result of {} bytes is over the {} KiB limit of upstream {}",
                        bytes,
                        max >> 10,
                        f.server
                    ))
                } else if a.is_error {
                    self.audit(&f.server, &f.tool, &f.args_hash, "tool_error", ms, bytes);
                    Err(format!("{}.{} failed: {}", f.server, f.tool, a.value.as_str().unwrap_or_default()))
                } else {
                    self.audit(&f.server, &f.tool, &f.args_hash, "ok", ms, bytes);
                    Ok(a.value)
                }
            }
            Done::Failed(why) => {
                self.audit(&f.server, &f.tool, &f.args_hash, "failed", ms, 0);
                Err(why)
            }
        };
        (call, reply)
    }

    /// The run is being stopped: calls in flight are dropped (cancelled upstream), and new
    /// ones refused.
    pub fn close(&mut self) {
        self.closed = true;
        self.pending = FuturesUnordered::new();
        for (_, f) in std::mem::take(&mut self.in_flight) {
            self.audit(&f.server, &f.tool, &f.args_hash, "cancelled", f.started.elapsed().as_millis(), 0);
        }
    }
}

impl Drop for RunCalls<'_> {
    fn drop(&mut self) {
        self.close();
        if self.refused > LOGGED_REFUSALS {
            let (principal, session) = self.grant.map_or(("?", "?"), |g| (g.principal.as_str(), g.session.as_str()));
            tracing::info!(
                target: "pyberth::bridge",
                principal = ?Shown(principal, NAME_SHOWN),
                session = ?Shown(session, NAME_SHOWN),
                refused = self.refused - LOGGED_REFUSALS,
                "bridged tool calls refused and not logged one by one (the first {LOGGED_REFUSALS} of a run are)"
            );
        }
    }
}

/// One call to an upstream, once admitted: the allow-list checked again against the
/// upstream's own word on the tool, then the call within the run's time left.
#[allow(clippy::too_many_arguments)] // one call's parts, moved into its future
async fn call_upstream(
    call: u64,
    link: Arc<Link>,
    server: String,
    name: String,
    args: serde_json::Map<String, Value>,
    policy: Policy,
    left: Duration,
) -> Finished {
    let max = link.spec.max_result;
    // The allow-list is checked against the upstream's own word on the tool.
    let tools = match link.tools().await {
        Ok(t) => t,
        Err(why) => return (call, Done::Failed(why), max),
    };
    let Some(info) = tools.iter().find(|t| t.tool == name) else {
        return (call, Done::Refused(format!("upstream {server} has no tool {name}")), max);
    };
    match policy.check(&server, &name, info.read_only) {
        Ok(()) => {}
        Err(Refusal::NotAllowed) => {
            let why = format!("{server}.{name} is not on this session's allow-list");
            return (call, Done::Refused(why), max);
        }
        Err(Refusal::NotReadOnly) => {
            return (
                call,
                Done::Refused(format!(
                    "{server}.{name} is not marked read-only by its server, and the operator has not \
                         allowed it by name (write_tools = [\"{server}:{name}\"])"
                )),
                max,
            );
        }
    }
    match tokio::time::timeout(left, link.call(&name, args)).await {
        Ok(Ok(answer)) => (call, Done::Answer(answer), max),
        Ok(Err(why)) => (call, Done::Failed(why), max),
        Err(_) => (call, Done::Failed("the run's time budget for tool calls ran out during the call".into()), max),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(n: usize, schema_kb: usize) -> Vec<Listed> {
        (0..n)
            .map(|i| Listed {
                info: upstream::ToolInfo {
                    server: "s".into(),
                    tool: format!("t{i}"),
                    description: "d".into(),
                    input_schema: serde_json::json!({ "x": "y".repeat(schema_kb << 10) }),
                    read_only: true,
                },
                callable: true,
            })
            .collect()
    }

    #[test]
    fn the_catalogue_drops_schemas_then_tools_to_stay_within_its_bound() {
        let small = bounded_catalogue(listed(3, 1), Vec::new());
        assert_eq!(small["tools"].as_array().map(Vec::len), Some(3));
        assert!(small["tools"][0]["input_schema"]["x"].is_string(), "kept when it fits");
        let big = bounded_catalogue(listed(1000, 64), vec![("u".into(), "down".into())]);
        assert!(serde_json::to_vec(&big).expect("json").len() <= MAX_CATALOGUE + 1024);
        assert_eq!(big["tools"].as_array().map(Vec::len), Some(1000), "every tool, without its schema");
        assert_eq!(big["tools"][0]["input_schema"], serde_json::json!({}));
        assert_eq!(big["unavailable"][0][0], "u");
    }

    #[test]
    fn the_arguments_hash_tells_calls_apart_and_shows_nothing_of_them() {
        let a = args_hash(&serde_json::json!({ "token": "s3cret" }));
        assert_eq!(a.len(), 16);
        assert!(!a.contains("s3cret"));
        assert_ne!(a, args_hash(&serde_json::json!({ "token": "other" })));
    }
}
