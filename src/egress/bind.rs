//! Sending commands to the proxy, and the late binding of sessions told apart by their own
//! address (Kubernetes): their policy goes in once their pod has one, before any code runs,
//! and out before that pod goes, since the cluster may give its address to the next pod.

use super::*;

/// Sends a command and waits until the proxy has it in force: a narrowed list holds for the
/// very next connection.
pub(super) async fn send(proxy: &mut Proxy, c: &Command) -> Result<(), String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(1);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let mut lines = serde_json::to_vec(c).map_err(|e| e.to_string())?;
    lines.push(b'\n');
    lines.extend(serde_json::to_vec(&Command::Sync { seq }).map_err(|e| e.to_string())?);
    lines.push(b'\n');
    let gone = |e: std::io::Error| format!("the egress proxy is not listening: {e}");
    proxy.input.write_all(&lines).await.map_err(gone)?;
    proxy.input.flush().await.map_err(gone)?;
    let applied = proxy.applied.wait_for(|a| *a >= seq);
    match tokio::time::timeout(Duration::from_secs(10), applied).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(_)) => Err("the egress proxy stopped".into()),
        Err(_) => Err("the egress proxy did not confirm a policy change within 10 s".into()),
    }
}

/// What a session keyed by its own address needs to put its policy into the proxy once its
/// container (a pod) has that address: [`Attachment::after_start`] calls [`Binder::bind`].
pub struct Binder {
    pub(super) proxy: Arc<tokio::sync::Mutex<Option<Proxy>>>,
    pub(super) sessions: Arc<Mutex<HashMap<(String, String), SessionNet>>>,
    pub(super) displaced: Arc<Mutex<Displaced>>,
    pub(super) totals: Arc<Mutex<HashMap<IpAddr, Totals>>>,
    pub(super) principal: String,
    pub(super) session: String,
    /// The session's own network: its entry is the name's only while it holds the name (a
    /// close under way leaves the name to a newer session, detach.rs).
    pub(super) network: String,
}

impl std::fmt::Debug for Binder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Binder").field("session", &self.session).finish_non_exhaustive()
    }
}

impl Binder {
    /// The session's policy in force for connections from container `id`'s address (a
    /// container made again, on a wake, replaces its old address).
    pub(super) async fn bind(&self, docker: &dyn Engine, id: &str) -> Result<(), String> {
        let c =
            docker.inspect_container(id, None).await.map_err(|e| format!("cannot read the session's address: {e}"))?;
        // A pod has one address, whatever the network is called.
        let ip = c
            .network_settings
            .and_then(|s| s.networks)
            .unwrap_or_default()
            .into_values()
            .find_map(|e| e.ip_address.and_then(|ip| ip.parse::<IpAddr>().ok()))
            .filter(|ip| !ip.is_unspecified())
            .ok_or("the session's pod has no address: the proxy cannot tell its connections apart")?;
        let key = (self.principal.clone(), self.session.clone());
        let (old, allow, headers, pass) = {
            let mut s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            let mut d = self.displaced.lock().unwrap_or_else(|e| e.into_inner());
            let n = entry(&mut s, &mut d, &key, Some(&self.network)).ok_or("the session's egress is gone")?;
            (
                n.local,
                n.rules.iter().map(|r| r.text().to_owned()).collect::<Vec<_>>(),
                n.headers.clone(),
                n.pass.clone(),
            )
        };
        let mut slot = self.proxy.lock().await;
        let proxy = slot.as_mut().ok_or("the egress proxy is not running")?;
        if !old.is_unspecified() && old != ip {
            send(proxy, &Command::Drop { local: old }).await?;
            self.totals.lock().unwrap_or_else(|e| e.into_inner()).remove(&old);
        }
        let set = Command::set(ip, &self.principal, &self.session, allow, headers).with_pass(pass.as_deref());
        // Recorded before it is sent: a Set the proxy took but did not confirm in time is
        // still taken out by the unbinding that precedes the pod's deletion. The address is
        // this session's alone now: another that still held it (its pod gone unseen) lets it
        // go, so its later unbinding cannot drop this one's policy, nor a rebind replay it.
        let stale: Vec<(String, String)> = {
            let mut s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            let mut d = self.displaced.lock().unwrap_or_else(|e| e.into_inner());
            let mut stale = Vec::new();
            let all = s.iter_mut().map(|(k, n)| (k.clone(), n)).chain(d.values_mut().map(|(k, n)| (k.clone(), n)));
            for (k, n) in all {
                if k == key && n.network == self.network {
                    n.local = ip;
                } else if n.local == ip {
                    n.local = IpAddr::from([0, 0, 0, 0]);
                    stale.push(k);
                }
            }
            stale
        };
        if let Some(t) = self.totals.lock().unwrap_or_else(|e| e.into_inner()).remove(&ip) {
            for (principal, session) in &stale {
                t.log.flush(principal, session);
            }
        }
        send(proxy, &set).await?;
        drop(slot);
        self.totals.lock().unwrap_or_else(|e| e.into_inner()).entry(ip).or_default();
        Ok(())
    }

    /// Before the session's pod is deleted: see [`unbind`].
    pub(super) async fn unbind(&self) {
        let entries = Entries { sessions: &self.sessions, displaced: &self.displaced, network: Some(&self.network) };
        unbind(&self.proxy, &entries, &self.totals, &self.principal, &self.session).await;
    }
}

impl Manager {
    /// Before a session's container is removed (or once it is found gone): on Kubernetes its
    /// policy out of the proxy, keyed by an address the next pod may get ([`unbind`]).
    /// Docker's sessions keep theirs: their network holds only them and the proxy.
    pub async fn unbind(&self, principal: &str, session: &str) {
        if self.by_peer {
            // The live session's, by its name (a server leaving: no close under way).
            let entries = Entries { sessions: &self.sessions, displaced: &self.displaced, network: None };
            unbind(&self.proxy, &entries, &self.totals, principal, session).await;
        }
    }
}

