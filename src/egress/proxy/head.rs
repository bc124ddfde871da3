//! Request heads: read within a bound, parsed strictly (the head is forwarded, so anything
//! a lenient upstream could read as a second request is refused), and written upstream with
//! the operator's headers in place of the sandbox's.

use tokio::io::AsyncReadExt as _;
use tokio::net::TcpStream;

use crate::egress::policy;

/// Largest request head accepted, bytes.
pub(super) const MAX_HEAD: usize = 16 * 1024;

/// A parsed request head.
pub(super) struct Head {
    pub(super) connect: bool,
    pub(super) host: String,
    pub(super) port: u16,
    /// For plain HTTP: the request line to send upstream (origin-form).
    pub(super) line: String,
    /// For plain HTTP: `Host` as sent upstream (the host connected to, whatever the code said).
    pub(super) host_header: String,
    /// For plain HTTP: the header lines to send upstream (no proxy, connection or Host headers).
    pub(super) headers: Vec<String>,
    /// Bytes read past the head (the start of a body, or of the tunnel).
    pub(super) rest: Vec<u8>,
    /// The request's `Proxy-Authorization`, for the proxy only (never sent on).
    pub(super) proxy_auth: Option<String>,
}

/// The `Proxy-Authorization` value of the pass `pass` (user `pyberth`), as clients send a
/// proxy URL's credentials.
pub(super) fn basic_auth(pass: &str) -> String {
    use base64::Engine as _;
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("pyberth:{pass}")))
}

/// Whether `given` is `wanted`, in time that does not depend on where they differ.
pub(super) fn same_secret(given: &str, wanted: &str) -> bool {
    let (a, b) = (given.as_bytes(), wanted.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The value of header `name` (lowercase) in a head's text.
fn header_value(text: &str, name: &str) -> Option<String> {
    text.split("\r\n").skip(1).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        (n.trim().eq_ignore_ascii_case(name)).then(|| v.trim().to_owned())
    })
}

/// The head's text and the bytes read past it.
pub(super) async fn read_raw<R: tokio::io::AsyncRead + Unpin>(sock: &mut R) -> Result<(String, Vec<u8>), String> {
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
pub(super) type RequestLine<'a> = (&'a str, &'a str, &'a str);

/// A token character (RFC 9110 5.6.2): what a method and a header name are made of.
pub(super) fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The request line's parts, and the header lines a request goes upstream with (no proxy,
/// connection or Host headers: the proxy sets `Host` to the host it connects to, so a forged
/// one cannot send an operator's secret to another site behind the same address).
///
/// Strict, because the head is forwarded: a lone `\n`, a stray `\r` or any other control
/// byte, a folded line, or a space before a header's colon would let a lenient upstream read
/// a second request the sandbox wrote, carrying the headers the proxy adds (smuggling).
pub(super) fn split_head(text: &str) -> Result<(RequestLine<'_>, Vec<String>), String> {
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
pub(super) fn host_header(host: &str, port: u16, default: u16) -> String {
    let h = if host.contains(':') { format!("[{host}]") } else { host.to_owned() };
    if port == default { h } else { format!("{h}:{port}") }
}

/// A request inside a tunnel to `host:port` (TLS terminated or plain): origin-form only.
pub(super) async fn read_inner_head<R: tokio::io::AsyncRead + Unpin>(
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
        proxy_auth: None,
    })
}

pub(super) async fn read_head(sock: &mut TcpStream) -> Result<Head, String> {
    let (text, rest) = read_raw(sock).await?;
    let ((method, target, version), headers) = split_head(&text)?;
    let proxy_auth = header_value(&text, "proxy-authorization");
    if method == "CONNECT" {
        let (host, port) = policy::split_host_port(target)?;
        let port = port.ok_or("CONNECT needs host:port")?;
        let (line, host_header, headers) = (String::new(), String::new(), Vec::new());
        return Ok(Head { connect: true, host, port, line, host_header, headers, rest, proxy_auth });
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
    let host_header = host_header(&host, port, 80);
    Ok(Head { connect: false, host_header, host, port, line, headers, rest, proxy_auth })
}

pub(super) fn header_name(line: &str) -> String {
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
            proxy_auth: self.proxy_auth.clone(),
        }
    }
}

impl Head {
    /// Whether a request may go out with `inject` (the operator's secrets) added: not one
    /// the upstream answers by echoing it whole (TRACE, TRACK), nor one with a chunked body,
    /// which the HTTP/1.0 it is sent as cannot carry.
    pub(super) fn carries_secret_safely(&self, inject: &[(String, String)]) -> Result<(), String> {
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
    pub(super) fn forward(&self, inject: &[(String, String)]) -> Vec<u8> {
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
            proxy_auth: None,
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
    fn injected_headers_replace_the_sandboxes_own() {
        let head = Head {
            connect: false,
            host: "h".into(),
            port: 80,
            line: "GET / HTTP/1.1".into(),
            host_header: "h".into(),
            headers: vec!["X-A: 1".into(), "accept-encoding: gzip".into(), "authorization: forged".into()],
            rest: Vec::new(),
            proxy_auth: None,
        };
        let out = String::from_utf8(head.forward(&[("Authorization".into(), "Bearer real".into())])).expect("utf-8");
        assert_eq!(
            out,
            "GET / HTTP/1.0\r\nHost: h\r\nX-A: 1\r\nAccept-Encoding: identity\r\nAuthorization: Bearer real\r\nConnection: close\r\n\r\n"
        );
    }

    /// The pass a session's connections carry is read off the head, kept from the upstream
    /// (proxy headers never go on), and compared whole.
    #[test]
    fn the_pass_is_read_from_the_head_and_never_sent_on() {
        let wanted = basic_auth("0123abcd");
        assert_eq!(wanted, "Basic cHliZXJ0aDowMTIzYWJjZA==", "as clients encode pyberth:0123abcd");
        let text = format!("GET http://h.test/x HTTP/1.1\r\nHost: h.test\r\nProxy-Authorization: {wanted}\r\n\r\n");
        assert_eq!(header_value(&text, "proxy-authorization").as_deref(), Some(wanted.as_str()));
        let ((_, _, _), headers) = split_head(&text).expect("head");
        assert!(!headers.iter().any(|h| h.to_ascii_lowercase().starts_with("proxy-")), "{headers:?}");
        assert!(same_secret(&wanted, &basic_auth("0123abcd")));
        for other in [basic_auth("0123abce"), basic_auth("0123abc"), String::new(), wanted.to_lowercase()] {
            assert!(!same_secret(&other, &wanted), "{other}");
        }
        assert_eq!(header_value("CONNECT a:1 HTTP/1.1\r\nX: y\r\n\r\n", "proxy-authorization"), None);
    }
}
