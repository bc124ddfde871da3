//! Egress rules: what a session may reach, how a caller narrows them, and which addresses
//! are never reached whatever the rules say.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Ports a rule without one allows: plain HTTP and HTTPS.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// The host part of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostPat {
    /// `*`: any public name (never an IP literal).
    Any,
    /// One name.
    Exact(String),
    /// `*.example.com`: names below example.com (not example.com itself); holds "example.com".
    Below(String),
    /// An IP literal an operator wrote: the one way a literal is allowed.
    Ip(IpAddr),
}

/// One entry of an allow-list: `pypi.org`, `*.githubusercontent.com`, `api.example.com:8443`,
/// `*`, or an IP literal (`10.0.0.5:8080`, `[fd00::1]:443`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    host: HostPat,
    /// `None`: the default ports.
    port: Option<u16>,
    /// As written (normalised), for messages.
    text: String,
}

/// A host name as DNS knows it: lowercase, no trailing dot, letters, digits, '-' and '_'.
pub fn normalize_host(host: &str) -> Option<String> {
    let h = host.trim_end_matches('.').to_ascii_lowercase();
    let ok = !h.is_empty()
        && h.len() <= 253
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                && !l.starts_with('-')
        });
    ok.then_some(h)
}

/// Splits `host[:port]` and `[v6][:port]`.
pub fn split_host_port(s: &str) -> Result<(String, Option<u16>), String> {
    let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| format!("{p:?} is not a port"));
    if let Some(rest) = s.strip_prefix('[') {
        let (h, tail) = rest.split_once(']').ok_or_else(|| format!("{s:?}: unclosed '['"))?;
        return match tail {
            "" => Ok((h.to_owned(), None)),
            t => Ok((h.to_owned(), Some(port(t.strip_prefix(':').ok_or_else(|| format!("{s:?}: bad port"))?)?))),
        };
    }
    match s.rsplit_once(':') {
        Some((h, _)) if h.contains(':') => Ok((s.to_owned(), None)), // a bare IPv6 literal
        Some((h, p)) => Ok((h.to_owned(), Some(port(p)?))),
        None => Ok((s.to_owned(), None)),
    }
}

impl Rule {
    /// Parses one entry; the error says what is wrong with it.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (host, port) = split_host_port(s)?;
        let host = if host == "*" {
            HostPat::Any
        } else if let Ok(ip) = host.parse::<IpAddr>() {
            HostPat::Ip(ip)
        } else if let Some(rest) = host.strip_prefix("*.") {
            HostPat::Below(normalize_host(rest).filter(|r| r.contains('.') || r == "localhost").ok_or_else(|| {
                format!("{s:?}: a wildcard covers names below a domain of two labels or more, e.g. *.example.com")
            })?)
        } else {
            HostPat::Exact(normalize_host(&host).ok_or_else(|| {
                format!(
                    "{s:?} is not a host name: use a name (pypi.org), *.domain, * or an IP literal, optionally :port"
                )
            })?)
        };
        let mut rule = Self { host, port, text: String::new() };
        rule.text = rule.render();
        Ok(rule)
    }

    fn render(&self) -> String {
        let h = match &self.host {
            HostPat::Any => "*".to_owned(),
            HostPat::Exact(h) => h.clone(),
            HostPat::Below(d) => format!("*.{d}"),
            HostPat::Ip(IpAddr::V6(ip)) if self.port.is_some() => format!("[{ip}]"),
            HostPat::Ip(ip) => ip.to_string(),
        };
        match self.port {
            Some(p) => format!("{h}:{p}"),
            None => h,
        }
    }

    /// The rule as text.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn ports_allow(&self, port: u16) -> bool {
        match self.port {
            Some(p) => p == port,
            None => DEFAULT_PORTS.contains(&port),
        }
    }

    /// Whether the rule allows `host` (normalised, or an IP literal) on `port`.
    pub fn allows(&self, host: &str, port: u16) -> bool {
        if !self.ports_allow(port) {
            return false;
        }
        let literal = host.parse::<IpAddr>().ok();
        match (&self.host, literal) {
            (HostPat::Ip(ip), Some(l)) => *ip == l,
            (_, Some(_)) | (HostPat::Ip(_), None) => false,
            (HostPat::Any, None) => true,
            (HostPat::Exact(h), None) => h == host,
            (HostPat::Below(d), None) => host.strip_suffix(d.as_str()).is_some_and(|p| p.ends_with('.') && p.len() > 1),
        }
    }

    /// Whether everything this rule allows, `bound` allows too.
    pub fn within(&self, bound: &Rule) -> bool {
        let ports = match (self.port, bound.port) {
            (Some(p), _) => bound.ports_allow(p),
            (None, Some(_)) => false,
            (None, None) => true,
        };
        let hosts = match (&self.host, &bound.host) {
            (_, HostPat::Any) => !matches!(self.host, HostPat::Ip(_)),
            (HostPat::Ip(a), HostPat::Ip(b)) => a == b,
            (HostPat::Exact(h), HostPat::Exact(b)) => h == b,
            (HostPat::Exact(h), HostPat::Below(d)) => h.strip_suffix(d.as_str()).is_some_and(|p| p.ends_with('.')),
            (HostPat::Below(a), HostPat::Below(d)) => {
                a == d || a.strip_suffix(d.as_str()).is_some_and(|p| p.ends_with('.'))
            }
            _ => false,
        };
        ports && hosts
    }
}

