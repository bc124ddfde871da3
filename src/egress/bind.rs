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
    pub(super) totals: Arc<Mutex<HashMap<IpAddr, Totals>>>,
    pub(super) principal: String,
    pub(super) session: String,
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
            let s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            let n = s.get(&key).ok_or("the session's egress is gone")?;
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
            let stale = s
                .iter_mut()
                .filter(|(k, n)| **k != key && n.local == ip)
                .map(|(k, n)| {
                    n.local = IpAddr::from([0, 0, 0, 0]);
                    k.clone()
                })
                .collect();
            if let Some(n) = s.get_mut(&key) {
                n.local = ip;
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
        unbind(&self.proxy, &self.sessions, &self.totals, &self.principal, &self.session).await;
    }
}

impl Manager {
    /// Before a session's container is removed (or once it is found gone): on Kubernetes its
    /// policy out of the proxy, keyed by an address the next pod may get ([`unbind`]).
    /// Docker's sessions keep theirs: their network holds only them and the proxy.
    pub async fn unbind(&self, principal: &str, session: &str) {
        if self.by_peer {
            unbind(&self.proxy, &self.sessions, &self.totals, principal, session).await;
        }
    }
}

/// Takes a session keyed by its own address out of the proxy before its pod (and so that
/// address) goes: the cluster may give the address to any next pod, which must not be served
/// with this session's list and headers. Its totals so far are flushed, as at its end; the
/// next start binds it again. Nothing to do when it is not bound.
pub(super) async fn unbind(
    proxy: &tokio::sync::Mutex<Option<Proxy>>,
    sessions: &Mutex<HashMap<(String, String), SessionNet>>,
    totals: &Mutex<HashMap<IpAddr, Totals>>,
    principal: &str,
    session: &str,
) {
    // The proxy's lock first, as `bind` holds it from its Set until it records the address:
    // a binding under way is either wholly before this or after.
    let mut slot = proxy.lock().await;
    let key = (principal.to_owned(), session.to_owned());
    let old = {
        let mut s = sessions.lock().unwrap_or_else(|e| e.into_inner());
        let Some(n) = s.get_mut(&key) else { return };
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

    /// The address a session was bound at is forgotten, with its totals; a second unbind (the
    /// close of a session unbound at its hibernation) finds nothing to do.
    #[tokio::test]
    async fn unbinding_forgets_the_address_and_its_totals() {
        let ip: IpAddr = [10, 1, 2, 3].into();
        let proxy = tokio::sync::Mutex::new(None);
        let net = SessionNet {
            network: "n".into(),
            local: ip,
            rules: Vec::new(),
            headers: Headers::default(),
            shared: Arc::default(),
            pass: None,
        };
        let key = ("p".to_owned(), "s".to_owned());
        let sessions = Mutex::new(HashMap::from([(key.clone(), net)]));
        let totals = Mutex::new(HashMap::from([(ip, Totals::default())]));
        for _ in 0..2 {
            unbind(&proxy, &sessions, &totals, "p", "s").await;
            let local = sessions.lock().map(|s| s[&key].local).ok();
            assert_eq!(local, Some(IpAddr::from([0, 0, 0, 0])), "no address keyed any more");
            assert!(totals.lock().map(|t| t.is_empty()).unwrap_or(false), "its totals flushed");
        }
        unbind(&proxy, &sessions, &totals, "p", "other").await;
        assert_eq!(sessions.lock().map(|s| s.len()).ok(), Some(1), "another session: nothing");
    }
}
