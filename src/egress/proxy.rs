//! The filtering proxy itself: `pyberth egress-proxy`, run inside its own container. It takes
//! policies as JSON lines on stdin and reports every connection as a JSON line on stdout, so
//! it needs no control port a sandbox could reach.
//!
//! A connection is told apart by the proxy's own address it arrived on: each session has an
//! `internal` network holding only itself and the proxy, so that address names the session,
//! and no session can reach another's (it has no route off its network, and no capability to
//! forge one).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};

use super::policy::{self, Rule};

/// The port the proxy listens on, on every network it is attached to.
pub const PORT: u16 = 3128;
/// Largest request head accepted, bytes.
const MAX_HEAD: usize = 16 * 1024;
/// Time a client has to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a name has to resolve, and an upstream to accept.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Refusals one session has answered at once; past them, [`REFUSAL_RATE`] a second.
const REFUSAL_BURST: f64 = 64.0;
/// Refusals a second one session has answered at once, past the burst.
const REFUSAL_RATE: f64 = 16.0;
/// How long a refusal past the rate waits, holding one of the session's connection slots:
/// code that opens refused connections in a loop gets at most `--egress-max-conns` / this
/// answered a second (320 with the default 32) instead of thousands.
const REFUSAL_PENALTY: Duration = Duration::from_millis(100);
/// A host name is at most 253 characters; a host reported is cut there.
const HOST_SHOWN: usize = 253;

/// A message from the server.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// Settings of the whole proxy.
    Config {
        /// Names the operator pinned to an address (checked like a literal the operator allowed).
        pinned: HashMap<String, IpAddr>,
        /// Addresses of the host and of the proxy itself, refused whatever their range.
        own: Vec<IpAddr>,
        /// Connections one session may have open at once.
        max_conns: usize,
        /// The per-server CA's private key (PEM), to mint leaf certificates for hosts that
        /// carry headers: TLS to them is terminated here ([`intercept`]).
        #[serde(default)]
        ca_key: Option<SecretPem>,
        /// CAs trusted for upstreams (the server's `--ca-bundle`, PEM); none: the image's.
        #[serde(default)]
        roots: Option<String>,
    },
    /// The policy of the session whose network reaches the proxy at `local`.
    Set {
        /// The proxy's address on the session's network.
        local: IpAddr,
        /// Session name.
        session: String,
        /// Its owner.
        principal: String,
        /// Its allow-list.
        allow: Vec<String>,
        /// Headers added to plain HTTP requests, by host (replacing the sandbox's own).
        #[serde(default)]
        headers: HashMap<String, Vec<(String, String)>>,
    },
    /// Bytes the session may still move (both ways) until the next budget.
    Budget {
        /// The proxy's address on the session's network.
        local: IpAddr,
        /// Bytes; `None`: unbounded.
        bytes: Option<u64>,
    },
    /// The session is gone.
    Drop {
        /// The proxy's address on the session's network.
        local: IpAddr,
    },
    /// Answered with [`Report::Applied`] once every earlier command is in force.
    Sync {
        /// Echoed back.
        seq: u64,
    },
}

/// A private key in PEM whose `Debug` does not show it.
#[derive(Clone, Serialize, Deserialize)]
pub struct SecretPem(pub String);

impl std::fmt::Debug for SecretPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretPem(..)")
    }
}

/// The CA's certificate fields, the same in the server (which self-signs it and gives the
/// certificate to sandboxes) and in the proxy (which signs leaves with it): the issuer name
/// and key identifier are all a leaf needs to chain to the sandboxes' copy.
pub fn ca_params() -> rcgen::CertificateParams {
    use rcgen::{BasicConstraints, DnType, IsCa, KeyUsagePurpose};
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(DnType::CommonName, "pyberth egress proxy CA (sandboxes only)");
    p.distinguished_name.push(DnType::OrganizationName, "pyberth");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    p
}

/// A new per-server CA for the names in `hosts` only: (certificate PEM, private key PEM).
/// The certificate sandboxes trust carries name constraints, so even its key could not
/// vouch to them for any other name (IP literals are not constrained: there are few).
pub fn new_ca(hosts: &[String]) -> Result<(String, SecretPem), String> {
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    let mut params = ca_params();
    let names: Vec<rcgen::GeneralSubtree> = hosts
        .iter()
        .filter(|h| h.parse::<IpAddr>().is_err())
        .map(|h| rcgen::GeneralSubtree::DnsName(h.clone()))
        .collect();
    if !names.is_empty() {
        params.name_constraints =
            Some(rcgen::NameConstraints { permitted_subtrees: names, excluded_subtrees: Vec::new() });
    }
    let cert = params.self_signed(&key).map_err(|e| e.to_string())?;
    Ok((cert.pem(), SecretPem(key.serialize_pem())))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// TLS termination for hosts that carry headers: the CA, the upstream trust, and the leaf
/// certificates minted so far (one per host; only hosts with headers, so bounded by config).
struct Mitm {
    ca_key: rcgen::KeyPair,
    ca_cert: rcgen::Certificate,
    client: Arc<rustls::ClientConfig>,
    leaves: std::sync::Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl Mitm {
    fn new(key: &SecretPem, roots: Option<&str>) -> Result<Self, String> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject as _;
        let ca_key = rcgen::KeyPair::from_pem(&key.0).map_err(|e| format!("CA key: {e}"))?;
        let ca_cert = ca_params().self_signed(&ca_key).map_err(|e| format!("CA: {e}"))?;
        let pem = match roots {
            Some(r) => r.as_bytes().to_vec(),
            None => std::fs::read("/etc/ssl/certs/ca-certificates.crt").map_err(|e| format!("system CAs: {e}"))?,
        };
        let mut store = rustls::RootCertStore::empty();
        let (added, _) = store.add_parsable_certificates(CertificateDer::pem_slice_iter(&pem).filter_map(Result::ok));
        if added == 0 {
            return Err("no CA certificate to verify upstreams with".into());
        }
        let mut client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(store)
            .with_no_client_auth();
        client.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self { ca_key, ca_cert, client: Arc::new(client), leaves: Default::default() })
    }

    /// The server side for `host`: a leaf for it, signed by the CA, minted once.
    fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, String> {
        use rcgen::{DnType, ExtendedKeyUsagePurpose, KeyUsagePurpose};
        use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = leaves.get(host) {
            return Ok(c.clone());
        }
        let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
        let mut p = rcgen::CertificateParams::new(vec![host.to_owned()]).map_err(|e| e.to_string())?;
        p.distinguished_name.push(DnType::CommonName, host);
        p.use_authority_key_identifier_extension = true;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = p.signed_by(&key, &self.ca_cert, &self.ca_key).map_err(|e| e.to_string())?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], der)
            .map_err(|e| e.to_string())?;
        // One HTTP/1.1 request per connection, so its head can be read and the headers set.
        cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
        let cfg = Arc::new(cfg);
        leaves.insert(host.to_owned(), cfg.clone());
        Ok(cfg)
    }
}