/// Parses an allow-list; errors name the entry.
pub fn parse_list(entries: &[String]) -> Result<Vec<Rule>, String> {
    if entries.len() > 256 {
        return Err("an allow-list holds at most 256 entries".into());
    }
    entries.iter().map(|e| Rule::parse(e)).collect()
}

/// A caller's list checked against the list in force: every entry must be within it (a caller
/// narrows, never widens). Returns the caller's list, normalised.
pub fn narrow(bound: &[Rule], asked: &[String]) -> Result<Vec<Rule>, String> {
    let asked = parse_list(asked)?;
    for a in &asked {
        if !bound.iter().any(|b| a.within(b)) {
            let now: Vec<&str> = bound.iter().map(Rule::text).collect();
            return Err(format!(
                "{:?} is not within the session's allow-list ({}): a caller may narrow the list, never widen it",
                a.text(),
                if now.is_empty() { "empty: offline".to_owned() } else { now.join(", ") }
            ));
        }
    }
    Ok(asked)
}

/// The first rule allowing `host:port`, or `None`.
pub fn first_match<'a>(rules: &'a [Rule], host: &str, port: u16) -> Option<&'a Rule> {
    rules.iter().find(|r| r.allows(host, port))
}

/// Why an address is never connected to (after resolution), or `None` for a public one. The
/// documentation ranges are not refused: on hosts behind an intercepting proxy every public
/// name may resolve into one.
pub fn refused_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return refused_v4(v4);
            }
            refused_v6(v6)
        }
    }
}

fn refused_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    if ip.is_unspecified() || o[0] == 0 {
        Some("unspecified")
    } else if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_private() {
        Some("private (RFC 1918)")
    } else if o[0] == 100 && (o[1] & 0xc0) == 64 {
        Some("shared address space (CGNAT, 100.64.0.0/10)")
    } else if ip.is_link_local() {
        Some("link-local (metadata services included)")
    } else if ip.is_multicast() || ip.is_broadcast() || o[0] >= 240 {
        Some("multicast, broadcast or reserved")
    } else if o[0] == 192 && o[1] == 0 && o[2] == 0 {
        Some("IETF protocol assignments (192.0.0.0/24)")
    } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
        Some("benchmarking (198.18.0.0/15)")
    } else {
        None
    }
}

