//! The proxy container: started, booted with this server's policies, revived when it dies, and
//! taken over from a stopped server with the sessions it served.

use super::attachment::tar_one;
use super::*;

impl Manager {
    /// Sends a command and waits until the proxy has it in force: a narrowed list holds for
    /// the very next connection.
    pub(super) async fn send(&self, proxy: &mut Proxy, c: &Command) -> Result<(), String> {
        super::bind::send(proxy, c).await
    }

    /// The proxy, started (or started again, if it is gone) from `image`.
    pub(super) async fn ensure_proxy<'a>(
        &self,
        slot: &'a mut Option<Proxy>,
        image: &str,
    ) -> Result<&'a mut Proxy, String> {
        let alive = match slot.as_ref() {
            Some(p) => !p.reader.is_finished() && container::is_running(&self.docker, &p.id).await.unwrap_or(false),
            None => false,
        };
        if !alive {
            if let Some(old) = slot.take() {
                old.reader.abort();
                container::remove_container(&self.docker, &old.id).await;
            }
            *self.image.lock().unwrap_or_else(|e| e.into_inner()) = Some(image.to_owned());
            let mut proxy = self.start_proxy(image).await?;
            self.readopt(&mut proxy).await;
            *slot = Some(proxy);
        }
        slot.as_mut().ok_or_else(|| "the egress proxy is not running".to_owned())
    }

    /// Before a run: the proxy started again if it is gone (killed, out of memory), with the
    /// open sessions on it as before.
    pub(super) async fn revive(&self, slot: &mut Option<Proxy>) {
        if slot.as_ref().is_some_and(|p| !p.reader.is_finished()) {
            return;
        }
        let image = self.image.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(image) = image
            && let Err(e) = self.ensure_proxy(slot, &image).await
        {
            tracing::warn!(target: "pyberth::egress", error = %e, "cannot start the egress proxy again");
        }
    }

    /// A new proxy joins the networks of the open sessions, whose variables name the old
    /// one's address there. The engine gives the lowest free address, which is the old
    /// proxy's (it is gone, and a session's network holds only the two): their policies go
    /// in again under it. Should the address differ, that session's requests are refused
    /// at once (nothing listens at the old address) and the server log says why.
    pub(super) async fn readopt(&self, proxy: &mut Proxy) {
        if self.by_peer {
            self.rebind(proxy).await;
            return;
        }
        #[allow(clippy::type_complexity)]
        let nets: Vec<((String, String), String, IpAddr, Vec<String>, Headers)> = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, n)| {
                (
                    k.clone(),
                    n.network.clone(),
                    n.local,
                    n.rules.iter().map(|r| r.text().to_owned()).collect(),
                    n.headers.clone(),
                )
            })
            .collect();
        for ((principal, session), network, old, allow, headers) in nets {
            let req = NetworkConnectRequest { container: proxy.id.clone(), endpoint_config: None };
            let joined = match self.docker.connect_network(&network, req).await {
                Ok(()) => self.proxy_ip_on(&proxy.id, &network).await,
                Err(e) => Err(e.to_string()),
            };
            match joined {
                Ok(ip) if ip == old => {
                    let set = Command::set(ip, &principal, &session, allow, headers);
                    let bytes = self.budget_left(ip);
                    let ok =
                        self.send(proxy, &set).await.and(self.send(proxy, &Command::Budget { local: ip, bytes }).await);
                    if let Err(e) = ok {
                        tracing::warn!(target: "pyberth::egress", session, error = %e, "session not back on the proxy");
                    }
                }
                Ok(ip) => tracing::warn!(
                    target: "pyberth::egress",
                    session,
                    %old,
                    new = %ip,
                    "the new egress proxy got another address on this session's network: its requests are refused"
                ),
                Err(e) => {
                    tracing::warn!(target: "pyberth::egress", session, error = %e, "session not back on the proxy")
                }
            }
        }
    }

    /// Keyed by peer (Kubernetes), a new proxy pod is reached at the same address, its
    /// Service's, which the sessions' variables name: the bound sessions' policies (their pod
    /// addresses and passes) go into it as they were.
    async fn rebind(&self, proxy: &mut Proxy) {
        #[allow(clippy::type_complexity)]
        let bound: Vec<((String, String), IpAddr, Vec<String>, Headers, Option<Arc<str>>)> = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(_, n)| !n.local.is_unspecified())
            .map(|(k, n)| {
                let allow = n.rules.iter().map(|r| r.text().to_owned()).collect();
                (k.clone(), n.local, allow, n.headers.clone(), n.pass.clone())
            })
            .collect();
        for ((principal, session), local, allow, headers, pass) in bound {
            let set = Command::set(local, &principal, &session, allow, headers).with_pass(pass.as_deref());
            let sent = match self.send(proxy, &set).await {
                Ok(()) => self.send(proxy, &Command::Budget { local, bytes: self.budget_left(local) }).await,
                Err(e) => Err(e),
            };
            match sent {
                Ok(()) => tracing::info!(target: "pyberth::egress", session, "session back on the new egress proxy"),
                Err(e) => {
                    tracing::warn!(target: "pyberth::egress", session, error = %e, "session not back on the proxy")
                }
            }
        }
    }

    pub(super) async fn proxy_ip_on(&self, id: &str, network: &str) -> Result<IpAddr, String> {
        let c = self.docker.inspect_container(id, None).await.map_err(|e| e.to_string())?;
        c.network_settings
            .and_then(|s| s.networks)
            .and_then(|mut n| n.remove(network))
            .and_then(|e| e.ip_address)
            .and_then(|ip| ip.parse::<IpAddr>().ok())
            .ok_or_else(|| "the proxy got no address on the session's network".to_owned())
    }

    pub(super) async fn start_proxy(&self, image: &str) -> Result<Proxy, String> {
        let exe = match &self.exe {
            Some(exe) => exe.clone(),
            None => {
                std::env::current_exe().map_err(|e| format!("cannot find this executable for the egress proxy: {e}"))?
            }
        };
        let bytes = tokio::fs::read(&exe)
            .await
            .map_err(|e| format!("cannot read {} for the egress proxy: {e}", exe.display()))?;
        let name = format!("pyberth-{}-egress-{}", self.owner.instance, next_serial());
        // The outbound side: the default bridge. Its own hardening: no capabilities, no new
        // privileges, an unprivileged uid, bounded memory and processes (its binary is copied
        // in after create, so its root stays writable).
        let hc = HostConfig {
            init: Some(true),
            log_config: crate::docker::container::no_log(),
            // The operator's resolvers (--egress-dns), else the engine's: the proxy is the one
            // place names resolve; every answer is still checked (proxy/conn.rs, resolve).
            dns: (!self.cfg.egress_dns.is_empty()).then(|| self.cfg.egress_dns.clone()),
            // It exits when its stdin closes (this server went): then the engine removes it,
            // and nothing of a dead server stays on `docker ps -a` (issue 26).
            auto_remove: Some(true),
            ..crate::docker::container::hardened(crate::docker::container::Fence {
                memory: 256 << 20,
                pids: 256,
                seccomp: self.seccomp.as_deref(),
                runtime: None,
                network: "bridge",
                read_only: false,
            })
        };
        let body = ContainerCreateBody {
            image: Some(image.into()),
            cmd: Some(vec![PROXY_EXE.into(), "egress-proxy".into()]),
            user: Some("65534:65534".into()),
            hostname: Some("pyberth-egress".into()),
            env: Some(vec!["PATH=/usr/local/bin:/usr/bin:/bin".into()]),
            labels: Some(self.labels("proxy")),
            open_stdin: Some(true),
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            stdin_once: Some(false),
            tty: Some(false),
            host_config: Some(hc),
            ..Default::default()
        };
        let opts = CreateContainerOptionsBuilder::default().name(&name).build();
        let id = self
            .docker
            .create_container(Some(opts), body)
            .await
            .map_err(|e| format!("cannot create the egress proxy: {e}"))?
            .id;
        match self.boot(&id, bytes).await {
            Ok(p) => Ok(p),
            Err(e) => {
                container::remove_container(&self.docker, &id).await;
                Err(e)
            }
        }
    }

    pub(super) async fn boot(&self, id: &str, exe: Vec<u8>) -> Result<Proxy, String> {
        let (dir, file) = PROXY_EXE.rsplit_once('/').unwrap_or(("/usr/local/bin", "pyberth-egress"));
        let opts = UploadToContainerOptionsBuilder::default().path(dir).build();
        self.docker
            .upload_to_container(id, Some(opts), crate::docker::body_full(tar_one(file, &exe, 0o555).into()))
            .await
            .map_err(|e| format!("cannot put the egress proxy into its container: {e}"))?;
        let attach =
            AttachContainerOptionsBuilder::default().stream(true).stdin(true).stdout(true).stderr(true).build();
        let attached = self
            .docker
            .attach_container(id, Some(attach))
            .await
            .map_err(|e| format!("cannot attach to the egress proxy: {e}"))?;
        self.docker.start_container(id, None).await.map_err(|e| format!("cannot start the egress proxy: {e}"))?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<bool, String>>();
        let totals = self.totals.clone();
        let (applied_tx, applied) = tokio::sync::watch::channel(0u64);
        let reader = tokio::spawn(read_reports(attached.output, (totals, self.metrics.clone()), ready_tx, applied_tx));
        let ready = tokio::time::timeout(Duration::from_secs(30), ready_rx).await;
        let fail = |why: String| {
            reader.abort();
            Err(why)
        };
        let stderr = match ready {
            // Keyed by peer, a proxy that does not check passes tells sessions apart by their
            // address alone, which a pod given a gone pod's address shares.
            Ok(Ok(Ok(false))) if self.by_peer => {
                return fail(
                    "the egress proxy's image (k8s_egress_image) is older than this server: it does not check \
                     session passes; run this server's own image"
                        .into(),
                );
            }
            Ok(Ok(Ok(_))) => None,
            Ok(Ok(Err(s))) => Some(s),
            Ok(Err(_)) => Some(String::new()),
            Err(_) => return fail("the egress proxy did not start within 30 s".into()),
        };
        if let Some(stderr) = stderr {
            return fail(self.start_failure(id, &stderr).await);
        }
        let mut proxy = Proxy { id: id.to_owned(), input: attached.input, reader, applied };
        let config = self.config_for(id).await;
        self.send(&mut proxy, &config).await?;
        tracing::info!(target: "pyberth::egress", container = %container::short(id), "egress proxy started");
        Ok(proxy)
    }

    /// Takes over the egress of an adopted session (the old server's proxy removed first):
    /// this proxy joins the session's network, which keeps its old labels (the engine cannot
    /// relabel) and is removed when the session ends; it must get the old proxy's address,
    /// which the session's variables name; the list in force goes back in, never wider than
    /// `bound` (the environment's list now), with the headers of this server's config; and
    /// the session's CA bundle is written again, this server's CA being new. On failure the
    /// session has no way out at all, and each of its runs says why.
    #[allow(clippy::too_many_arguments)]
    pub async fn adopt(
        &self,
        principal: &str,
        session: &str,
        image: &str,
        container: &str,
        att: &Attachment,
        bound: &[Rule],
        headers: Headers,
    ) -> Result<(), String> {
        let key = (principal.to_owned(), session.to_owned());
        let result = self.take_over(principal, session, image, container, att, bound, headers).await;
        if let Err(e) = &result {
            tracing::warn!(target: "pyberth::egress", session, error = %e, "egress of an adopted session not taken over");
            let why = format!(
                "this session's network access was lost when the server restarted ({e}): it can reach nothing now; \
                 close it and open a new session to have egress again"
            );
            self.lost.lock().unwrap_or_else(|e| e.into_inner()).insert(key, (att.network.clone(), why));
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn take_over(
        &self,
        principal: &str,
        session: &str,
        image: &str,
        container: &str,
        att: &Attachment,
        bound: &[Rule],
        headers: Headers,
    ) -> Result<(), String> {
        if self.by_peer {
            return Err("an adopted session's egress is not taken over on Kubernetes yet".into());
        }
        let allow = att.allow();
        // Never wider than the environment allows now (its config may have been narrowed).
        let rules = policy::narrow(bound, &allow)?;
        let mut slot = self.proxy.lock().await;
        let proxy = self.ensure_proxy(&mut slot, image).await?;
        let network = att.network.clone();
        let req = NetworkConnectRequest { container: proxy.id.clone(), endpoint_config: None };
        self.docker
            .connect_network(&network, req)
            .await
            .map_err(|e| format!("the proxy cannot join the session's network: {e}"))?;
        let joined = match self.proxy_ip_on(&proxy.id, &network).await {
            Ok(ip) if ip == att.proxy_ip => Ok(ip),
            Ok(ip) => {
                Err(format!("the new proxy got {ip} on its network, not {} which the session uses", att.proxy_ip))
            }
            Err(e) => Err(e),
        };
        let set = match joined {
            Ok(local) => {
                let set = Command::set(local, principal, session, allow, headers.clone());
                self.send(proxy, &set).await.map(|()| local)
            }
            Err(e) => Err(e),
        };
        let local = match set {
            Ok(local) => local,
            Err(e) => {
                // Off the network again: the session reaches nothing rather than a proxy
                // that has no policy for it.
                let req = NetworkDisconnectRequest { container: proxy.id.clone(), force: Some(true) };
                let _ = self.docker.disconnect_network(&network, req).await;
                return Err(e);
            }
        };
        drop(slot);
        self.totals.lock().unwrap_or_else(|e| e.into_inner()).insert(local, Totals::default());
        self.keep_session(
            (principal.to_owned(), session.to_owned()),
            SessionNet { network, local, rules, headers, shared: att.rules.clone(), pass: None },
        );
        // This server's CA is new: without it the session would refuse every intercepted host.
        if let Err(e) = att.after_start(&self.docker, container).await {
            tracing::warn!(target: "pyberth::egress", session, error = %e, "cannot write the new CA bundle into an adopted session");
        }
        Ok(())
    }

    /// Why the proxy did not start, in the operator's terms, from its stderr and its state.
    async fn start_failure(&self, id: &str, stderr: &str) -> String {
        let hint = if stderr.contains("GLIBC") {
            " (the sandbox image's C library is older than the one this server was built against: build the \
             server on the image's Debian release or older, or statically)"
        } else {
            ""
        };
        let state = match self.docker.inspect_container(id, None).await {
            Ok(c) => c.state.map(|s| format!(" (exit code {:?}, {})", s.exit_code, s.error.unwrap_or_default())),
            Err(e) => Some(format!(" ({e})")),
        };
        format!("the egress proxy did not start{hint}: {}{}", stderr.trim(), state.unwrap_or_default())
    }

    /// The proxy's configuration: pins, its own addresses (refused), limits, the CA key.
    async fn config_for(&self, id: &str) -> Command {
        // The host's bridge gateway and the proxy's own bridge address: refused even if a
        // name resolves to them (all private today; the check does not rely on that).
        let mut own = Vec::new();
        if let Ok(c) = self.docker.inspect_container(id, None).await {
            for n in c.network_settings.and_then(|s| s.networks).unwrap_or_default().into_values() {
                own.extend(n.gateway.and_then(|g| g.parse::<IpAddr>().ok()));
                own.extend(n.ip_address.and_then(|g| g.parse::<IpAddr>().ok()));
            }
        }
        let pinned = self
            .cfg
            .egress_pin
            .iter()
            .filter_map(|(k, v)| Some((policy::normalize_host(k)?, v.parse().ok()?)))
            .collect();
        Command::Config {
            pinned,
            own,
            max_conns: self.cfg.egress_max_conns,
            ca_key: self.ca_key.clone(),
            roots: self.roots.as_ref().map(|r| String::from_utf8_lossy(r).into_owned()),
            by_peer: self.by_peer,
        }
    }
}

/// Reads the proxy's reports (ready, connection records, applied policies) and its stderr until
/// it stops; says once whether it became ready.
async fn read_reports(
    mut output: std::pin::Pin<Box<dyn futures::Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>>,
    (totals, metrics): (Arc<Mutex<HashMap<IpAddr, Totals>>>, Arc<crate::metrics::Metrics>),
    ready_tx: tokio::sync::oneshot::Sender<Result<bool, String>>,
    applied_tx: tokio::sync::watch::Sender<u64>,
) {
    let mut ready = Some(ready_tx);
    let (mut out, mut err) = (Vec::new(), String::new());
    while let Some(frame) = output.next().await {
        match frame {
            Ok(LogOutput::StdOut { message }) => {
                out.extend_from_slice(&message);
                while let Some(i) = out.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = out.drain(..=i).collect();
                    match serde_json::from_slice::<Report>(&line) {
                        Ok(Report::Ready { passes }) => {
                            if let Some(r) = ready.take() {
                                let _ = r.send(Ok(passes));
                            }
                        }
                        Ok(Report::Conn(r)) => {
                            metrics.egress(r.allowed, r.cut, r.up, r.down);
                            account::account(&totals, &r);
                        }
                        Ok(Report::Applied { seq }) => {
                            applied_tx.send_if_modified(|a| {
                                let newer = seq > *a;
                                *a = (*a).max(seq);
                                newer
                            });
                        }
                        Err(e) => {
                            tracing::warn!(target: "pyberth::egress", error = %e, "unreadable proxy report")
                        }
                    }
                }
                if out.len() > 1 << 20 {
                    out.clear();
                }
            }
            Ok(LogOutput::StdErr { message }) => {
                let text = String::from_utf8_lossy(&message).into_owned();
                tracing::warn!(target: "pyberth::egress", stderr = ?text.trim_end(), "egress proxy");
                if err.len() < 4096 {
                    err.push_str(&text);
                }
            }
            Ok(_) => {}
            Err(_) => break,
        }
    }
    if let Some(r) = ready.take() {
        let _ = r.send(Err(err));
    } else {
        tracing::warn!(target: "pyberth::egress", "the egress proxy stopped; it is started again when a session needs it");
    }
}
