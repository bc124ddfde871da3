//! Controlled egress (issue 17): a session whose environment has an `egress` allow-list gets
//! an `internal` Docker network of its own that holds only it and a filtering proxy of ours;
//! everything else keeps `NetworkMode none` (docs/design.md, "Egress").
//!
//! The proxy is this very binary (`pyberth egress-proxy`, [`proxy`]) run in one small
//! container per server, made from the sandbox image with the executable uploaded into it:
//! no image build, no registry. The server speaks to it over the container's attached
//! stdin/stdout (policies in, connection records out), so the proxy has no control port.
//! On Kubernetes the proxy is a pod and a session network a record (`k8s/engine/egress.rs`);
//! sessions are then told apart by their own address ([`Binder`]).

mod account;
/// Sandbox text as a log field, cut and escaped (also the bridge's audit lines).
pub(crate) use account::Shown;
mod attachment;
mod bind;
mod detach;
mod installer_net;
pub mod policy;
pub mod proxy;
mod proxy_container;
mod totals;

pub use attachment::Attachment;
pub use bind::Binder;
pub use installer_net::InstallerNet;
pub use totals::Totals;

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::docker::{Engine, EngineRef};
use bollard::container::LogOutput;
use bollard::models::{
    ContainerCreateBody, HostConfig, NetworkConnectRequest, NetworkCreateRequest, NetworkDisconnectRequest,
};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use futures::StreamExt as _;
use tokio::io::{AsyncWrite, AsyncWriteExt as _};

use self::policy::Rule;
use self::proxy::{Command, Record, Report};
use crate::config::SandboxConfig;
use crate::docker::container::{self, Owner};
use crate::docker::{LABEL_INSTANCE, LABEL_MANAGED, LABEL_OWNER, LABEL_SESSION};

/// The principal installs are accounted under in the proxy's records.
const INSTALLER: &str = "pyberth-installer";
/// How long an installer network is kept for the next install once its install is done.
const INSTALLER_IDLE: Duration = Duration::from_secs(120);
/// Installer networks kept idle at most (installs at once beyond this make their own).
const MAX_IDLE_INSTALLERS: usize = 2;
/// Label on the proxy container and the session networks: `proxy` or `network`.
pub const LABEL_EGRESS: &str = "pyberth.egress";
/// Where a session finds the CA bundle the server trusts ([`Attachment::after_start`]).
pub const CA_PATH: &str = "/tmp/.pyberth-egress/ca.pem";
/// Its directory, root's.
const CA_DIR: &str = "/tmp/.pyberth-egress";
/// Where the executable goes in the proxy container.
const PROXY_EXE: &str = "/usr/local/bin/pyberth-egress";

/// What an installer's index is: the hosts its network must reach (the packages owner
/// says; egress only enforces).
pub trait IndexHosts {
    /// `host` or `host:port` allow-list entries.
    fn index_hosts(&self) -> Vec<String>;
}

pub use policy::{Headers, SecretHeaders};

/// One session's egress.
/// Entries a newer session of the same name displaced, by their network: (its key, it).
type Displaced = HashMap<String, ((String, String), SessionNet)>;

struct SessionNet {
    network: String,
    local: IpAddr,
    rules: Vec<Rule>,
    headers: Headers,
    /// The same list as text, shared with the session's [`Attachment`] (its record).
    shared: Arc<Mutex<Vec<String>>>,
    /// Keyed by peer: the secret its connections carry (its proxy URL's credentials).
    pass: Option<Arc<str>>,
}

/// The running proxy.
struct Proxy {
    id: String,
    input: Pin<Box<dyn AsyncWrite + Send>>,
    reader: tokio::task::JoinHandle<()>,
    /// The last sync the proxy answered.
    applied: tokio::sync::watch::Receiver<u64>,
}

