//! One connection from a session: its head read, the policy's verdict, admission (slots,
//! budget, the refusal rate), resolution and connection, then the splice, and its record.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpStream;

use super::head::{Head, read_head};
use super::mitm::intercept;
use super::report::Reports;
use super::scrub::Scrubber;
use super::splice::splice;
use super::state::{Policy, REFUSAL_PENALTY, REFUSAL_RATE, Shared};
use super::wire::Record;
use super::wire::{AUTH_REQUIRED, deny};
use super::{CONNECT_TIMEOUT, HEAD_TIMEOUT};
use crate::egress::policy::{self, Rule};

/// Time a name has to resolve, and an upstream to accept.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// A host name is at most 253 characters; a host reported is cut there.
const HOST_SHOWN: usize = 253;

/// `text` cut to `max` bytes on a character boundary, saying how much was left out.
fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end == text.len() { text.to_owned() } else { format!("{}… (+{} bytes)", &text[..end], text.len() - end) }
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

/// Serves one connection accepted on the proxy's address `local`-side, until it ends.
pub(super) async fn handle(mut sock: TcpStream, peer: SocketAddr, state: Shared, reports: Reports) {
    let started = Instant::now();
    let by_peer = state.read().unwrap_or_else(|e| e.into_inner()).by_peer;
    // The session's key: the proxy's own address on the session's network (Docker), or the
    // session pod's address (Kubernetes, one proxy address for all).
    let local = match sock.local_addr() {
        Ok(_) if by_peer => peer.ip().to_canonical(),
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
    let record = Record {
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
    let mut c = Conn { sock, policy, record, started, reports };
    // Keyed by peer, the address alone is not the session: a pod the cluster gave a gone
    // pod's address has not that pod's pass (and a policy without one serves nobody).
    let passed = match &c.policy.pass {
        Some(wanted) => head.proxy_auth.as_deref().is_some_and(|given| super::head::same_secret(given, wanted)),
        None => !by_peer,
    };
    if !passed {
        let why = "this address's session pass is missing or wrong: connections must use the proxy URL of the \
                   session's HTTP_PROXY, credentials included";
        return c.refuse(AUTH_REQUIRED, "no session pass".into(), why).await;
    }
    let rule = match verdict(&c.policy, &head, &host, &c.record.host) {
        Ok(r) => r,
        Err(why) => return c.refuse("403 Forbidden", why.clone(), &why).await,
    };
    let Ok(_slot) = c.policy.conns.clone().try_acquire_owned() else {
        let rule = "too many connections open at once for this session (--egress-max-conns)";
        return c.refuse("429 Too Many Requests", rule.into(), &format!("{host}:{} denied: {rule}", head.port)).await;
    };
    if c.policy.budget.left.load(Ordering::SeqCst) == 0 {
        let rule = "the run's egress byte budget is spent (--egress-max-mb)";
        return c.refuse("403 Forbidden", rule.into(), &format!("{host}:{} denied: {rule}", head.port)).await;
    }
    let upstream = match connect(&state, &host, head.port, &rule).await {
        Ok(u) => u,
        Err((status, rule, why)) => return c.refuse(status, rule, &why).await,
    };
    c.record.allowed = true;
    c.record.rule = rule;
    forward(c, upstream, head, &host, &state).await;
}

/// The rule that allows `host` (normalized; empty: not a name), or why none does. `shown`
/// is the host as reported (cut).
fn verdict(policy: &Policy, head: &Head, host: &str, shown: &str) -> Result<String, String> {
    match policy::first_match(&policy.rules, host, head.port) {
        None if host.is_empty() => Err(format!("{shown:?} is not a host name")),
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
    }
}

/// A connection to `host:port`, which `rule` allowed; or the status, the record's rule and
/// the sandbox's answer of a refusal.
async fn connect(
    state: &Shared,
    host: &str,
    port: u16,
    rule: &str,
) -> Result<TcpStream, (&'static str, String, String)> {
    let addr = match resolve(state, host, port).await {
        Ok(addr) => addr,
        Err(why) => {
            let rule = format!("{why} (rule {rule} matched the name)");
            let why = format!("{host}:{port} denied: {rule}");
            return Err(("403 Forbidden", rule, why));
        }
    };
    tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| format!("{host}:{port} did not accept within {} s", CONNECT_TIMEOUT.as_secs()))
        .and_then(|r| r.map_err(|e| format!("{host}:{port} refused the connection: {e}")))
        .map_err(|why| ("502 Bad Gateway", format!("allowed by {rule}, but {why}"), why))
}

/// An allowed connection, its upstream connected: tunnel, intercept or forward, then report.
async fn forward(c: Conn, upstream: TcpStream, head: Head, host: &str, state: &Shared) {
    let Conn { mut sock, policy, mut record, started, reports } = c;
    let scrub = Scrubber::new(policy.secrets.clone());
    let inject = policy.headers.get(host).map(Vec::as_slice).unwrap_or_default();
    let mitm = state.read().unwrap_or_else(|e| e.into_inner()).mitm.clone();
    let (up, down) = match (head.connect, mitm) {
        // Headers for this host over HTTPS: TLS is terminated here to add them. Every other
        // host keeps a plain tunnel: the proxy sees nothing of it, and the sandbox's TLS is
        // checked end to end against the upstream's own certificate.
        (true, Some(mitm)) if !inject.is_empty() => {
            match intercept(sock, upstream, host, head.port, head.rest, inject, &mitm, &policy.budget, scrub).await {
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
    reports.conn(record);
}

/// A connection between its head and its record.
struct Conn {
    sock: TcpStream,
    policy: Arc<Policy>,
    record: Record,
    started: Instant,
    reports: Reports,
}

impl Conn {
    /// Reports a refusal (`rule` in the record) and answers it (`why` to the sandbox). Past
    /// the session's refusal rate the answer waits: for one of the session's connection slots
    /// (so refusals count against `--egress-max-conns`), then [`REFUSAL_PENALTY`]. Such
    /// refusals are still reported: the server counts them and logs only the first few.
    async fn refuse(mut self, status: &str, rule: String, why: &str) {
        let mut why = why.to_owned();
        self.record.rule = rule;
        let mut _slot = None;
        if !self.policy.refusals.take() {
            // Bounded like a head: a session whose slots are all held gets its answer anyway.
            _slot = tokio::time::timeout(HEAD_TIMEOUT, self.policy.conns.clone().acquire_owned()).await.ok();
            tokio::time::sleep(REFUSAL_PENALTY).await;
            let late = format!(
                " (refused too often: past {REFUSAL_RATE} refusals a second, each is answered after {} ms)",
                REFUSAL_PENALTY.as_millis()
            );
            self.record.rule.push_str(&late);
            why.push_str(&late);
        }
        self.record.ms = ms(self.started);
        self.reports.conn(self.record);
        deny(&mut self.sock, status, &why).await;
    }
}

/// Milliseconds since `since`.
pub(super) fn ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}