/// A report to the server.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Report {
    /// Listening; policies may come.
    Ready,
    /// One connection, when it ends (a denied one at once).
    Conn(Record),
    /// Every command before [`Command::Sync`] `seq` is in force.
    Applied {
        /// The sync's number.
        seq: u64,
    },
}

/// One connection's account.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// The proxy's address it arrived on (names the session).
    pub local: IpAddr,
    /// Session.
    pub session: String,
    /// Owner.
    pub principal: String,
    /// Host asked for.
    pub host: String,
    /// Port asked for.
    pub port: u16,
    /// True when the proxy connected it.
    pub allowed: bool,
    /// The rule that allowed it, or why it was denied.
    pub rule: String,
    /// Bytes from the sandbox to the upstream.
    pub up: u64,
    /// Bytes from the upstream to the sandbox.
    pub down: u64,
    /// Duration, ms.
    pub ms: u64,
    /// True when the proxy cut it: the run's byte budget was spent.
    #[serde(default)]
    pub cut: bool,
}

struct Policy {
    session: String,
    principal: String,
    rules: Vec<Rule>,
    headers: HashMap<String, Vec<(String, String)>>,
    /// Every header value: scrubbed from what upstreams send back.
    secrets: Vec<Vec<u8>>,
    conns: Arc<Semaphore>,
    budget: Arc<Budget>,
    refusals: Arc<RefusalRate>,
}

/// A session's refusals: a token bucket of [`REFUSAL_BURST`] filled at [`REFUSAL_RATE`].
struct RefusalRate(std::sync::Mutex<(f64, Instant)>);

impl RefusalRate {
    fn new() -> Self {
        Self(std::sync::Mutex::new((REFUSAL_BURST, Instant::now())))
    }

    /// Takes one refusal; false past the rate.
    fn take(&self) -> bool {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, at) = &mut *g;
        *tokens = (*tokens + at.elapsed().as_secs_f64() * REFUSAL_RATE).min(REFUSAL_BURST);
        *at = Instant::now();
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// `text` cut to `max` bytes on a character boundary, saying how much was left out.
fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end == text.len() { text.to_owned() } else { format!("{}… (+{} bytes)", &text[..end], text.len() - end) }
}

#[derive(Default)]
struct Budget {
    /// Bytes left; `u64::MAX`: unbounded.
    left: AtomicU64,
}

impl Budget {
    /// Takes `n` bytes; false once exhausted.
    fn take(&self, n: u64) -> bool {
        let took =
            self.left
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| {
                    if l == u64::MAX { Some(l) } else { l.checked_sub(n) }
                })
                .is_ok();
        if !took {
            // Spent: what is left is too little for this chunk, and no later one gets through.
            self.left.store(0, Ordering::SeqCst);
        }
        took
    }
}

#[derive(Default)]
struct State {
    policies: HashMap<IpAddr, Arc<Policy>>,
    pinned: HashMap<String, IpAddr>,
    own: Vec<IpAddr>,
    max_conns: usize,
    mitm: Option<Arc<Mitm>>,
}

type Shared = Arc<RwLock<State>>;

/// Runs the proxy until stdin closes (the server went away): then it exits, and the
/// container with it.
pub async fn run() -> anyhow::Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", PORT)).await?;
    let state: Shared = Arc::new(RwLock::new(State { max_conns: 32, ..Default::default() }));
    let (tx, mut rx) = mpsc::unbounded_channel::<Report>();
    let writer = tokio::spawn(async move {
        let mut out = tokio::io::stdout();
        while let Some(r) = rx.recv().await {
            let Ok(mut line) = serde_json::to_vec(&r) else { continue };
            line.push(b'\n');
            if out.write_all(&line).await.is_err() || out.flush().await.is_err() {
                break;
            }
        }
    });
    let _ = tx.send(Report::Ready);
    let accept = {
        let (state, tx) = (state.clone(), tx.clone());
        async move {
            loop {
                let Ok((sock, peer)) = listener.accept().await else { continue };
                let (state, tx) = (state.clone(), tx.clone());
                // Each connection ends on its own: bounded head time, then a splice that ends
                // when either side closes.
                tokio::spawn(async move { handle(sock, peer, state, tx).await });
            }
        }
    };
    let control = async {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            match serde_json::from_str::<Command>(&line) {
                Ok(Command::Sync { seq }) => {
                    let _ = tx.send(Report::Applied { seq });
                }
                Ok(c) => apply(&state, c),
                Err(e) => eprintln!("egress-proxy: bad command: {e}"),
            }
        }
    };
    tokio::select! {
        () = accept => {}
        () = control => {}
    }
    drop(tx);
    writer.abort();
    Ok(())
}