/// The egress of a server: its proxy and the networks of its sessions.
pub struct Manager {
    docker: EngineRef,
    owner: Owner,
    cfg: Arc<SandboxConfig>,
    /// The server's CA bundle (`--ca-bundle`): what the proxy trusts for upstreams.
    roots: Option<Arc<Vec<u8>>>,
    /// What sessions trust: the server's bundle and the per-server CA's certificate.
    ca: Option<Arc<Vec<u8>>>,
    /// The per-server CA's key: it goes to the proxy only (stdin), never to a sandbox.
    ca_key: Option<proxy::SecretPem>,
    proxy: Arc<tokio::sync::Mutex<Option<Proxy>>>,
    /// The image the proxy was last started from, to start it again if it goes.
    image: Mutex<Option<String>>,
    sessions: Arc<Mutex<HashMap<(String, String), SessionNet>>>,
    /// Adopted sessions whose egress could not be taken over: their network (removed when
    /// they end) and why, said in each of their runs' notices.
    lost: Mutex<HashMap<(String, String), (String, String)>>,
    /// Sessions whose name a newer session of theirs took before they were detached (a close
    /// still under way): by their network, until their own detach.
    displaced: Arc<Mutex<Displaced>>,
    /// Totals by the proxy's address on a session's network.
    totals: Arc<Mutex<HashMap<IpAddr, Totals>>>,
    /// The executable run as the proxy (`None`: this one).
    exe: Option<std::path::PathBuf>,
    /// The seccomp profile the engine check chose for sandboxes; the proxy gets it too.
    seccomp: Option<Arc<str>>,
    /// Installer networks no install is using, with the proxy they lead to and when they
    /// were freed: the next install takes one instead of making its own.
    idle_installers: Mutex<Vec<(InstallerNet, String, std::time::Instant)>>,
    /// The server's metrics: the proxy's connection records are counted there.
    metrics: Arc<crate::metrics::Metrics>,
    /// Sessions are told apart by their own address (Kubernetes: one proxy pod at one
    /// address for all); `local` of a session is then its pod's address, known once its
    /// pod runs ([`Binder`]), the unspecified address until then.
    by_peer: bool,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("egress::Manager").finish_non_exhaustive()
    }
}

use crate::docker::next_serial;

impl Manager {
    /// The egress of one server; nothing is started until a session asks.
    pub fn new(
        docker: impl crate::docker::IntoEngine,
        owner: Owner,
        cfg: Arc<SandboxConfig>,
        ca: Option<Vec<u8>>,
    ) -> Self {
        let docker = docker.into_engine();
        // A CA of this server's own, made at start and held in memory only: the sessions that
        // trust it are this server's (their networks die with it), so nothing needs to keep it.
        // None at all when no environment has headers: then sandboxes trust nothing new.
        let hosts: BTreeSet<String> = cfg
            .environments
            .values()
            .flat_map(|e| e.egress_headers.iter().flat_map(|h| h.keys()))
            .filter_map(|h| policy::normalize_host(h).or_else(|| h.parse::<IpAddr>().ok().map(|ip| ip.to_string())))
            .collect();
        let made = if hosts.is_empty() { None } else { Some(proxy::new_ca(&hosts.into_iter().collect::<Vec<_>>())) };
        let (ca_cert, ca_key) = match made {
            Some(Ok((c, k))) => (Some(c), Some(k)),
            None => (None, None),
            Some(Err(e)) => {
                tracing::warn!(target: "pyberth::egress", error = %e, "no CA: headers go on plain HTTP only");
                (None, None)
            }
        };
        let trusted = match (&ca, &ca_cert) {
            (None, None) => None,
            (b, c) => {
                let mut all = b.clone().unwrap_or_default();
                if !all.is_empty() && !all.ends_with(b"\n") {
                    all.push(b'\n');
                }
                all.extend_from_slice(c.as_deref().unwrap_or_default().as_bytes());
                Some(Arc::new(all))
            }
        };
        Self {
            docker,
            owner,
            cfg,
            roots: ca.map(Arc::new),
            ca: trusted,
            ca_key,
            proxy: Arc::new(tokio::sync::Mutex::new(None)),
            image: Mutex::new(None),
            sessions: Arc::default(),
            lost: Mutex::new(HashMap::new()),
            displaced: Arc::default(),
            totals: Arc::default(),
            exe: None,
            seccomp: None,
            idle_installers: Mutex::new(Vec::new()),
            metrics: Arc::default(),
            by_peer: false,
        }
    }

