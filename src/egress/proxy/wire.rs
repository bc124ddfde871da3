//! What the server and the proxy say to each other: commands as JSON lines on the proxy's
//! stdin, reports as JSON lines on its stdout.

use std::collections::HashMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

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
        /// Sessions are told apart by the connection's source address (`local` of each
        /// command names the session's own address), not by the proxy's address it arrived
        /// on: on Kubernetes every session reaches the one proxy pod at one address, and a pod
        /// cannot forge its source (no NET_RAW, NET_ADMIN).
        #[serde(default)]
        by_peer: bool,
    },
    /// The policy of the session whose network reaches the proxy at `local`.
    Set {
        /// The proxy's address on the session's network (keyed by peer: the session's address).
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
        /// Keyed by peer: the secret its connections must carry (`Proxy-Authorization: Basic`
        /// of `pyberth:<pass>`, from the proxy URL in its variables). An address outlives its
        /// pod on a cluster; the pass does not follow it to the next pod.
        #[serde(default)]
        pass: Option<SecretPem>,
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

/// A secret (a private key in PEM, a session's pass) whose `Debug` does not show it.
#[derive(Clone, Serialize, Deserialize)]
pub struct SecretPem(pub String);

impl Command {
    /// The policy of session `session` of `principal`, keyed by `local`.
    pub fn set(
        local: IpAddr,
        principal: &str,
        session: &str,
        allow: Vec<String>,
        headers: HashMap<String, Vec<(String, String)>>,
    ) -> Self {
        Self::Set { local, session: session.to_owned(), principal: principal.to_owned(), allow, headers, pass: None }
    }

    /// The same, its connections required to carry `pass` (`None`: none required).
    pub fn with_pass(mut self, pass: Option<&str>) -> Self {
        if let Self::Set { pass: p, .. } = &mut self {
            *p = pass.map(|s| SecretPem(s.to_owned()));
        }
        self
    }
}

impl std::fmt::Debug for SecretPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretPem(..)")
    }
}

/// A report to the server.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Report {
    /// Listening; policies may come.
    Ready {
        /// It checks sessions' passes (`Command::Set::pass`): an older proxy's image does not
        /// say so, and keyed by peer it must not be used.
        #[serde(default)]
        passes: bool,
    },
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
    /// The proxy's address it arrived on, or its source when keyed by peer (names the session).
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

/// The status of a connection without its session's pass.
pub(super) const AUTH_REQUIRED: &str = "407 Proxy Authentication Required";

/// Answers the sandbox with `status` and a one-line body saying why, and closes.
pub(super) async fn deny<W: tokio::io::AsyncWrite + Unpin>(sock: &mut W, status: &str, body: &str) {
    use tokio::io::AsyncWriteExt as _;
    let body = format!("pyberth egress: {body}\n");
    // A 407 names its scheme, as HTTP asks: clients that send credentials only when
    // challenged then send them.
    let challenge = if status == AUTH_REQUIRED { "Proxy-Authenticate: Basic realm=\"pyberth\"\r\n" } else { "" };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n{challenge}Connection: close\r\nX-Pyberth-Egress: denied\r\n\r\n",
        body.len()
    );
    let _ = sock.write_all(head.as_bytes()).await;
    let _ = sock.write_all(body.as_bytes()).await;
    let _ = sock.shutdown().await;
}