fn refused_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_unspecified() {
        Some("unspecified")
    } else if ip.is_loopback() {
        Some("loopback")
    } else if (s[0] & 0xfe00) == 0xfc00 {
        Some("unique local (ULA, fc00::/7)")
    } else if (s[0] & 0xffc0) == 0xfe80 {
        Some("link-local")
    } else if (s[0] & 0xffc0) == 0xfec0 {
        Some("site-local (deprecated, fec0::/10)")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if s[0] == 0x64 && s[1] == 0xff9b {
        Some("NAT64 (may reach private IPv4)")
    } else if s[0] == 0x2002 || (s[0] == 0x2001 && s[1] == 0) {
        Some("6to4 or Teredo (may reach private IPv4)")
    } else if s[..6] == [0; 6] {
        Some("IPv4-compatible (deprecated)")
    } else {
        None
    }
}

/// Headers the proxy adds to plain HTTP requests, by host: (name, value), values secret.
pub type Headers = HashMap<String, Vec<(String, String)>>;

/// [`Headers`] whose `Debug` shows hosts and header names, never values.
#[derive(Clone, Default)]
pub struct SecretHeaders(pub Headers);

impl std::fmt::Debug for SecretHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: HashMap<&String, Vec<&String>> =
            self.0.iter().map(|(h, v)| (h, v.iter().map(|(n, _)| n).collect())).collect();
        write!(f, "SecretHeaders({names:?})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Rule {
        Rule::parse(s).expect(s)
    }

    #[test]
    fn rules_match_names_wildcards_ports_and_literals() {
        assert!(r("pypi.org").allows("pypi.org", 443));
        assert!(r("pypi.org").allows("pypi.org", 80));
        assert!(!r("pypi.org").allows("pypi.org", 8443));
        assert!(!r("pypi.org").allows("evil-pypi.org", 443));
        assert!(r("api.example.com:8443").allows("api.example.com", 8443));
        assert!(!r("api.example.com:8443").allows("api.example.com", 443));
        assert!(r("*.example.com").allows("a.b.example.com", 443));
        assert!(!r("*.example.com").allows("example.com", 443));
        assert!(!r("*.example.com").allows("badexample.com", 443));
        assert!(r("*").allows("anything.org", 80));
        assert!(!r("*").allows("10.0.0.1", 80), "* never covers a literal");
        assert!(!r("*.0.0.1").allows("10.0.0.1", 80));
        assert!(r("10.0.0.5:8000").allows("10.0.0.5", 8000));
        assert!(!r("pypi.org").allows("10.0.0.5", 443));
        assert!(r("[fd00::1]:443").allows("fd00::1", 443));
        assert_eq!(r("PyPI.org.").text(), "pypi.org");
        for bad in ["", "a b", "*.com", "x:0", "x:99999", "ht/tp", "-x.org"] {
            assert!(Rule::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn callers_narrow_and_never_widen() {
        let bound = parse_list(&["*.example.com".into(), "pypi.org".into(), "api.x.org:8443".into()]).expect("list");
        assert!(narrow(&bound, &["a.example.com".into(), "*.b.example.com".into()]).is_ok());
        assert!(narrow(&bound, &["pypi.org:443".into()]).is_ok());
        assert!(narrow(&bound, &[]).is_ok());
        let e = narrow(&bound, &["example.com".into()]).expect_err("the apex is not below");
        assert!(e.contains("never widen"), "{e}");
        assert!(narrow(&bound, &["pypi.org:8080".into()]).is_err());
        assert!(narrow(&bound, &["api.x.org".into()]).is_err(), "default ports are not 8443");
        assert!(narrow(&bound, &["*".into()]).is_err());
        assert!(narrow(&parse_list(&["*".into()]).expect("any"), &["10.0.0.1".into()]).is_err());
    }

    #[test]
    fn ranges_refused_after_resolution() {
        for bad in [
            "127.0.0.1",
            "10.1.2.3",
            "172.17.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "169.254.169.254",
            "0.0.0.0",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "fd00::1",
            "fec0::1",
            "feff:ffff::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::",
            "64:ff9b::a00:1",
        ] {
            assert!(refused_range(bad.parse().expect(bad)).is_some(), "{bad}");
        }
        for good in ["203.0.113.80", "151.101.0.223", "2a04:4e42::223"] {
            assert_eq!(refused_range(good.parse().expect(good)), None, "{good}");
        }
    }
}