/// Where the entries of sessions are, and which one is meant: the one on `network` (`None`:
/// whatever the name holds).
pub(super) struct Entries<'a> {
    sessions: &'a Mutex<HashMap<(String, String), SessionNet>>,
    displaced: &'a Mutex<Displaced>,
    network: Option<&'a str>,
}

/// The entry of session `key` on `network` (`None`: the name's): the name's while it is that
/// session's, else the one a newer session of the name displaced.
fn entry<'a>(
    sessions: &'a mut HashMap<(String, String), SessionNet>,
    displaced: &'a mut Displaced,
    key: &(String, String),
    network: Option<&str>,
) -> Option<&'a mut SessionNet> {
    let own = sessions.get(key).is_some_and(|n| network.is_none_or(|w| w == n.network));
    if own {
        return sessions.get_mut(key);
    }
    let (k, n) = displaced.get_mut(network?)?;
    (k == key).then_some(n)
}

/// Takes a session keyed by its own address out of the proxy before its pod (and so that
/// address) goes: the cluster may give the address to any next pod, which must not be served
/// with this session's list and headers. Its totals so far are flushed, as at its end; the
/// next start binds it again. Nothing to do when it is not bound.
pub(super) async fn unbind(
    proxy: &tokio::sync::Mutex<Option<Proxy>>,
    entries: &Entries<'_>,
    totals: &Mutex<HashMap<IpAddr, Totals>>,
    principal: &str,
    session: &str,
) {
    // The proxy's lock first, as `bind` holds it from its Set until it records the address:
    // a binding under way is either wholly before this or after.
    let mut slot = proxy.lock().await;
    let key = (principal.to_owned(), session.to_owned());
    let old = {
        let mut s = entries.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let mut d = entries.displaced.lock().unwrap_or_else(|e| e.into_inner());
        let Some(n) = entry(&mut s, &mut d, &key, entries.network) else { return };
        std::mem::replace(&mut n.local, IpAddr::from([0, 0, 0, 0]))
    };
    if old.is_unspecified() {
        return;
    }
    // No proxy: nothing holds the policy (a proxy made again starts empty on Kubernetes).
    if let Some(p) = slot.as_mut()
        && let Err(e) = send(p, &Command::Drop { local: old }).await
    {
        tracing::warn!(target: "pyberth::egress", session, error = %e, "cannot take a session's policy out of the proxy");
    }
    drop(slot);
    if let Some(t) = totals.lock().unwrap_or_else(|e| e.into_inner()).remove(&old) {
        t.log.flush(principal, session);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(network: &str, local: IpAddr) -> SessionNet {
        SessionNet {
            network: network.into(),
            local,
            rules: Vec::new(),
            headers: Headers::default(),
            shared: Arc::default(),
            pass: None,
        }
    }

    /// The address a session was bound at is forgotten, with its totals; a second unbind (the
    /// close of a session unbound at its hibernation) finds nothing to do.
    #[tokio::test]
    async fn unbinding_forgets_the_address_and_its_totals() {
        let ip: IpAddr = [10, 1, 2, 3].into();
        let proxy = tokio::sync::Mutex::new(None);
        let key = ("p".to_owned(), "s".to_owned());
        let sessions = Mutex::new(HashMap::from([(key.clone(), net("n", ip))]));
        let displaced = Mutex::default();
        let totals = Mutex::new(HashMap::from([(ip, Totals::default())]));
        let entries = Entries { sessions: &sessions, displaced: &displaced, network: Some("n") };
        for _ in 0..2 {
            unbind(&proxy, &entries, &totals, "p", "s").await;
            let local = sessions.lock().map(|s| s[&key].local).ok();
            assert_eq!(local, Some(IpAddr::from([0, 0, 0, 0])), "no address keyed any more");
            assert!(totals.lock().map(|t| t.is_empty()).unwrap_or(false), "its totals flushed");
        }
        unbind(&proxy, &entries, &totals, "p", "other").await;
        assert_eq!(sessions.lock().map(|s| s.len()).ok(), Some(1), "another session: nothing");
    }

    /// A session being closed after a newer one took its name unbinds its own address (its
    /// entry set aside under its network), and leaves the newer one bound.
    #[tokio::test]
    async fn a_closing_session_unbinds_its_own_address_not_the_newer_one_s_of_its_name() {
        let (old_ip, new_ip): (IpAddr, IpAddr) = ([10, 1, 2, 3].into(), [10, 1, 2, 4].into());
        let proxy = tokio::sync::Mutex::new(None);
        let key = ("p".to_owned(), "s".to_owned());
        let sessions = Mutex::new(HashMap::from([(key.clone(), net("new", new_ip))]));
        let displaced = Mutex::new(HashMap::from([("old".to_owned(), (key.clone(), net("old", old_ip)))]));
        let totals = Mutex::new(HashMap::from([(old_ip, Totals::default()), (new_ip, Totals::default())]));
        let entries = Entries { sessions: &sessions, displaced: &displaced, network: Some("old") };
        unbind(&proxy, &entries, &totals, "p", "s").await;
        assert_eq!(sessions.lock().map(|s| s[&key].local).ok(), Some(new_ip), "the newer session stays bound");
        let old = displaced.lock().map(|d| d["old"].1.local).ok();
        assert_eq!(old, Some(IpAddr::from([0, 0, 0, 0])), "the closing session's address is let go");
        let left: Vec<IpAddr> = totals.lock().map(|t| t.keys().copied().collect()).unwrap_or_default();
        assert_eq!(left, [new_ip], "only the closing session's totals were flushed");
    }
}
