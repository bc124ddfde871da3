//! What one session moved through the proxy: bytes, connections, refusals.

use super::*;

/// Egress of one run or one session: hosts reached, bytes, denials.
#[derive(Debug, Clone, Default, serde::Serialize, schemars::JsonSchema)]
pub struct Totals {
    /// Hosts connected to (host:port).
    pub hosts: BTreeSet<String>,
    /// Connections made.
    pub connections: u64,
    /// Bytes sent by the sandbox.
    pub bytes_out: u64,
    /// Bytes received by the sandbox.
    pub bytes_in: u64,
    /// Requests the proxy refused: host:port and why.
    pub denied: Vec<String>,
    /// Connections per host:port, to tell which hosts a run reached.
    #[serde(skip)]
    #[schemars(skip)]
    pub(super) counts: std::collections::BTreeMap<String, u64>,
    /// Denials ever, of which `denied` keeps the last [`MAX_DENIED`].
    #[serde(skip)]
    #[schemars(skip)]
    pub(super) denied_total: u64,
    /// How many of the session's refusals the server's log still shows one by one.
    #[serde(skip)]
    #[schemars(skip)]
    pub(super) log: account::RefusalLog,
}

/// Denials kept per session (and listed per run).
const MAX_DENIED: usize = 50;

impl Totals {
    /// Requests refused ever (of which `denied` lists the last few).
    pub fn refused_total(&self) -> u64 {
        self.denied_total
    }

    pub(super) fn add(&mut self, r: &Record) {
        if r.allowed {
            let host = format!("{}:{}", r.host, r.port);
            *self.counts.entry(host.clone()).or_default() += 1;
            self.hosts.insert(host);
            self.connections += 1;
            self.bytes_out += r.up;
            self.bytes_in += r.down;
            if r.cut {
                self.deny(format!(
                    "{}:{} cut: the run's egress byte budget is spent (--egress-max-mb)",
                    r.host, r.port
                ));
            }
        } else {
            self.deny(r.rule.clone());
        }
    }

    pub(super) fn deny(&mut self, why: String) {
        self.denied_total += 1;
        self.denied.push(why);
        if self.denied.len() > MAX_DENIED {
            self.denied.remove(0);
        }
    }

    /// What `self` has beyond an earlier snapshot.
    pub fn since(&self, before: &Totals) -> Totals {
        Totals {
            hosts: self
                .counts
                .iter()
                .filter(|(h, n)| before.counts.get(*h).is_none_or(|b| b < *n))
                .map(|(h, _)| h.clone())
                .collect(),
            counts: Default::default(),
            connections: self.connections - before.connections.min(self.connections),
            bytes_out: self.bytes_out.saturating_sub(before.bytes_out),
            bytes_in: self.bytes_in.saturating_sub(before.bytes_in),
            denied: {
                let new = usize::try_from(self.denied_total.saturating_sub(before.denied_total)).unwrap_or(usize::MAX);
                self.denied[self.denied.len().saturating_sub(new)..].to_vec()
            },
            // The run's own refusals, all of them (the list keeps the last few).
            denied_total: self.denied_total.saturating_sub(before.denied_total),
            log: Default::default(),
        }
    }
}
