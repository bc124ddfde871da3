//! A session's egress goes with the session: its policy out of the proxy, its network removed.
//!
//! Sessions are known here by (caller, name), and a close frees the name before it is done (the
//! container goes first, then the egress): a new session of that name may attach meanwhile.
//! So a session's entry is taken by its own network, never by its name alone, and one a newer
//! session displaced waits under its network for its own detach.

use super::proxy::Command;
use super::{Manager, SessionNet};

impl Manager {
    /// Keeps `net` as the egress of session `key`; one the name held is set aside for its
    /// own detach (a close still under way).
    pub(super) fn keep_session(&self, key: (String, String), net: SessionNet) {
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = sessions.insert(key.clone(), net) {
            // Under the sessions' lock, as every reader of both takes them (bind.rs).
            self.displaced.lock().unwrap_or_else(|e| e.into_inner()).insert(old.network.clone(), (key, old));
        }
    }

    /// After an installer's container is gone: whatever egress its key holds goes (installer
    /// keys are never reused while one is in use).
    pub(super) async fn detach(&self, principal: &str, session: &str) {
        self.take_off(principal, session, None).await;
    }

    /// After the session's container is gone: the egress on `network` (the session's own,
    /// its attachment's) goes, and nothing of a newer session of the same name.
    pub async fn detach_network(&self, principal: &str, session: &str, network: &str) {
        self.take_off(principal, session, Some(network)).await;
    }

    /// The egress of `key` on `network` (`None`: whatever the key holds), taken off.
    async fn take_off(&self, principal: &str, session: &str, network: Option<&str>) {
        let key = (principal.to_owned(), session.to_owned());
        let ours = |n: &str| network.is_none_or(|w| w == n);
        let lost = {
            let mut lost = self.lost.lock().unwrap_or_else(|e| e.into_inner());
            match lost.get(&key) {
                Some((n, _)) if ours(n) => lost.remove(&key),
                _ => None,
            }
        };
        if let Some((network, _)) = lost {
            self.remove_network(&network, None).await;
        }
        let net = {
            let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            match sessions.get(&key) {
                Some(n) if ours(&n.network) => sessions.remove(&key),
                _ => network
                    .and_then(|n| self.displaced.lock().unwrap_or_else(|e| e.into_inner()).remove(n))
                    .map(|d| d.1),
            }
        };
        let Some(net) = net else { return };
        let mut slot = self.proxy.lock().await;
        let id = match slot.as_mut() {
            Some(p) => {
                // Unspecified: never bound, or unbound already (`unbind`).
                if !net.local.is_unspecified() {
                    let _ = self.send(p, &Command::Drop { local: net.local }).await;
                }
                Some(p.id.clone())
            }
            None => None,
        };
        self.remove_network(&net.network, id.as_deref()).await;
        let gone = self.totals.lock().unwrap_or_else(|e| e.into_inner()).remove(&net.local);
        if let Some(t) = gone {
            t.log.flush(principal, session);
        }
    }

    /// The network the egress of session `key` is on now, if any.
    #[cfg(test)]
    fn network_of(&self, principal: &str, session: &str) -> Option<String> {
        let s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        s.get(&(principal.to_owned(), session.to_owned())).map(|n| n.network.clone())
    }
}

/// An entry whose address is unspecified: no proxy policy to drop, only its network.
#[cfg(test)]
fn entry(network: &str) -> SessionNet {
    SessionNet {
        network: network.to_owned(),
        local: std::net::IpAddr::from([0, 0, 0, 0]),
        rules: Vec::new(),
        headers: Default::default(),
        shared: std::sync::Arc::default(),
        pass: None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bollard::models::NetworkCreateRequest;

    use super::*;
    use crate::docker::Engine;
    use crate::docker::container::Owner;
    use crate::docker::fake::FakeEngine;

    /// A close that ends after a new session of the same name attached takes its own egress
    /// (by its network), and leaves the new session's whole.
    #[tokio::test]
    async fn a_late_detach_takes_its_own_network_not_the_new_session_s_of_the_same_name() {
        let fake = FakeEngine::default();
        for n in ["net-old", "net-new"] {
            let req = NetworkCreateRequest { name: n.into(), ..Default::default() };
            fake.create_network(req).await.expect("a network");
        }
        let owner = Owner { instance: "i".into(), host: "h".into() };
        let cfg = Arc::new(crate::config::from_flags(&[]));
        let engine: crate::docker::EngineRef = Arc::new(fake.clone());
        let m = Manager::new(engine, owner, cfg, None);
        let key = || ("alice".to_owned(), "x".to_owned());
        m.keep_session(key(), entry("net-old"));
        // The old session is being closed; a new one of its name attaches meanwhile.
        m.keep_session(key(), entry("net-new"));
        m.detach_network("alice", "x", "net-old").await;
        assert_eq!(m.network_of("alice", "x").as_deref(), Some("net-new"), "the new session keeps its egress");
        let left: Vec<String> = fake.world().networks.keys().cloned().collect();
        assert_eq!(left, ["net-new"], "the old session's network went, the new one's stayed");
        m.detach_network("alice", "x", "net-new").await;
        assert_eq!(m.network_of("alice", "x"), None);
        assert!(fake.world().networks.is_empty(), "{:?}", fake.world().networks.keys());
    }
}