fn apply(state: &Shared, c: Command) {
    let mut s = state.write().unwrap_or_else(|e| e.into_inner());
    match c {
        Command::Config { pinned, own, max_conns, ca_key, roots } => {
            s.mitm = match ca_key.map(|k| Mitm::new(&k, roots.as_deref())) {
                Some(Ok(m)) => Some(Arc::new(m)),
                Some(Err(e)) => {
                    // Hosts with headers then get a plain tunnel: no secret is added, none leaks.
                    eprintln!("egress-proxy: TLS termination unavailable: {e}");
                    None
                }
                None => None,
            };
            s.pinned = pinned;
            s.own = own;
            s.max_conns = max_conns.max(1);
        }
        Command::Set { local, session, principal, allow, headers } => {
            let rules = allow.iter().filter_map(|a| Rule::parse(a).ok()).collect();
            // The connection slots, the budget and the refusal rate survive a new list.
            let (conns, budget, refusals) = match s.policies.get(&local) {
                Some(p) => (p.conns.clone(), p.budget.clone(), p.refusals.clone()),
                None => {
                    let b = Budget::default();
                    b.left.store(u64::MAX, Ordering::SeqCst);
                    (Arc::new(Semaphore::new(s.max_conns)), Arc::new(b), Arc::new(RefusalRate::new()))
                }
            };
            let mut secrets: Vec<Vec<u8>> =
                headers.values().flatten().filter(|(_, v)| !v.is_empty()).flat_map(|(_, v)| secret_forms(v)).collect();
            secrets.sort();
            secrets.dedup();
            let policy = Policy { session, principal, rules, headers, secrets, conns, budget, refusals };
            s.policies.insert(local, Arc::new(policy));
        }
        Command::Budget { local, bytes } => {
            if let Some(p) = s.policies.get(&local) {
                p.budget.left.store(bytes.unwrap_or(u64::MAX), Ordering::SeqCst);
            }
        }
        Command::Drop { local } => {
            s.policies.remove(&local);
        }
        Command::Sync { .. } => {}
    }
}

/// A parsed request head.
struct Head {
    connect: bool,
    host: String,
    port: u16,
    /// For plain HTTP: the request line to send upstream (origin-form).
    line: String,
    /// For plain HTTP: `Host` as sent upstream (the host connected to, whatever the code said).
    host_header: String,
    /// For plain HTTP: the header lines to send upstream (no proxy, connection or Host headers).
    headers: Vec<String>,
    /// Bytes read past the head (the start of a body, or of the tunnel).
    rest: Vec<u8>,
}

/// The head's text and the bytes read past it.
async fn read_raw<R: tokio::io::AsyncRead + Unpin>(sock: &mut R) -> Result<(String, Vec<u8>), String> {
    let mut buf = Vec::with_capacity(1024);
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if buf.len() >= MAX_HEAD {
            return Err(format!("request head over {MAX_HEAD} bytes"));
        }
        let mut chunk = [0u8; 4096];
        let n = sock.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed before a request".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let rest = buf.split_off(end);
    let text = String::from_utf8(buf).map_err(|_| "request head is not text".to_owned())?;
    Ok((text, rest))
}

/// Method, target and version.
type RequestLine<'a> = (&'a str, &'a str, &'a str);

/// A token character (RFC 9110 5.6.2): what a method and a header name are made of.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The request line's parts, and the header lines a request goes upstream with (no proxy,
/// connection or Host headers: the proxy sets `Host` to the host it connects to, so a forged
/// one cannot send an operator's secret to another site behind the same address).
///
/// Strict, because the head is forwarded: a lone `\n`, a stray `\r` or any other control
/// byte, a folded line, or a space before a header's colon would let a lenient upstream read
/// a second request the sandbox wrote, carrying the headers the proxy adds (smuggling).
fn split_head(text: &str) -> Result<(RequestLine<'_>, Vec<String>), String> {
    let bytes = text.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        let crlf = (b == b'\r' && bytes.get(i + 1) == Some(&b'\n')) || (b == b'\n' && i > 0 && bytes[i - 1] == b'\r');
        if (b < 0x20 && b != b'\t' && !crlf) || b == 0x7f {
            return Err(format!("control byte 0x{b:02x} in the request head: refused"));
        }
    }
    let mut lines = text.split("\r\n");
    let first = lines.next().unwrap_or_default();
    let mut parts = first.split(' ');
    let line = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(m), Some(t), Some(v), None)
            if !m.is_empty()
                && m.bytes().all(is_tchar)
                && !t.is_empty()
                && !t.contains('\t')
                && (v == "HTTP/1.1" || v == "HTTP/1.0") =>
        {
            (m, t, v)
        }
        _ => return Err("not an HTTP/1.0 or HTTP/1.1 request line".into()),
    };
    let mut headers = Vec::new();
    for l in lines.filter(|l| !l.is_empty()) {
        let name = match l.split_once(':') {
            Some((n, _)) if !n.is_empty() && n.bytes().all(is_tchar) => n,
            // A folded line (leading space or tab) or a name with spaces: refused, not guessed.
            _ => return Err(format!("malformed header line {:?}", l.chars().take(40).collect::<String>())),
        };
        let name = name.to_ascii_lowercase();
        if !(name.starts_with("proxy-") || name == "connection" || name == "keep-alive" || name == "host") {
            headers.push(l.to_owned());
        }
    }
    Ok((line, headers))
}

/// `Host` for `host:port`, the port left out when it is the scheme's default.
fn host_header(host: &str, port: u16, default: u16) -> String {
    let h = if host.contains(':') { format!("[{host}]") } else { host.to_owned() };
    if port == default { h } else { format!("{h}:{port}") }
}

/// A request inside a tunnel to `host:port` (TLS terminated or plain): origin-form only.
async fn read_inner_head<R: tokio::io::AsyncRead + Unpin>(
    sock: &mut R,
    host: &str,
    port: u16,
    default_port: u16,
) -> Result<Head, String> {
    let (text, rest) = read_raw(sock).await?;
    let ((method, target, version), headers) = split_head(&text)?;
    if !target.starts_with('/') {
        return Err("inside the tunnel, only origin-form requests (GET /path HTTP/1.1) are forwarded".into());
    }
    Ok(Head {
        connect: false,
        host: host.to_owned(),
        port,
        line: format!("{method} {target} {version}"),
        host_header: host_header(host, port, default_port),
        headers,
        rest,
    })
}

