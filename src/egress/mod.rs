//! Controlled egress (issue 17): a session whose environment has an `egress` allow-list gets
//! an `internal` Docker network of its own that holds only it and a filtering proxy of ours;
//! everything else keeps `NetworkMode none` (docs/design.md, "Egress").
//!
//! The proxy is this very binary (`pyberth egress-proxy`, [`proxy`]) run in one small
//! container per server, made from the sandbox image with the executable uploaded into it:
//! no image build, no registry. The server speaks to it over the container's attached
//! stdin/stdout (policies in, connection records out), so the proxy has no control port.

mod account;
pub mod policy;
pub mod proxy;

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bollard::Docker;
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

/// What a session container needs for egress: its network and the proxy's address there.
#[derive(Debug, Clone)]
pub struct Attachment {
    /// The session's own `internal` network.
    pub network: String,
    /// The proxy's address on it.
    pub proxy_ip: IpAddr,
    /// The CA bundle to trust: the server's `--ca-bundle` and the per-server CA.
    pub ca: Option<Arc<Vec<u8>>>,
    /// True when the server has no bundle: the image's own CAs go first in the session's.
    pub system_roots: bool,
    /// The allow-list in force (narrowed by `set_network`), for the session's record: a
    /// restarted server that adopts the session puts exactly this back.
    pub rules: Arc<Mutex<Vec<String>>>,
}

impl Attachment {
    /// The allow-list in force now.
    pub fn allow(&self) -> Vec<String> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Attachment {
    /// The proxy variables, and the CA bundle's, for every library that reads them.
    pub fn env(&self) -> Vec<String> {
        let url = match self.proxy_ip {
            IpAddr::V6(ip) => format!("http://[{ip}]:{}", proxy::PORT),
            ip => format!("http://{ip}:{}", proxy::PORT),
        };
        let mut env: Vec<String> =
            ["HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"].iter().map(|k| format!("{k}={url}")).collect();
        // Empty: everything goes through the proxy (nothing else is reachable anyway).
        env.extend(["NO_PROXY=".to_owned(), "no_proxy=".to_owned()]);
        if self.ca.is_some() {
            for k in ["SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"] {
                env.push(format!("{k}={CA_PATH}"));
            }
        }
        env
    }

    /// How a session container joins its network instead of none: DNS points at the proxy's
    /// resolver, and the proxy and CA variables are set.
    pub fn join(&self) -> crate::docker::container::NetworkJoin {
        crate::docker::container::NetworkJoin {
            network: self.network.clone(),
            dns: vec![self.proxy_ip.to_string()],
            env: self.env(),
        }
    }

    /// Only the proxy variables (no CA paths: a container that gets no CA bundle written).
    pub fn proxy_env(&self) -> Vec<String> {
        self.env().into_iter().filter(|e| e.to_ascii_lowercase().contains("proxy=")).collect()
    }

    /// After the container starts, before any code runs: the CA bundle into
    /// [`CA_PATH`] on the container's own `/tmp`, written by root (no capabilities) through
    /// a short exec. Root's file in a root-owned directory under the sticky `/tmp`: the code
    /// reads it and can neither replace nor remove it. (The root filesystem is read-only and
    /// the engine cannot copy into a tmpfs, hence an exec.)
    pub async fn after_start(&self, docker: &Docker, id: &str) -> Result<(), bollard::errors::Error> {
        use bollard::exec::{CreateExecOptions, StartExecResults};
        use futures::StreamExt;
        use tokio::io::AsyncWriteExt;
        let Some(ca) = &self.ca else { return Ok(()) };
        let script = format!(
            "umask 022 && mkdir -p {dir} && {{ {system} cat; }} > {dir}/.ca.tmp && chmod 0444 {dir}/.ca.tmp && mv {dir}/.ca.tmp {CA_PATH}",
            dir = CA_DIR,
            system = if self.system_roots { "cat /etc/ssl/certs/ca-certificates.crt 2>/dev/null;" } else { "" }
        );
        let opts = CreateExecOptions {
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            user: Some("0".to_owned()),
            cmd: Some(vec!["sh".to_owned(), "-c".to_owned(), script]),
            ..Default::default()
        };
        let exec = docker.create_exec(id, opts).await?;
        if let StartExecResults::Attached { mut input, mut output } = docker.start_exec(&exec.id, None).await? {
            let io = |err| bollard::errors::Error::IOError { err };
            input.write_all(ca).await.map_err(io)?;
            input.shutdown().await.map_err(io)?;
            drop(input);
            while let Some(frame) = output.next().await {
                frame?;
            }
        }
        match docker.inspect_exec(&exec.id).await?.exit_code {
            Some(0) => Ok(()),
            code => Err(bollard::errors::Error::IOError {
                err: std::io::Error::other(format!("writing the CA bundle into the session failed (exit {code:?})")),
            }),
        }
    }
}

fn tar_one(name: &str, data: &[u8], mode: u32) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_cksum();
    // Writing into a Vec cannot fail.
    let _ = b.append_data(&mut h, name, data);
    b.into_inner().unwrap_or_default()
}

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
    counts: std::collections::BTreeMap<String, u64>,
    /// Denials ever, of which `denied` keeps the last [`MAX_DENIED`].
    #[serde(skip)]
    #[schemars(skip)]
    denied_total: u64,
    /// How many of the session's refusals the server's log still shows one by one.
    #[serde(skip)]
    #[schemars(skip)]
    log: account::RefusalLog,
}

