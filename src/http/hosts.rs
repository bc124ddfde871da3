//! `Host` and `Origin` checks in front of `/mcp`, so a page elsewhere (DNS rebinding, or a
//! cross-site request from a browser) cannot reach the MCP endpoint of a local server.
//!
//! rmcp 3.9 has a Host check of its own, but it reads the header with `http::uri::Authority`,
//! whose port is `None` when it is not a number: `Host: localhost:evil.com` passed as
//! `localhost` on any port. It checks `Origin` only against a list of origins we would have to
//! repeat. Both headers are parsed strictly here; rmcp's check stays behind this one.

use std::net::Ipv6Addr;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::Error;

/// Hosts every server allows: the loopback names.
const LOOPBACK: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

/// A host and an optional port, as a `Host` header or an `Origin` carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Authority {
    /// Lowercase; an IPv6 address in its canonical form, without brackets.
    host: String,
    port: Option<u16>,
}

impl Authority {
    /// Parses `host[:port]` (RFC 9110 §7.2): a DNS name or an IPv4 address, or an IPv6 address
    /// in brackets, then an optional decimal port below 65536. Anything else, such as user
    /// information, a second colon or a port that is not a number, is `None`.
    pub(super) fn parse(s: &str) -> Option<Self> {
        let (host, port) = match s.strip_prefix('[') {
            Some(rest) => {
                let (ip, after) = rest.split_once(']')?;
                let ip: Ipv6Addr = ip.parse().ok()?;
                let port = match after {
                    "" => None,
                    p => Some(parse_port(p.strip_prefix(':')?)?),
                };
                (ip.to_string(), port)
            }
            None => {
                let (host, port) = match s.split_once(':') {
                    Some((h, p)) => (h, Some(parse_port(p)?)),
                    None => (s, None),
                };
                let name_char = |b: u8| b.is_ascii_alphanumeric() || b"-._".contains(&b);
                if host.is_empty() || !host.bytes().all(name_char) {
                    return None;
                }
                (host.to_ascii_lowercase(), port)
            }
        };
        Some(Authority { host, port })
    }

    /// An `--allowed-host` entry: `host[:port]`, or a bare IPv6 address.
    fn parse_allowed(s: &str) -> Option<Self> {
        let s = s.trim();
        match s.parse::<Ipv6Addr>() {
            Ok(ip) => Some(Authority { host: ip.to_string(), port: None }),
            Err(_) => Self::parse(s),
        }
    }
}

fn parse_port(p: &str) -> Option<u16> {
    if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    p.parse().ok()
}

/// What an `Origin` header names.
#[derive(Debug, PartialEq, Eq)]
enum Origin {
    /// `null`: a sandboxed frame, a file, a redirect across origins.
    Null,
    /// `scheme://host[:port]`, the port filled in from the scheme when absent.
    Site(Authority),
}

impl Origin {
    fn parse(s: &str) -> Option<Self> {
        if s == "null" {
            return Some(Origin::Null);
        }
        let (scheme, rest) = s.split_once("://")?;
        let mut site = Authority::parse(rest)?;
        if site.port.is_none() {
            site.port = match scheme.to_ascii_lowercase().as_str() {
                "http" => Some(80),
                "https" => Some(443),
                _ => None,
            };
        }
        Some(Origin::Site(site))
    }
}

/// The hosts clients may name this server by: the loopback names and `--allowed-host`.
#[derive(Debug)]
pub(super) struct AllowedHosts(Vec<Authority>);

impl AllowedHosts {
    /// The loopback names plus `extra`; an entry that is not `host[:port]` is an error.
    pub(super) fn new(extra: &[String]) -> Result<Self, Error> {
        let mut hosts = Vec::new();
        for entry in LOOPBACK.iter().copied().chain(extra.iter().map(String::as_str)) {
            hosts.push(Authority::parse_allowed(entry).ok_or_else(|| Error::AllowedHost(entry.to_owned()))?);
        }
        Ok(AllowedHosts(hosts))
    }

    /// An entry without a port allows any port; one with a port, that port only.
    fn allows(&self, a: &Authority) -> bool {
        self.0.iter().any(|e| e.host == a.host && e.port.is_none_or(|p| a.port == Some(p)))
    }
}

fn refuse(status: StatusCode, message: String) -> Response {
    tracing::debug!(%status, "{message}");
    let mut resp = (status, axum::Json(serde_json::json!({ "error": message }))).into_response();
    resp.extensions_mut().insert(super::Refused("host"));
    resp
}