async fn read_head(sock: &mut TcpStream) -> Result<Head, String> {
    let (text, rest) = read_raw(sock).await?;
    let ((method, target, version), headers) = split_head(&text)?;
    if method == "CONNECT" {
        let (host, port) = policy::split_host_port(target)?;
        let port = port.ok_or("CONNECT needs host:port")?;
        let host_header = String::new();
        return Ok(Head { connect: true, host, port, line: String::new(), host_header, headers: Vec::new(), rest });
    }
    let Some(after) = target.strip_prefix("http://") else {
        return Err("only CONNECT and absolute http:// URLs are proxied (set HTTP_PROXY, not a Host header)".into());
    };
    let (authority, path) = match after.find('/') {
        Some(i) => (&after[..i], &after[i..]),
        None => (after, "/"),
    };
    if authority.contains('@') {
        return Err("credentials in the URL are not proxied".into());
    }
    let (host, port) = policy::split_host_port(authority)?;
    let port = port.unwrap_or(80);
    let line = format!("{method} {path} {version}");
    Ok(Head { connect: false, host_header: host_header(&host, port, 80), host, port, line, headers, rest })
}

fn header_name(line: &str) -> String {
    line.split(':').next().unwrap_or_default().trim().to_ascii_lowercase()
}

#[cfg(test)]
impl Head {
    fn clone_for_test(&self) -> Head {
        Head {
            connect: self.connect,
            host: self.host.clone(),
            port: self.port,
            line: self.line.clone(),
            host_header: self.host_header.clone(),
            headers: self.headers.clone(),
            rest: self.rest.clone(),
        }
    }
}

impl Head {
    /// Whether a request may go out with `inject` (the operator's secrets) added: not one
    /// the upstream answers by echoing it whole (TRACE, TRACK), nor one with a chunked body,
    /// which the HTTP/1.0 it is sent as cannot carry.
    fn carries_secret_safely(&self, inject: &[(String, String)]) -> Result<(), String> {
        if inject.is_empty() {
            return Ok(());
        }
        let method = self.line.split(' ').next().unwrap_or_default();
        if method.eq_ignore_ascii_case("TRACE") || method.eq_ignore_ascii_case("TRACK") {
            return Err(format!("{method} is refused to a host the operator adds headers for (it echoes them)"));
        }
        if self.headers.iter().any(|h| header_name(h) == "transfer-encoding") {
            return Err(
                "a chunked request body is refused to a host the operator adds headers for: send Content-Length".into(),
            );
        }
        Ok(())
    }

    /// The plain HTTP head to send upstream, with `inject` in place of the sandbox's headers
    /// of the same names.
    fn forward(&self, inject: &[(String, String)]) -> Vec<u8> {
        // With a secret on the request, the answer must come whole and plain: masking reads
        // bytes, so no compression (Accept-Encoding, TE), no parts of it (Range) and no
        // chunks (the request goes as HTTP/1.0, to which no server answers chunked: a chunk
        // boundary inside an echoed secret would split it past the mask).
        let line = match (inject.is_empty(), self.line.strip_suffix("HTTP/1.1")) {
            (false, Some(start)) => format!("{start}HTTP/1.0"),
            _ => self.line.clone(),
        };
        let mut out = format!("{line}\r\nHost: {}\r\n", self.host_header);
        for h in &self.headers {
            let name = header_name(h);
            let dropped = !inject.is_empty()
                && matches!(name.as_str(), "accept-encoding" | "te" | "range" | "if-range" | "expect");
            if !dropped && !inject.iter().any(|(n, _)| n.eq_ignore_ascii_case(&name)) {
                out.push_str(h);
                out.push_str("\r\n");
            }
        }
        if !inject.is_empty() {
            out.push_str("Accept-Encoding: identity\r\n");
        }
        for (n, v) in inject {
            out.push_str(&format!("{n}: {v}\r\n"));
        }
        // One request per connection: a later request on it could not be checked.
        out.push_str("Connection: close\r\n\r\n");
        out.into_bytes()
    }
}

/// A header value as an echo may show it: as sent, JSON-escaped (`/` as `\/`), percent-
/// encoded, and in base64. Masking is best effort beyond these (docs/design.md D13): an
/// upstream that echoes requests back otherwise transformed is not a host to add secrets for.
fn secret_forms(value: &str) -> Vec<Vec<u8>> {
    use base64::Engine as _;
    let mut forms = vec![value.as_bytes().to_vec()];
    forms.push(value.replace('/', "\\/").into_bytes());
    let pct: String = value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    forms.push(pct.into_bytes());
    forms.push(base64::engine::general_purpose::STANDARD.encode(value).into_bytes());
    forms.sort();
    forms.dedup();
    forms
}

/// Masks every secret in a stream with '*' of the same length (lengths, and so
/// Content-Length, stay right), holding back just enough to catch one cut between chunks.
#[derive(Debug, Default)]
struct Scrubber {
    secrets: Vec<Vec<u8>>,
    pending: Vec<u8>,
}

impl Scrubber {
    fn new(secrets: Vec<Vec<u8>>) -> Self {
        Self { secrets, pending: Vec::new() }
    }

    fn hold(&self) -> usize {
        self.secrets.iter().map(Vec::len).max().unwrap_or(1).saturating_sub(1)
    }

    /// Bytes safe to send after `chunk`.
    fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.secrets.is_empty() {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        for s in &self.secrets {
            let mut i = 0;
            while let Some(at) = self.pending[i..].windows(s.len()).position(|w| w == s.as_slice()) {
                let start = i + at;
                self.pending[start..start + s.len()].fill(b'*');
                i = start + s.len();
            }
        }
        let keep = self.hold().min(self.pending.len());
        let send = self.pending.len() - keep;
        self.pending.drain(..send).collect()
    }