    /// Sessions told apart by their own address, not the proxy's on their network: the
    /// Kubernetes engine's (its networks are records; NetworkPolicy keeps pods apart).
    pub fn keyed_by_peer(mut self, yes: bool) -> Self {
        self.by_peer = yes;
        self
    }

    /// Runs `exe` (a pyberth binary) as the proxy instead of this executable: for a program
    /// that embeds the library, such as a test.
    pub fn with_executable(mut self, exe: std::path::PathBuf) -> Self {
        self.exe = Some(exe);
        self
    }

    /// The proxy's connection records counted in `metrics` too.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The proxy container gets the seccomp profile sandboxes get.
    pub fn with_sandboxing(mut self, sandboxing: &crate::docker::container::Sandboxing) -> Self {
        self.seccomp = sandboxing.seccomp_profile.clone();
        self
    }

    fn labels(&self, kind: &str) -> HashMap<String, String> {
        self.owner.labels_with(&[(LABEL_EGRESS, kind)])
    }

    /// A network for the session, the proxy on it, and the session's policy in the proxy.
    pub async fn attach(
        &self,
        principal: &str,
        session: &str,
        image: &str,
        rules: Vec<Rule>,
        headers: Headers,
    ) -> Result<Attachment, String> {
        let mut slot = self.proxy.lock().await;
        let proxy = self.ensure_proxy(&mut slot, image).await?;
        let (network, local) = self.session_network(&proxy.id, principal, session).await?;
        // Keyed by peer, the session's own address is its key: its policy goes in once its
        // pod has one ([`Binder`]); until then no connection of it is served.
        let key_ip = if self.by_peer { IpAddr::from([0, 0, 0, 0]) } else { local };
        if !self.by_peer {
            let allow = rules.iter().map(|r| r.text().to_owned()).collect();
            let set = Command::set(local, principal, session, allow, headers.clone());
            if let Err(e) = self.send(proxy, &set).await {
                self.remove_network(&network, Some(&proxy.id)).await;
                return Err(e);
            }
            self.totals.lock().unwrap_or_else(|e| e.into_inner()).insert(local, Totals::default());
        }
        let key = (principal.to_owned(), session.to_owned());
        let shared = Arc::new(Mutex::new(rules.iter().map(|r| r.text().to_owned()).collect()));
        // Keyed by peer, the address names the pod only while it lives: the pass, in the
        // pod's proxy URL, names it after (`proxy::Command::with_pass`).
        let pass: Option<Arc<str>> = match self.by_peer {
            true => Some(crate::state_dir::random_hex(16).map_err(|e| format!("cannot make a pass: {e}"))?.into()),
            false => None,
        };
        let net = SessionNet {
            network: network.clone(),
            local: key_ip,
            rules,
            headers,
            shared: shared.clone(),
            pass: pass.clone(),
        };
        self.keep_session(key, net);
        let binder = self.by_peer.then(|| {
            Arc::new(Binder {
                proxy: self.proxy.clone(),
                sessions: self.sessions.clone(),
                displaced: self.displaced.clone(),
                totals: self.totals.clone(),
                principal: principal.to_owned(),
                session: session.to_owned(),
                network: network.clone(),
            })
        });
        Ok(Attachment {
            network,
            proxy_ip: local,
            ca: self.ca.clone(),
            system_roots: self.roots.is_none(),
            rules: shared,
            binder,
            pass,
        })
    }

