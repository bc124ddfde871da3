//! Sending commands to the proxy, and the late binding of sessions told apart by their own
//! address (Kubernetes): their policy goes in once their pod has one, before any code runs.

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
        let (old, allow, headers) = {
            let s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            let n = s.get(&key).ok_or("the session's egress is gone")?;
            (n.local, n.rules.iter().map(|r| r.text().to_owned()).collect::<Vec<_>>(), n.headers.clone())
        };
        let mut slot = self.proxy.lock().await;
        let proxy = slot.as_mut().ok_or("the egress proxy is not running")?;
        if !old.is_unspecified() && old != ip {
            send(proxy, &Command::Drop { local: old }).await?;
            self.totals.lock().unwrap_or_else(|e| e.into_inner()).remove(&old);
        }
        let set = Command::Set {
            local: ip,
            session: self.session.clone(),
            principal: self.principal.clone(),
            allow,
            headers,
        };
        send(proxy, &set).await?;
        drop(slot);
        if let Some(n) = self.sessions.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&key) {
            n.local = ip;
        }
        self.totals.lock().unwrap_or_else(|e| e.into_inner()).entry(ip).or_default();
        Ok(())
    }
}