    /// What is held back, at the end of the stream (the upstream's answer ended, or the
    /// run's budget cut it): the held bytes may be the start of a secret whose rest never
    /// came, so from the first held byte that starts some masked form, the rest is masked.
    fn finish(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.pending);
        let start = (0..out.len()).find(|&i| self.secrets.iter().any(|s| s.starts_with(&out[i..])));
        if let Some(i) = start {
            out[i..].fill(b'*');
        }
        out
    }
}

async fn deny<W: tokio::io::AsyncWrite + Unpin>(sock: &mut W, status: &str, body: &str) {
    let body = format!("pyberth egress: {body}\n");
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\nX-Pyberth-Egress: denied\r\n\r\n",
        body.len()
    );
    let _ = sock.write_all(head.as_bytes()).await;
    let _ = sock.write_all(body.as_bytes()).await;
    let _ = sock.shutdown().await;
}

/// The address to connect to, checked, or why not.
async fn resolve(state: &Shared, host: &str, port: u16) -> Result<SocketAddr, String> {
    let (pinned, own) = {
        let s = state.read().unwrap_or_else(|e| e.into_inner());
        (s.pinned.get(host).copied(), s.own.clone())
    };
    // A literal got here only through a rule naming it, a pinned name through the operator:
    // both are the operator's own choice of address.
    if let Some(ip) = host.parse::<IpAddr>().ok().or(pinned) {
        return Ok(SocketAddr::new(ip, port));
    }
    let found = tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host((host, port)))
        .await
        .map_err(|_| format!("{host} did not resolve within {} s", RESOLVE_TIMEOUT.as_secs()))?
        .map_err(|e| format!("{host} does not resolve ({e})"))?
        .collect::<Vec<_>>();
    // Every answer is checked: a name with one public and one private address is refused,
    // and the one checked is the one connected to (no second lookup to rebind).
    for a in &found {
        if let Some(why) = policy::refused_range(a.ip()) {
            return Err(format!("{host} resolves to {} ({why}), which the sandbox may never reach", a.ip()));
        }
        if own.contains(&a.ip()) {
            return Err(format!("{host} resolves to {}, an address of the host or the proxy", a.ip()));
        }
    }
    found.first().copied().ok_or_else(|| format!("{host} has no address"))
}

async fn handle(mut sock: TcpStream, peer: SocketAddr, state: Shared, tx: mpsc::UnboundedSender<Report>) {
    let started = Instant::now();
    let local = match sock.local_addr() {
        Ok(a) => a.ip(),
        Err(_) => return,
    };
    let policy = state.read().unwrap_or_else(|e| e.into_inner()).policies.get(&local).cloned();
    let Some(policy) = policy else {
        // Not a session's network (the outbound bridge, or a session already gone).
        deny(&mut sock, "403 Forbidden", &format!("no egress policy for connections from {}", peer.ip())).await;
        return;
    };
    let head = match tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut sock)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return deny(&mut sock, "400 Bad Request", &e).await,
        Err(_) => return deny(&mut sock, "408 Request Timeout", "no request head within 10 s").await,
    };
    let mut record = Record {
        local,
        session: policy.session.clone(),
        principal: policy.principal.clone(),
        host: cut(&head.host, HOST_SHOWN),
        port: head.port,
        allowed: false,
        rule: String::new(),
        up: 0,
        down: 0,
        ms: 0,
        cut: false,
    };
    let host = policy::normalize_host(&head.host)
        .or_else(|| head.host.parse::<IpAddr>().ok().map(|ip| ip.to_string()))
        .unwrap_or_default();
    let verdict = match policy::first_match(&policy.rules, &host, head.port) {
        None if host.is_empty() => Err(format!("{:?} is not a host name", record.host)),
        None if head.host.parse::<IpAddr>().is_ok() => Err(format!(
            "{}:{} denied: IP literals are refused unless the operator allows that literal (use the host name)",
            head.host, head.port
        )),
        None => Err(format!(
            "{}:{} denied: not on this session's egress allow-list ({})",
            host,
            head.port,
            if policy.rules.is_empty() {
                "empty: the session is offline".to_owned()
            } else {
                policy.rules.iter().map(Rule::text).collect::<Vec<_>>().join(", ")
            }
        )),
        Some(rule) => Ok(rule.text().to_owned()),
    };
    let rule = match verdict {
        Ok(r) => r,
        Err(why) => {
            record.rule = why.clone();
            return refuse(&mut sock, &policy, record, "403 Forbidden", &why, started, &tx).await;
        }
    };
    let Ok(_slot) = policy.conns.clone().try_acquire_owned() else {
        record.rule = "too many connections open at once for this session (--egress-max-conns)".into();
        let why = format!("{host}:{} denied: {}", head.port, record.rule);
        return refuse(&mut sock, &policy, record, "429 Too Many Requests", &why, started, &tx).await;
    };
    if policy.budget.left.load(Ordering::SeqCst) == 0 {
        record.rule = "the run's egress byte budget is spent (--egress-max-mb)".into();
        let why = format!("{host}:{} denied: {}", head.port, record.rule);
        return refuse(&mut sock, &policy, record, "403 Forbidden", &why, started, &tx).await;
    }
    let upstream = match resolve(&state, &host, head.port).await {
        Ok(addr) => tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| format!("{host}:{} did not accept within {} s", head.port, CONNECT_TIMEOUT.as_secs()))
            .and_then(|r| r.map_err(|e| format!("{host}:{} refused the connection: {e}", head.port))),
        Err(why) => {
            record.rule = format!("{why} (rule {rule} matched the name)");
            let why = format!("{host}:{} denied: {}", head.port, record.rule);
            return refuse(&mut sock, &policy, record, "403 Forbidden", &why, started, &tx).await;
        }
    };
    let upstream = match upstream {
        Ok(u) => u,
        Err(why) => {
            record.rule = format!("allowed by {rule}, but {why}");
            return refuse(&mut sock, &policy, record, "502 Bad Gateway", &why, started, &tx).await;
        }
    };
    record.allowed = true;
    record.rule = rule;
    let scrub = Scrubber::new(policy.secrets.clone());
    let inject = policy.headers.get(&host).map(Vec::as_slice).unwrap_or_default();
    let mitm = state.read().unwrap_or_else(|e| e.into_inner()).mitm.clone();
    let (up, down) = match (head.connect, mitm) {
        // Headers for this host over HTTPS: TLS is terminated here to add them. Every other
        // host keeps a plain tunnel: the proxy sees nothing of it, and the sandbox's TLS is
        // checked end to end against the upstream's own certificate.
        (true, Some(mitm)) if !inject.is_empty() => {
            match intercept(sock, upstream, &host, head.port, head.rest, inject, &mitm, &policy.budget, scrub).await {
                Ok(n) => {
                    record.rule = format!("{} (TLS terminated to add the operator's headers)", record.rule);
                    n
                }
                Err(why) => {
                    record.allowed = false;
                    record.rule = format!("allowed by {}, but {why}", record.rule);
                    (0, 0)
                }
            }
        }
        (true, _) => {
            let _ = sock.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await;
            // Ciphertext: nothing to mask, and holding bytes back would stall a handshake.
            splice(sock, upstream, head.rest, &policy.budget, Scrubber::default(), false).await
        }
        (false, _) => match head.carries_secret_safely(inject) {
            Ok(()) => {
                let mut f = head.forward(inject);
                f.extend_from_slice(&head.rest);
                splice(sock, upstream, f, &policy.budget, scrub, true).await
            }
            Err(why) => {
                record.allowed = false;
                record.rule = format!("allowed by {}, but {why}", record.rule);
                deny(&mut sock, "400 Bad Request", &why).await;
                (0, 0)
            }
        },
    };
    record.up = up;
    record.down = down;
    record.cut = policy.budget.left.load(Ordering::SeqCst) == 0;
    record.ms = ms(started);
    let _ = tx.send(Report::Conn(record));
}