    /// The session's own network, the proxy (container `proxy`) on it, and its address there.
    async fn session_network(&self, proxy: &str, principal: &str, session: &str) -> Result<(String, IpAddr), String> {
        let network = format!("pyberth-{}-{session}-net{}", self.owner.instance, next_serial());
        let mut labels = self.labels("network");
        labels.insert(LABEL_SESSION.to_owned(), session.to_owned());
        labels.insert(LABEL_OWNER.to_owned(), principal.to_owned());
        let req = NetworkCreateRequest {
            name: network.clone(),
            driver: Some("bridge".into()),
            internal: Some(true),
            labels: Some(labels),
            // An internal network still gives the host's bridge its gateway address, and the
            // session a default route to it: every host service listening on 0.0.0.0 (and the
            // host's other addresses) answered through it (egress::a_session_reaches_nothing_
            // but_the_proxy). Without an address on the bridge, nothing on the host does.
            options: Some(HashMap::from([("com.docker.network.bridge.inhibit_ipv4".to_owned(), "true".to_owned())])),
            ..Default::default()
        };
        self.docker.create_network(req).await.map_err(|e| format!("cannot create the session's network: {e}"))?;
        let joined = async {
            let req = NetworkConnectRequest { container: proxy.to_owned(), endpoint_config: None };
            self.docker.connect_network(&network, req).await.map_err(|e| e.to_string())?;
            let c = self.docker.inspect_container(proxy, None).await.map_err(|e| e.to_string())?;
            c.network_settings
                .and_then(|s| s.networks)
                .and_then(|mut n| n.remove(&network))
                .and_then(|e| e.ip_address)
                .and_then(|ip| ip.parse::<IpAddr>().ok())
                .ok_or_else(|| "the proxy got no address on the session's network".to_owned())
        };
        match joined.await {
            Ok(ip) => Ok((network, ip)),
            Err(e) => {
                self.remove_network(&network, Some(proxy)).await;
                Err(format!("cannot attach the egress proxy to the session's network: {e}"))
            }
        }
    }

    /// The attachment of a session a stopped server left running, from its record: its
    /// network, the old proxy's address there, and the list it had. [`Self::adopt`] then
    /// puts this server's proxy behind it.
    pub fn adopted_attachment(&self, network: String, proxy_ip: IpAddr, allow: Vec<String>) -> Attachment {
        Attachment {
            network,
            proxy_ip,
            ca: self.ca.clone(),
            system_roots: self.roots.is_none(),
            rules: Arc::new(Mutex::new(allow)),
            binder: None,
            pass: None,
        }
    }