/// Refuses a request whose `Host` is not an allowed host, or whose `Origin` is present and not
/// on an allowed host.
pub(super) async fn check(allowed: Arc<AllowedHosts>, req: Request, next: Next) -> Response {
    let Some(host) = req.headers().get(header::HOST) else {
        return refuse(StatusCode::BAD_REQUEST, "a Host header is required".into());
    };
    let host = String::from_utf8_lossy(host.as_bytes());
    match Authority::parse(&host) {
        None => return refuse(StatusCode::BAD_REQUEST, format!("the Host header `{host}` is not host[:port]")),
        Some(a) if !allowed.allows(&a) => {
            let message = format!(
                "the Host `{host}` is not allowed: clients must name this server by localhost, 127.0.0.1, ::1 \
                 or a host it was started with --allowed-host (against DNS rebinding)"
            );
            return refuse(StatusCode::FORBIDDEN, message);
        }
        Some(_) => {}
    }
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let origin = String::from_utf8_lossy(origin.as_bytes());
        let why = match Origin::parse(&origin) {
            Some(Origin::Site(site)) if allowed.allows(&site) => None,
            Some(Origin::Site(site)) => Some(format!(
                "requests from pages at {} are refused: browsers may call this server only from pages on an \
                 allowed host. If pages there must, start the server with --allowed-host {}",
                site.host, site.host
            )),
            Some(Origin::Null) => Some(
                "requests from pages with Origin null are refused: browsers may call this server only from \
                 pages on an allowed host (localhost, 127.0.0.1, ::1, or one given with --allowed-host)"
                    .into(),
            ),
            None => Some(format!(
                "the Origin `{origin}` is not scheme://host[:port]; browsers may call this server only from \
                 pages on an allowed host (localhost, 127.0.0.1, ::1, or one given with --allowed-host)"
            )),
        };
        if let Some(why) = why {
            return refuse(StatusCode::FORBIDDEN, why);
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(host: &str, port: Option<u16>) -> Option<Authority> {
        Some(Authority { host: host.into(), port })
    }

    #[test]
    fn host_and_port_are_parsed_strictly() {
        assert_eq!(Authority::parse("localhost"), a("localhost", None));
        assert_eq!(Authority::parse("LocalHost:8080"), a("localhost", Some(8080)));
        assert_eq!(Authority::parse("127.0.0.1:1"), a("127.0.0.1", Some(1)));
        assert_eq!(Authority::parse("[::1]"), a("::1", None));
        assert_eq!(Authority::parse("[0:0:0:0:0:0:0:1]:443"), a("::1", Some(443)));
        for bad in [
            "",
            ":80",
            "localhost:",
            "localhost:evil.com",
            "localhost:99999",
            "localhost:80:81",
            "localhost:+80",
            "evil.com@localhost",
            "127.0.0.1:1@evil.com",
            "local host",
            "[::1]:evil",
            "[::1]x",
            "[evil]",
            "::1",
            "[fe80::1%25eth0]",
        ] {
            assert_eq!(Authority::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn allowed_hosts_and_origins() {
        let allowed = AllowedHosts::new(&["pyberth.internal:8443".into(), "Team.Example".into()]).expect("valid");
        let allows = |h: &str| Authority::parse(h).is_some_and(|a| allowed.allows(&a));
        assert!(allows("localhost:1234") && allows("127.0.0.1") && allows("[::1]:80"));
        assert!(allows("pyberth.internal:8443") && allows("team.example:9"));
        assert!(!allows("pyberth.internal") && !allows("pyberth.internal:8444") && !allows("localhost.evil.com"));
        let origin = |o: &str| match Origin::parse(o) {
            Some(Origin::Site(s)) => allowed.allows(&s),
            _ => false,
        };
        assert!(origin("http://localhost:5173") && origin("https://pyberth.internal:8443"));
        assert!(!origin("https://pyberth.internal") && !origin("http://evil.example") && !origin("null"));
        assert!(!origin("localhost") && !origin("http://localhost/path"));
        assert_eq!(Origin::parse("null"), Some(Origin::Null));
        assert!(AllowedHosts::new(&["bad host".into()]).is_err());
        assert!(AllowedHosts::new(&["::1".into(), "[::1]:8080".into()]).is_ok());
    }
}