/// Reports a refused connection and answers it. Past the session's refusal rate the answer
/// waits: for one of the session's connection slots (so refusals count against
/// `--egress-max-conns`), then [`REFUSAL_PENALTY`]; such refusals are still reported (the
/// server counts them and logs only the first few).
async fn refuse(
    sock: &mut TcpStream,
    policy: &Policy,
    mut record: Record,
    status: &str,
    why: &str,
    started: Instant,
    tx: &mpsc::UnboundedSender<Report>,
) {
    let mut why = why.to_owned();
    let mut _slot = None;
    if !policy.refusals.take() {
        // Bounded like a head: a session whose slots are all held gets its answer anyway.
        _slot = tokio::time::timeout(HEAD_TIMEOUT, policy.conns.clone().acquire_owned()).await.ok();
        tokio::time::sleep(REFUSAL_PENALTY).await;
        let late = format!(
            " (refused too often: past {REFUSAL_RATE} refusals a second, each is answered after {} ms)",
            REFUSAL_PENALTY.as_millis()
        );
        record.rule.push_str(&late);
        why.push_str(&late);
    }
    record.ms = ms(started);
    let _ = tx.send(Report::Conn(record));
    deny(sock, status, &why).await;
}

fn ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A tunnel to a host that carries headers. When the sandbox starts TLS in it, the proxy
/// terminates it with a leaf of the per-server CA and opens a verified TLS connection to the
/// upstream; otherwise the tunnel holds plain HTTP. Either way one HTTP/1.1 request is
/// forwarded with `inject` set (it says `Connection: close`: a later request on the same
/// connection could not be given the headers).
#[allow(clippy::too_many_arguments)]
async fn intercept(
    mut sock: TcpStream,
    upstream: TcpStream,
    host: &str,
    port: u16,
    rest: Vec<u8>,
    inject: &[(String, String)],
    mitm: &Mitm,
    budget: &Budget,
    scrub: Scrubber,
) -> Result<(u64, u64), String> {
    let leaf = match mitm.server_config(host) {
        Ok(c) => c,
        Err(e) => {
            let why = format!("no certificate could be made for {host}: {e}");
            deny(&mut sock, "502 Bad Gateway", &why).await;
            return Err(why);
        }
    };
    sock.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await.map_err(|e| e.to_string())?;
    let first = match rest.first() {
        Some(b) => *b,
        None => {
            let mut b = [0u8; 1];
            match tokio::time::timeout(HEAD_TIMEOUT, sock.peek(&mut b)).await {
                Ok(Ok(1)) => b[0],
                _ => return Err("nothing sent through the tunnel within 10 s".into()),
            }
        }
    };
    let (r, w) = sock.into_split();
    let joined = tokio::io::join(std::io::Cursor::new(rest).chain(r), w);
    // 0x16: a TLS handshake record. The operator's headers go inside a tunnel only over TLS:
    // plaintext there (to a port the operator meant for TLS) is forwarded without them.
    if first != 0x16 {
        return forward_one(joined, upstream, host, port, 80, &[], budget, scrub).await;
    }
    let client = tokio::time::timeout(HEAD_TIMEOUT, tokio_rustls::TlsAcceptor::from(leaf).accept(joined))
        .await
        .map_err(|_| "no TLS handshake from the sandbox within 10 s".to_owned())?
        .map_err(|e| format!("TLS handshake with the sandbox failed: {e}"))?;
    let mut client = client;
    let name = rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(mitm.client.clone());
    let up = match tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, upstream)).await {
        Ok(Ok(u)) => u,
        Ok(Err(e)) => {
            let why = format!("{host}:{port}: TLS to the upstream failed, its certificate is not trusted here ({e})");
            deny(&mut client, "502 Bad Gateway", &why).await;
            return Err(why);
        }
        Err(_) => {
            let why = format!("{host}:{port}: no TLS handshake from the upstream within 10 s");
            deny(&mut client, "504 Gateway Timeout", &why).await;
            return Err(why);
        }
    };
    forward_one(client, up, host, port, 443, inject, budget, scrub).await
}

