//! The installer's network: only the index hosts, through the proxy; kept for the next install
//! within a bound, never shared by two installs at once, never kept after package code ran.

use super::*;

/// The package installer's way out: its own network with the proxy, allowing only the index
/// hosts (`Manager::attach_installer`).
pub struct InstallerNet {
    /// The network to create the installer container on (`HostConfig.network_mode`).
    pub network: String,
    /// Variables to add to its environment: the proxy, and nothing else.
    pub env: Vec<String>,
    /// Its DNS servers (`HostConfig.dns`): an address where nothing answers.
    pub dns: Vec<String>,
    /// The hosts it may reach.
    pub allow: Vec<String>,
    pub(super) key: String,
    /// Keyed by its own address (Kubernetes): its policy goes in once its pod has one.
    pub(super) binder: Option<Arc<Binder>>,
}

/// Without its variables (the proxy URL carries its pass).
impl std::fmt::Debug for InstallerNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstallerNet")
            .field("network", &self.network)
            .field("allow", &self.allow)
            .finish_non_exhaustive()
    }
}

impl InstallerNet {
    /// Once the installer's container (a pod) has its address and before its command runs:
    /// the installer's policy in force for that address. Nothing to do on Docker.
    pub async fn bind(&self, docker: &dyn crate::docker::Engine, id: &str) -> Result<(), String> {
        match &self.binder {
            Some(b) => b.bind(docker, id).await,
            None => Ok(()),
        }
    }

    /// Before the installer's pod goes: its policy out of the proxy, as a session's
    /// (`Manager::unbind`: the cluster may give the address to the next pod).
    pub async fn unbind(&self) {
        if let Some(b) = &self.binder {
            b.unbind().await;
        }
    }

    /// Puts an installer container on its network: call on the body before creating it.
    pub fn apply(&self, body: &mut ContainerCreateBody) {
        body.network_disabled = Some(false);
        body.env.get_or_insert_with(Vec::new).extend(self.env.iter().cloned());
        let hc = body.host_config.get_or_insert_with(HostConfig::default);
        hc.network_mode = Some(self.network.clone());
        hc.dns = Some(self.dns.clone());
        hc.dns_search = Some(Vec::new());
    }
}

impl Manager {
    /// A network for one package install whose only way out is the proxy, allowing only the
    /// index hosts: the installer gets no route to the host or to private ranges, and
    /// resolves no name itself. `label` names the install (unique per install under way);
    /// `image` is used if the proxy must be started. Call [`Self::detach_installer`] once the
    /// installer container is removed.
    pub async fn attach_installer(
        &self,
        label: &str,
        image: &str,
        index: &impl IndexHosts,
    ) -> Result<InstallerNet, String> {
        let allow = index.index_hosts();
        if let Some(net) = self.reuse_installer(&allow).await {
            return Ok(net);
        }
        let rules = policy::parse_list(&allow)?;
        let key = format!("install-{label}-{}", next_serial());
        let att = self.attach(INSTALLER, &key, image, rules, Headers::new()).await?;
        Ok(InstallerNet {
            network: att.network.clone(),
            env: att.proxy_env(),
            dns: vec![att.proxy_ip.to_string()],
            allow,
            key,
            binder: att.binder.clone(),
        })
    }

    /// An idle installer network for `allow`, if one leads to the running proxy: networks
    /// idle past [`INSTALLER_IDLE`], or whose proxy is gone, are removed on the way.
    pub(super) async fn reuse_installer(&self, allow: &[String]) -> Option<InstallerNet> {
        let proxy = {
            let slot = self.proxy.lock().await;
            slot.as_ref().filter(|p| !p.reader.is_finished()).map(|p| p.id.clone())
        };
        let (mut stale, mut found) = (Vec::new(), None);
        {
            let mut idle = self.idle_installers.lock().unwrap_or_else(|e| e.into_inner());
            for (net, via, since) in idle.drain(..) {
                if since.elapsed() > INSTALLER_IDLE || Some(&via) != proxy.as_ref() {
                    stale.push(net);
                } else if found.is_none() && net.allow == allow {
                    found = Some(net);
                } else {
                    stale.push(net);
                }
            }
        }
        for net in stale {
            self.detach(INSTALLER, &net.key).await;
        }
        let net = found?;
        // A fresh account: what the proxy refuses from now on is this install's.
        let key = (INSTALLER.to_owned(), net.key.clone());
        let local = self.sessions.lock().unwrap_or_else(|e| e.into_inner()).get(&key).map(|n| n.local)?;
        // Keyed by peer it is unbound (its pod is gone): its next binding makes its account.
        if local.is_unspecified() {
            return Some(net);
        }
        let old = self.totals.lock().unwrap_or_else(|e| e.into_inner()).insert(local, Totals::default());
        if let Some(old) = old {
            old.log.flush(INSTALLER, &net.key);
        }
        Some(net)
    }

    /// What the proxy refused or could not reach for the install on `net`, in its words.
    pub async fn installer_refused(&self, net: &InstallerNet) -> Vec<String> {
        self.totals(INSTALLER, &net.key).await.map(|t| t.denied).unwrap_or_default()
    }

    /// After the installer container is gone: its network removed.
    pub async fn detach_installer(&self, net: InstallerNet) {
        self.detach(INSTALLER, &net.key).await;
    }

    /// After the installer container is gone: its network kept for the next install (never
    /// shared with another install under way: one takes it at a time), else removed. Kept at
    /// most [`MAX_IDLE_INSTALLERS`], each until an install finds it idle past
    /// [`INSTALLER_IDLE`] or the proxy gone, or until [`Self::shutdown`].
    pub async fn release_installer(&self, net: InstallerNet) {
        let proxy = {
            let slot = self.proxy.lock().await;
            slot.as_ref().filter(|p| !p.reader.is_finished()).map(|p| p.id.clone())
        };
        if let Some(proxy) = proxy {
            let mut idle = self.idle_installers.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < MAX_IDLE_INSTALLERS {
                idle.push((net, proxy, std::time::Instant::now()));
                return;
            }
        }
        self.detach(INSTALLER, &net.key).await;
    }

    /// Removes the installer networks kept for a next install (a server leaving its sessions
    /// running for the next one keeps the proxy and their networks, not these).
    pub async fn drop_idle_installers(&self) {
        let idle: Vec<_> = self.idle_installers.lock().unwrap_or_else(|e| e.into_inner()).drain(..).collect();
        for (net, _, _) in idle {
            self.detach(INSTALLER, &net.key).await;
        }
    }
}