    /// Why an adopted session has no egress now, said in each of its runs.
    pub fn notice(&self, principal: &str, session: &str) -> Option<String> {
        let key = (principal.to_owned(), session.to_owned());
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).get(&key).map(|(_, why)| why.clone())
    }

    async fn remove_network(&self, network: &str, proxy: Option<&str>) {
        if let Some(id) = proxy {
            let req = NetworkDisconnectRequest { container: id.to_owned(), force: Some(true) };
            let _ = self.docker.disconnect_network(network, req).await;
        }
        match self.docker.remove_network(network).await {
            Ok(()) | Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => {}
            Err(e) => tracing::warn!(target: "pyberth::egress", network, error = %e, "cannot remove network"),
        }
    }

    /// The session's allow-list in force; `None`: the session has no egress.
    pub fn rules(&self, principal: &str, session: &str) -> Option<Vec<String>> {
        let key = (principal.to_owned(), session.to_owned());
        let s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        s.get(&key).map(|n| n.rules.iter().map(|r| r.text().to_owned()).collect())
    }

    /// Narrows the session's list to `asked` (each entry within the list in force).
    pub async fn narrow(&self, principal: &str, session: &str, asked: &[String]) -> Result<Vec<String>, String> {
        let key = (principal.to_owned(), session.to_owned());
        let (local, rules, headers, pass) = {
            let s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            if asked.is_empty() && !s.contains_key(&key) {
                return Ok(Vec::new()); // already offline
            }
            if let Some((_, why)) = self.lost.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
                return Err(why.clone());
            }
            let n = s.get(&key).ok_or_else(|| {
                format!("session {session:?} has no network: its environment allows no egress, so there is nothing to narrow")
            })?;
            (n.local, policy::narrow(&n.rules, asked)?, n.headers.clone(), n.pass.clone())
        };
        let allow: Vec<String> = rules.iter().map(|r| r.text().to_owned()).collect();
        let mut slot = self.proxy.lock().await;
        self.revive(&mut slot).await;
        let proxy = slot.as_mut().ok_or("the egress proxy is not running")?;
        let set = Command::set(local, principal, session, allow.clone(), headers).with_pass(pass.as_deref());
        // Not bound yet (keyed by peer): the list below is what its binding puts in.
        if !local.is_unspecified() {
            self.send(proxy, &set).await?;
        }
        if let Some(n) = self.sessions.lock().unwrap_or_else(|e| e.into_inner()).get_mut(&key) {
            n.rules = rules;
            *n.shared.lock().unwrap_or_else(|e| e.into_inner()) = allow.clone();
        }
        Ok(allow)
    }

    /// The session's totals so far, and a fresh byte budget for a run about to start.
    pub async fn begin_run(&self, principal: &str, session: &str) -> Option<Totals> {
        let key = (principal.to_owned(), session.to_owned());
        let local = self.sessions.lock().unwrap_or_else(|e| e.into_inner()).get(&key).map(|n| n.local)?;
        let bytes = (self.cfg.egress_max_mb > 0).then(|| self.cfg.egress_max_mb << 20);
        let mut slot = self.proxy.lock().await;
        self.revive(&mut slot).await;
        if let Some(p) = slot.as_mut() {
            let _ = self.send(p, &Command::Budget { local, bytes }).await;
        }
        self.run_begins(local);
        self.totals.lock().unwrap_or_else(|e| e.into_inner()).get(&local).cloned()
    }

    /// The session's totals so far.
    pub async fn totals(&self, principal: &str, session: &str) -> Option<Totals> {
        let key = (principal.to_owned(), session.to_owned());
        let local = self.sessions.lock().unwrap_or_else(|e| e.into_inner()).get(&key).map(|n| n.local)?;
        // Records of connections the run just closed may still be on their way.
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.totals.lock().unwrap_or_else(|e| e.into_inner()).get(&local).cloned()
    }

    /// Removes the proxy and every network of this instance.
    pub async fn shutdown(&self) {
        // Their networks are in `sessions`, `displaced` and `lost`, removed below.
        self.idle_installers.lock().unwrap_or_else(|e| e.into_inner()).clear();
        if let Some(p) = self.proxy.lock().await.take() {
            p.reader.abort();
            container::remove_container(&self.docker, &p.id).await;
        }
        let mut nets: Vec<String> =
            self.sessions.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, n)| n.network).collect();
        nets.extend(self.lost.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, (n, _))| n));
        nets.extend(self.displaced.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(n, _)| n));
        for n in nets {
            self.remove_network(&n, None).await;
        }
        sweep_networks(&self.docker, &|l| l.get(LABEL_INSTANCE) == Some(&self.owner.instance)).await;
    }
}

/// After the sweep of dead instances' containers: removes egress networks of other instances
/// that have no container left (no session, no proxy, no heartbeat). A live instance always
/// has its heartbeat, and the engine refuses to remove a network anything is attached to.
pub async fn sweep_orphan_networks(docker: &dyn Engine, own: &str) -> usize {
    let Ok(found) = container::inventory(docker).await else { return 0 };
    let live: std::collections::HashSet<&String> = found
        .containers
        .iter()
        .flat_map(|c| [c.labels.get(LABEL_INSTANCE), c.labels.get(crate::docker::heartbeat::LABEL_HEARTBEAT)])
        .flatten()
        .collect();
    sweep_networks(docker, &|l| l.get(LABEL_INSTANCE).is_some_and(|i| i != own && !live.contains(i))).await
}

/// Removes the egress networks carrying our label for which `pick` says yes.
pub async fn sweep_networks(
    docker: &dyn Engine,
    pick: &(dyn Fn(&HashMap<String, String>) -> bool + Send + Sync),
) -> usize {
    let filters = HashMap::from([("label", vec![LABEL_EGRESS])]);
    let opts = bollard::query_parameters::ListNetworksOptionsBuilder::default().filters(&filters).build();
    let Ok(nets) = docker.list_networks(Some(opts)).await else { return 0 };
    let mut n = 0;
    for net in nets {
        let labels = net.labels.unwrap_or_default();
        if labels.get(LABEL_MANAGED).map(String::as_str) != Some("1") || !pick(&labels) {
            continue;
        }
        if let Some(name) = net.name {
            n += usize::from(docker.remove_network(&name).await.is_ok());
        }
    }
    n
}