/// Reads one request head from `client`, sends it to `upstream` with `inject` set, and
/// splices the rest until the upstream's answer ends.
#[allow(clippy::too_many_arguments)]
async fn forward_one<C, U>(
    mut client: C,
    upstream: U,
    host: &str,
    port: u16,
    default_port: u16,
    inject: &[(String, String)],
    budget: &Budget,
    scrub: Scrubber,
) -> Result<(u64, u64), String>
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let head = match tokio::time::timeout(HEAD_TIMEOUT, read_inner_head(&mut client, host, port, default_port)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            deny(&mut client, "400 Bad Request", &e).await;
            return Err(format!("no request: {e}"));
        }
        Err(_) => {
            deny(&mut client, "408 Request Timeout", "no request head within 10 s").await;
            return Err("no request head within 10 s".into());
        }
    };
    if let Err(why) = head.carries_secret_safely(inject) {
        deny(&mut client, "400 Bad Request", &why).await;
        return Err(why);
    }
    let mut first = head.forward(inject);
    first.extend_from_slice(&head.rest);
    Ok(splice(client, upstream, first, budget, scrub, true).await)
}

/// Copies both ways until either side closes or the budget is spent; bytes each way. With
/// `one_request`, the connection ends when the upstream's answer does.
async fn splice<C, U>(
    client: C,
    upstream: U,
    first: Vec<u8>,
    budget: &Budget,
    mut scrub: Scrubber,
    one_request: bool,
) -> (u64, u64)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ur, mut uw) = tokio::io::split(upstream);
    let up_n = AtomicU64::new(0);
    let down_n = AtomicU64::new(0);
    let up = async {
        if !first.is_empty() {
            if !budget.take(first.len() as u64) || uw.write_all(&first).await.is_err() {
                return;
            }
            up_n.fetch_add(first.len() as u64, Ordering::Relaxed);
        }
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if !budget.take(n as u64) || uw.write_all(&buf[..n]).await.is_err() {
                break;
            }
            up_n.fetch_add(n as u64, Ordering::Relaxed);
        }
        let _ = uw.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match ur.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if !budget.take(n as u64) || cw.write_all(&scrub.push(&buf[..n])).await.is_err() {
                break;
            }
            down_n.fetch_add(n as u64, Ordering::Relaxed);
        }
        let _ = cw.write_all(&scrub.finish()).await;
        let _ = cw.shutdown().await;
    };
    tokio::pin!(up, down);
    if one_request {
        tokio::select! {
            () = &mut down => {}
            () = &mut up => (&mut down).await,
        }
    } else {
        tokio::join!(up, down);
    }
    (up_n.load(Ordering::Relaxed), down_n.load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reviewer's smuggling head, and its cousins: every one refused before anything is
    /// forwarded, so no second request of the sandbox's can carry the operator's headers.
    #[test]
    fn heads_that_could_smuggle_a_second_request_are_refused() {
        let bad = [
            "GET /a HTTP/1.1\r\nX: y\n\nGET /b HTTP/1.1\nHost: attacker.example\r\n\r\n",
            "GET /a HTTP/1.1\nHost: x\r\n\r\n",
            "GET /a HTTP/1.1\r\nX: a\rb\r\n\r\n",
            "GET /a HTTP/1.1\r\nX: a\x00b\r\n\r\n",
            "GET /a HTTP/1.1\r\nX : y\r\n\r\n",
            "GET /a HTTP/1.1\r\nX: y\r\n folded\r\n\r\n",
            "GET /a HTTP/1.1\r\n\tX: y\r\n\r\n",
            "GET /a HTTP/1.1\r\nno colon\r\n\r\n",
            "GET /a HTTP/1.1x\r\n\r\n",
            "GET /a HTTP/1.2\r\n\r\n",
            "G(T /a HTTP/1.1\r\n\r\n",
            "GET  /a HTTP/1.1\r\n\r\n",
            "GET /a\tb HTTP/1.1\r\n\r\n",
            "GET /a HTTP/1.1\r\nX: \x7f\r\n\r\n",
        ];
        for head in bad {
            assert!(split_head(head).is_err(), "{head:?} was accepted");
        }
        let ((m, t, v), headers) =
            split_head("POST /p?q=1 HTTP/1.1\r\nHost: forged\r\nX-A: b\tc\r\nProxy-Authorization: z\r\n\r\n")
                .expect("a plain head");
        assert_eq!((m, t, v), ("POST", "/p?q=1", "HTTP/1.1"));
        assert_eq!(headers, ["X-A: b\tc"], "Host and proxy headers dropped, a tab in a value kept");
    }

    #[test]
    fn a_request_carrying_a_secret_goes_whole_and_plain() {
        let (text, _) = (
            "GET /x HTTP/1.1\r\nRange: bytes=0-3\r\nTE: gzip\r\nAccept-Encoding: br\r\nIf-Range: x\r\nX-Keep: 1\r\n\r\n",
            (),
        );
        let ((m, t, v), headers) = split_head(text).expect("head");
        let head = Head {
            connect: false,
            host: "api.test".into(),
            port: 80,
            line: format!("{m} {t} {v}"),
            host_header: "api.test".into(),
            headers,
            rest: Vec::new(),
        };
        let inject = [("Authorization".to_owned(), "Bearer s".to_owned())];
        let out = String::from_utf8(head.forward(&inject)).expect("text");
        assert!(out.starts_with("GET /x HTTP/1.0\r\nHost: api.test\r\n"), "sent as HTTP/1.0: {out}");
        for gone in ["Range", "TE:", "br", "If-Range"] {
            assert!(!out.contains(gone), "{gone} kept: {out}");
        }
        assert!(out.contains("X-Keep: 1\r\n") && out.contains("Accept-Encoding: identity\r\n"), "{out}");
        assert!(out.contains("Authorization: Bearer s\r\n"), "{out}");
        // Without a secret the request goes as the sandbox sent it.
        assert!(String::from_utf8(head.forward(&[])).expect("text").starts_with("GET /x HTTP/1.1\r\n"));
        let trace = Head { line: "TRACE / HTTP/1.1".into(), ..head.clone_for_test() };
        assert!(trace.carries_secret_safely(&inject).is_err() && trace.carries_secret_safely(&[]).is_ok());
        let chunked = Head { headers: vec!["Transfer-Encoding: chunked".into()], ..head.clone_for_test() };
        assert!(chunked.carries_secret_safely(&inject).is_err());
        assert!(head.carries_secret_safely(&inject).is_ok());
    }

    #[test]
    fn echoed_secrets_are_masked_in_their_common_encodings() {
        let secret = "tok/en+1 2";
        let mut scrub = Scrubber::new(secret_forms(secret));
        let echo = format!("raw {secret} json {} pct {} b64 {}", secret.replace('/', "\\/"), "tok%2Fen%2B1%202", {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(secret)
        });
        let mut out = scrub.push(echo.as_bytes());
        out.extend(scrub.finish());
        let out = String::from_utf8(out).expect("text");
        assert_eq!(out.len(), echo.len(), "lengths kept");
        for form in secret_forms(secret) {
            let form = String::from_utf8(form).expect("text");
            assert!(!out.contains(&form), "{form} left in {out}");
        }
    }

    #[test]
    fn secrets_are_masked_across_chunk_boundaries() {
        let mut s = Scrubber::new(vec![b"s3cret-token".to_vec()]);
        let input = b"a s3cret-token b s3cr".to_vec();
        let mut out = s.push(&input);
        out.extend(s.push(b"et-token c"));
        out.extend(s.finish());
        assert_eq!(String::from_utf8(out).expect("utf-8"), "a ************ b ************ c");
        let mut none = Scrubber::new(Vec::new());
        assert_eq!(none.push(b"plain"), b"plain");
    }

    /// Every masked form of a secret, cut after each of its bytes: the prefix ahead of the
    /// cut held back and nothing of the secret after.
    fn cuts() -> Vec<(Vec<Vec<u8>>, Vec<u8>, usize)> {
        let forms = secret_forms("Bearer tok/en+1 2");
        let mut all = Vec::new();
        for form in &forms {
            for k in 1..form.len() {
                let mut first = b"....".to_vec();
                first.extend_from_slice(&form[..k]);
                all.push((forms.clone(), first, k));
            }
        }
        all
    }

    /// The reviewer's attack, at every cut: the upstream echoes the secret, and the run's
    /// byte budget ends between the read holding its start and the one holding the rest (or
    /// the upstream's answer just ends there). What reaches the sandbox ends masked.
    #[tokio::test]
    async fn a_secret_cut_between_two_reads_never_goes_out_in_part() {
        for (forms, first, k) in cuts() {
            for by_budget in [true, false] {
                let (client, mut sandbox) = tokio::io::duplex(1 << 16);
                let (upstream, mut echo) = tokio::io::duplex(1 << 16);
                let budget = Budget::default();
                budget.left.store(first.len() as u64, Ordering::SeqCst);
                let rest = forms.iter().find(|f| f.starts_with(&first[4..])).map(|f| f[k..].to_vec());
                let spliced =
                    async { splice(client, upstream, Vec::new(), &budget, Scrubber::new(forms.clone()), true).await };
                let upstream_side = async {
                    echo.write_all(&first).await.expect("first read");
                    // The proxy takes the first read before the rest comes.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    if by_budget {
                        let _ = echo.write_all(&rest.unwrap_or_default()).await;
                    }
                    drop(echo);
                    let mut got = Vec::new();
                    sandbox.read_to_end(&mut got).await.expect("read");
                    got
                };
                let (_, got) = tokio::join!(spliced, upstream_side);
                let want = format!("....{}", "*".repeat(k));
                assert_eq!(
                    String::from_utf8_lossy(&got),
                    want,
                    "cut after {k} bytes of a form, by budget: {by_budget}"
                );
            }
        }
    }

    /// A leaf the proxy mints chains to the certificate the server gives sandboxes (made
    /// apart, from the same key and fields), for its own name only.
    #[tokio::test]
    async fn minted_leaves_chain_to_the_servers_ca_for_their_name_only() {
        let (ca_pem, key) = new_ca(&["api.example.com".to_owned()]).expect("CA");
        let mitm = Mitm::new(&key, Some(&ca_pem)).expect("mitm");
        // The last: a leaf for a name the CA is not for (a proxy made to mint one) is refused.
        for (leaf, asked, ok) in [
            ("api.example.com", "api.example.com", true),
            ("api.example.com", "other.example.com", false),
            ("other.example.com", "other.example.com", false),
        ] {
            let (a, b) = tokio::io::duplex(1 << 16);
            let acceptor = tokio_rustls::TlsAcceptor::from(mitm.server_config(leaf).expect("leaf"));
            let connector = tokio_rustls::TlsConnector::from(mitm.client.clone());
            let name = rustls::pki_types::ServerName::try_from(asked.to_owned()).expect("name");
            let (_, client) = tokio::join!(acceptor.accept(a), connector.connect(name, b));
            assert_eq!(client.is_ok(), ok, "{leaf} asked as {asked}: {:?}", client.err());
        }
        assert!(
            !format!(
                "{:?}",
                Command::Config {
                    pinned: HashMap::new(),
                    own: Vec::new(),
                    max_conns: 1,
                    ca_key: Some(key.clone()),
                    roots: None,
                }
            )
            .contains("PRIVATE")
        );
    }

    #[test]
    fn injected_headers_replace_the_sandboxes_own() {
        let head = Head {
            connect: false,
            host: "h".into(),
            port: 80,
            line: "GET / HTTP/1.1".into(),
            host_header: "h".into(),
            headers: vec!["X-A: 1".into(), "accept-encoding: gzip".into(), "authorization: forged".into()],
            rest: Vec::new(),
        };
        let out = String::from_utf8(head.forward(&[("Authorization".into(), "Bearer real".into())])).expect("utf-8");
        assert_eq!(
            out,
            "GET / HTTP/1.0\r\nHost: h\r\nX-A: 1\r\nAccept-Encoding: identity\r\nAuthorization: Bearer real\r\nConnection: close\r\n\r\n"
        );
    }
}
