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
    /// Bytes both ways when the session's current run began ([`Manager::budget_left`]).
    #[serde(skip)]
    #[schemars(skip)]
    pub(super) run_start: u64,
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
            run_start: 0,
        }
    }

    /// Bytes both ways since the current run began, as the proxy's records tell.
    fn run_spent(&self) -> u64 {
        (self.bytes_in + self.bytes_out).saturating_sub(self.run_start)
    }
}

impl Manager {
    /// A run begins for the session at `local`: its bytes count from here.
    pub(super) fn run_begins(&self, local: IpAddr) {
        if let Some(t) = self.totals.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&local) {
            t.run_start = t.bytes_in + t.bytes_out;
        }
    }

    /// What is left of the byte budget of the run under way at `local`: what a proxy started
    /// again mid-run gives the session, not a fresh budget (a proxy that dies, or that code
    /// makes die, must not reset a run's budget; connections cut by its death and never
    /// reported are not counted). `None`: no budget (`--egress-max-mb 0`).
    pub(super) fn budget_left(&self, local: IpAddr) -> Option<u64> {
        let max = (self.cfg.egress_max_mb > 0).then(|| self.cfg.egress_max_mb << 20)?;
        let totals = self.totals.lock().unwrap_or_else(|e| e.into_inner());
        Some(max.saturating_sub(totals.get(&local).map_or(0, Totals::run_spent)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::docker::fake::FakeEngine;

    /// A proxy started again while a run is under way is given what is left of the run's
    /// budget (readopt, rebind), never a fresh one.
    #[test]
    fn what_is_left_of_a_run_s_budget_counts_from_the_run_s_start() {
        let owner = Owner { instance: "i".into(), host: "h".into() };
        let cfg = Arc::new(crate::config::from_flags(&["--egress-max-mb", "1"]));
        let engine: crate::docker::EngineRef = Arc::new(FakeEngine::default());
        let m = Manager::new(engine, owner, cfg, None);
        let (local, other): (IpAddr, IpAddr) = ("10.9.0.2".parse().expect("ip"), "10.9.1.2".parse().expect("ip"));
        let spend = |up: u64, down: u64| {
            let mut t = m.totals.lock().unwrap_or_else(|e| e.into_inner());
            let t = t.entry(local).or_default();
            t.bytes_out += up;
            t.bytes_in += down;
        };
        spend(100, 700_000); // an earlier run's
        m.run_begins(local);
        assert_eq!(m.budget_left(local), Some(1 << 20), "a run begins with the whole budget");
        spend(1_000, 300_000);
        assert_eq!(m.budget_left(local), Some((1 << 20) - 301_000), "what this run moved is spent");
        spend(0, 900_000);
        assert_eq!(m.budget_left(local), Some(0), "spent: nothing more");
        assert_eq!(m.budget_left(other), Some(1 << 20), "another session's run is its own");
        let unlimited = Arc::new(crate::config::from_flags(&["--egress-max-mb", "0"]));
        let engine: crate::docker::EngineRef = Arc::new(FakeEngine::default());
        let m = Manager::new(engine, Owner { instance: "i".into(), host: "h".into() }, unlimited, None);
        assert_eq!(m.budget_left(local), None, "no budget");
    }
}