/// Denials kept per session (and listed per run).
const MAX_DENIED: usize = 50;

impl Totals {
    fn add(&mut self, r: &Record) {
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

    fn deny(&mut self, why: String) {
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
            denied_total: 0,
            log: Default::default(),
        }
    }
}

/// The package installer's way out: its own network with the proxy, allowing only the index
/// hosts (`Manager::attach_installer`).
#[derive(Debug)]
pub struct InstallerNet {
    /// The network to create the installer container on (`HostConfig.network_mode`).
    pub network: String,
    /// Variables to add to its environment: the proxy, and nothing else.
    pub env: Vec<String>,
    /// Its DNS servers (`HostConfig.dns`): an address where nothing answers.
    pub dns: Vec<String>,
    /// The hosts it may reach.
    pub allow: Vec<String>,
    key: String,
}

impl InstallerNet {
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

/// What an installer's index is: the hosts its network must reach (the packages owner
/// says; egress only enforces).
pub trait IndexHosts {
    /// `host` or `host:port` allow-list entries.
    fn index_hosts(&self) -> Vec<String>;
}

pub use policy::{Headers, SecretHeaders};

/// One session's egress.
struct SessionNet {
    network: String,
    local: IpAddr,
    rules: Vec<Rule>,
    headers: Headers,
    /// The same list as text, shared with the session's [`Attachment`] (its record).
    shared: Arc<Mutex<Vec<String>>>,
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
    docker: Docker,
    owner: Owner,
    cfg: Arc<SandboxConfig>,
    /// The server's CA bundle (`--ca-bundle`): what the proxy trusts for upstreams.
    roots: Option<Arc<Vec<u8>>>,
    /// What sessions trust: the server's bundle and the per-server CA's certificate.
    ca: Option<Arc<Vec<u8>>>,
    /// The per-server CA's key: it goes to the proxy only (stdin), never to a sandbox.
    ca_key: Option<proxy::SecretPem>,
    proxy: tokio::sync::Mutex<Option<Proxy>>,
    /// The image the proxy was last started from, to start it again if it goes.
    image: Mutex<Option<String>>,
    sessions: Mutex<HashMap<(String, String), SessionNet>>,
    /// Adopted sessions whose egress could not be taken over: their network (removed when
    /// they end) and why, said in each of their runs' notices.
    lost: Mutex<HashMap<(String, String), (String, String)>>,
    /// Totals by the proxy's address on a session's network.
    totals: Arc<Mutex<HashMap<IpAddr, Totals>>>,
    /// The executable run as the proxy (`None`: this one).
    exe: Option<std::path::PathBuf>,
    /// The seccomp profile the engine check chose for sandboxes; the proxy gets it too.
    seccomp: Option<Arc<str>>,
    /// Installer networks no install is using, with the proxy they lead to and when they
    /// were freed: the next install takes one instead of making its own.
    idle_installers: Mutex<Vec<(InstallerNet, String, std::time::Instant)>>,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("egress::Manager").finish_non_exhaustive()
    }
}

