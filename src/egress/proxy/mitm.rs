//! TLS termination for hosts that carry the operator's headers: the per-server CA, leaves
//! minted from it per host, and one request forwarded inside with the headers set.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::head::read_inner_head;
use super::scrub::Scrubber;
use super::splice::Budget;
use super::splice::splice;
use super::wire::{SecretPem, deny};
use super::{CONNECT_TIMEOUT, HEAD_TIMEOUT};

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

pub(super) fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// TLS termination for hosts that carry headers: the CA, the upstream trust, and the leaf
/// certificates minted so far (one per host; only hosts with headers, so bounded by config).
pub(super) struct Mitm {
    pub(super) ca_key: rcgen::KeyPair,
    pub(super) ca_cert: rcgen::Certificate,
    pub(super) client: Arc<rustls::ClientConfig>,
    pub(super) leaves: std::sync::Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl Mitm {
    pub(super) fn new(key: &SecretPem, roots: Option<&str>) -> Result<Self, String> {
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
    pub(super) fn server_config(&self, host: &str) -> Result<Arc<rustls::ServerConfig>, String> {
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

/// A tunnel to a host that carries headers. When the sandbox starts TLS in it, the proxy
/// terminates it with a leaf of the per-server CA and opens a verified TLS connection to the
/// upstream; otherwise the tunnel holds plain HTTP. Either way one HTTP/1.1 request is
/// forwarded with `inject` set (it says `Connection: close`: a later request on the same
/// connection could not be given the headers).
#[allow(clippy::too_many_arguments)]
pub(super) async fn intercept(
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
pub(super) async fn forward_one<C, U>(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::proxy::wire::Command;

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
                    by_peer: false,
                }
            )
            .contains("PRIVATE")
        );
    }
}