use crate::docker::next_serial;

impl Manager {
    /// The egress of one server; nothing is started until a session asks.
    pub fn new(docker: Docker, owner: Owner, cfg: Arc<SandboxConfig>, ca: Option<Vec<u8>>) -> Self {
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
            proxy: tokio::sync::Mutex::new(None),
            image: Mutex::new(None),
            sessions: Mutex::new(HashMap::new()),
            lost: Mutex::new(HashMap::new()),
            totals: Arc::default(),
            exe: None,
            seccomp: None,
            idle_installers: Mutex::new(Vec::new()),
        }
    }

    /// Runs `exe` (a pyberth binary) as the proxy instead of this executable: for a program
    /// that embeds the library, such as a test.
    pub fn with_executable(mut self, exe: std::path::PathBuf) -> Self {
        self.exe = Some(exe);
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

    /// Sends a command and waits until the proxy has it in force: a narrowed list holds for
    /// the very next connection.
    async fn send(&self, proxy: &mut Proxy, c: &Command) -> Result<(), String> {
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

    /// The proxy, started (or started again, if it is gone) from `image`.
    async fn ensure_proxy<'a>(&self, slot: &'a mut Option<Proxy>, image: &str) -> Result<&'a mut Proxy, String> {
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
    async fn revive(&self, slot: &mut Option<Proxy>) {
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
    async fn readopt(&self, proxy: &mut Proxy) {
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
        let bytes = (self.cfg.egress_max_mb > 0).then(|| self.cfg.egress_max_mb << 20);
        for ((principal, session), network, old, allow, headers) in nets {
            let req = NetworkConnectRequest { container: proxy.id.clone(), endpoint_config: None };
            let joined = match self.docker.connect_network(&network, req).await {
                Ok(()) => self.proxy_ip_on(&proxy.id, &network).await,
                Err(e) => Err(e.to_string()),
            };
            match joined {
                Ok(ip) if ip == old => {
                    let set = Command::Set { local: ip, session: session.clone(), principal, allow, headers };
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

    async fn proxy_ip_on(&self, id: &str, network: &str) -> Result<IpAddr, String> {
        let c = self.docker.inspect_container(id, None).await.map_err(|e| e.to_string())?;
        c.network_settings
            .and_then(|s| s.networks)
            .and_then(|mut n| n.remove(network))
            .and_then(|e| e.ip_address)
            .and_then(|ip| ip.parse::<IpAddr>().ok())
            .ok_or_else(|| "the proxy got no address on the session's network".to_owned())
    }

    async fn start_proxy(&self, image: &str) -> Result<Proxy, String> {
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

    async fn boot(&self, id: &str, exe: Vec<u8>) -> Result<Proxy, String> {
        let (dir, file) = PROXY_EXE.rsplit_once('/').unwrap_or(("/usr/local/bin", "pyberth-egress"));
        let opts = UploadToContainerOptionsBuilder::default().path(dir).build();
        self.docker
            .upload_to_container(id, Some(opts), bollard::body_full(tar_one(file, &exe, 0o555).into()))
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
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let totals = self.totals.clone();
        let (applied_tx, applied) = tokio::sync::watch::channel(0u64);
        let mut output = attached.output;
        let reader = tokio::spawn(async move {
            let mut ready = Some(ready_tx);
            let (mut out, mut err) = (Vec::new(), String::new());
            while let Some(frame) = output.next().await {
                match frame {
                    Ok(LogOutput::StdOut { message }) => {
                        out.extend_from_slice(&message);
                        while let Some(i) = out.iter().position(|b| *b == b'\n') {
                            let line: Vec<u8> = out.drain(..=i).collect();
                            match serde_json::from_slice::<Report>(&line) {
                                Ok(Report::Ready) => {
                                    if let Some(r) = ready.take() {
                                        let _ = r.send(Ok(()));
                                    }
                                }
                                Ok(Report::Conn(r)) => account::account(&totals, &r),
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
        });
        let ready = tokio::time::timeout(Duration::from_secs(30), ready_rx).await;
        let fail = |why: String| {
            reader.abort();
            Err(why)
        };
        let stderr = match ready {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(s))) => Some(s),
            Ok(Err(_)) => Some(String::new()),
            Err(_) => return fail("the egress proxy did not start within 30 s".into()),
        };
        if let Some(stderr) = stderr {
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
            return fail(format!(
                "the egress proxy did not start{hint}: {}{}",
                stderr.trim(),
                state.unwrap_or_default()
            ));
        }
        let mut proxy = Proxy { id: id.to_owned(), input: attached.input, reader, applied };
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
        let config = Command::Config {
            pinned,
            own,
            max_conns: self.cfg.egress_max_conns,
            ca_key: self.ca_key.clone(),
            roots: self.roots.as_ref().map(|r| String::from_utf8_lossy(r).into_owned()),
        };
        self.send(&mut proxy, &config).await?;
        tracing::info!(target: "pyberth::egress", container = %container::short(id), "egress proxy started");
        Ok(proxy)
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
            let req = NetworkConnectRequest { container: proxy.id.clone(), endpoint_config: None };
            self.docker.connect_network(&network, req).await.map_err(|e| e.to_string())?;
            let c = self.docker.inspect_container(&proxy.id, None).await.map_err(|e| e.to_string())?;
            c.network_settings
                .and_then(|s| s.networks)
                .and_then(|mut n| n.remove(&network))
                .and_then(|e| e.ip_address)
                .and_then(|ip| ip.parse::<IpAddr>().ok())
                .ok_or_else(|| "the proxy got no address on the session's network".to_owned())
        };
        let local = match joined.await {
            Ok(ip) => ip,
            Err(e) => {
                self.remove_network(&network, Some(&proxy.id)).await;
                return Err(format!("cannot attach the egress proxy to the session's network: {e}"));
            }
        };
        let allow = rules.iter().map(|r| r.text().to_owned()).collect();
        let set = Command::Set {
            local,
            session: session.to_owned(),
            principal: principal.to_owned(),
            allow,
            headers: headers.clone(),
        };
        if let Err(e) = self.send(proxy, &set).await {
            self.remove_network(&network, Some(&proxy.id)).await;
            return Err(e);
        }
        self.totals.lock().unwrap_or_else(|e| e.into_inner()).insert(local, Totals::default());
        let key = (principal.to_owned(), session.to_owned());
        let shared = Arc::new(Mutex::new(rules.iter().map(|r| r.text().to_owned()).collect()));
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, SessionNet { network: network.clone(), local, rules, headers, shared: shared.clone() });
        Ok(Attachment {
            network,
            proxy_ip: local,
            ca: self.ca.clone(),
            system_roots: self.roots.is_none(),
            rules: shared,
        })
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
        }
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
    async fn take_over(
        &self,
        principal: &str,
        session: &str,
        image: &str,
        container: &str,
        att: &Attachment,
        bound: &[Rule],
        headers: Headers,
    ) -> Result<(), String> {
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
                let set = Command::Set {
                    local,
                    session: session.to_owned(),
                    principal: principal.to_owned(),
                    allow,
                    headers: headers.clone(),
                };
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
        self.sessions.lock().unwrap_or_else(|e| e.into_inner()).insert(
            (principal.to_owned(), session.to_owned()),
            SessionNet { network, local, rules, headers, shared: att.rules.clone() },
        );
        // This server's CA is new: without it the session would refuse every intercepted host.
        if let Err(e) = att.after_start(&self.docker, container).await {
            tracing::warn!(target: "pyberth::egress", session, error = %e, "cannot write the new CA bundle into an adopted session");
        }
        Ok(())
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

    /// After the session's container is gone: its policy out of the proxy, its network removed.
    pub async fn detach(&self, principal: &str, session: &str) {
        let key = (principal.to_owned(), session.to_owned());
        let lost = self.lost.lock().unwrap_or_else(|e| e.into_inner()).remove(&key);
        if let Some((network, _)) = lost {
            self.remove_network(&network, None).await;
        }
        let Some(net) = self.sessions.lock().unwrap_or_else(|e| e.into_inner()).remove(&key) else { return };
        let mut slot = self.proxy.lock().await;
        let id = match slot.as_mut() {
            Some(p) => {
                let _ = self.send(p, &Command::Drop { local: net.local }).await;
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

    /// The session's allow-list in force; `None`: the session has no egress.
    pub fn rules(&self, principal: &str, session: &str) -> Option<Vec<String>> {
        let key = (principal.to_owned(), session.to_owned());
        let s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        s.get(&key).map(|n| n.rules.iter().map(|r| r.text().to_owned()).collect())
    }

    /// Narrows the session's list to `asked` (each entry within the list in force).
    pub async fn narrow(&self, principal: &str, session: &str, asked: &[String]) -> Result<Vec<String>, String> {
        let key = (principal.to_owned(), session.to_owned());
        let (local, rules, headers) = {
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
            (n.local, policy::narrow(&n.rules, asked)?, n.headers.clone())
        };
        let allow: Vec<String> = rules.iter().map(|r| r.text().to_owned()).collect();
        let mut slot = self.proxy.lock().await;
        self.revive(&mut slot).await;
        let proxy = slot.as_mut().ok_or("the egress proxy is not running")?;
        let set = Command::Set {
            local,
            session: session.to_owned(),
            principal: principal.to_owned(),
            allow: allow.clone(),
            headers,
        };
        self.send(proxy, &set).await?;
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
        })
    }

    /// An idle installer network for `allow`, if one leads to the running proxy: networks
    /// idle past [`INSTALLER_IDLE`], or whose proxy is gone, are removed on the way.
    async fn reuse_installer(&self, allow: &[String]) -> Option<InstallerNet> {
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

    /// Removes the proxy and every network of this instance.
    pub async fn shutdown(&self) {
        // Their networks are in `sessions`, removed below.
        self.idle_installers.lock().unwrap_or_else(|e| e.into_inner()).clear();
        if let Some(p) = self.proxy.lock().await.take() {
            p.reader.abort();
            container::remove_container(&self.docker, &p.id).await;
        }
        let mut nets: Vec<String> =
            self.sessions.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, n)| n.network).collect();
        nets.extend(self.lost.lock().unwrap_or_else(|e| e.into_inner()).drain().map(|(_, (n, _))| n));
        for n in nets {
            self.remove_network(&n, None).await;
        }
        sweep_networks(&self.docker, &|l| l.get(LABEL_INSTANCE) == Some(&self.owner.instance)).await;
    }
}

/// After the sweep of dead instances' containers: removes egress networks of other instances
/// that have no container left (no session, no proxy, no heartbeat). A live instance always
/// has its heartbeat, and the engine refuses to remove a network anything is attached to.
pub async fn sweep_orphan_networks(docker: &Docker, own: &str) -> usize {
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
pub async fn sweep_networks(docker: &Docker, pick: &(dyn Fn(&HashMap<String, String>) -> bool + Send + Sync)) -> usize {
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
