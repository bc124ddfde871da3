//! The server's outbound HTTP client (JWKS and authorization-server metadata for OAuth, code
//! mode's streamable-HTTP upstreams): reqwest on rustls with the ring provider, trusting the CA
//! bundle the operator names (`--ca-bundle`, `SSL_CERT_FILE`, ...) or else the system's.

use std::path::Path;
use std::sync::Arc;

/// Installs ring as the process's rustls provider. reqwest is built without one of its own
/// (its default, aws-lc-rs, needs cmake), so every client it builds, ours or a library's, looks
/// for the process default; installing it twice is harmless.
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A client builder whose TLS trusts exactly the certificates of `ca_bundle` (PEM), or the
/// system bundle when `None`. Callers add their own timeouts and redirect policy.
pub fn builder(ca_bundle: Option<&Path>) -> Result<reqwest::ClientBuilder, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    install_provider();
    let path = ca_bundle.map(Path::to_path_buf).or_else(system_bundle);
    let Some(path) = path else {
        return Err("no CA bundle found: set --ca-bundle (or SSL_CERT_FILE) to a PEM file of trusted CAs".into());
    };
    let pem = std::fs::read(&path).map_err(|e| format!("cannot read the CA bundle {}: {e}", path.display()))?;
    let mut store = rustls::RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(CertificateDer::pem_slice_iter(&pem).filter_map(Result::ok));
    if added == 0 {
        return Err(format!("the CA bundle {} has no certificate", path.display()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(store)
        .with_no_client_auth();
    // reqwest is built for HTTP/1.1 only.
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(reqwest::Client::builder().tls_backend_preconfigured(tls))
}

/// The first system CA bundle that exists.
fn system_bundle() -> Option<std::path::PathBuf> {
    crate::config::SYSTEM_CA_BUNDLES.iter().map(std::path::PathBuf::from).find(|p| p.is_file())
}

/// Reads a response body up to `cap` bytes; a longer one is an error (a hostile or broken
/// server cannot make us buffer without bound).
pub async fn body_capped(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| format!("reading the answer: {e}"))? {
        if out.len() + chunk.len() > cap {
            return Err(format!("the answer is over {} KiB", cap >> 10));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_without_certificates_is_refused_with_its_name() {
        let dir = std::env::temp_dir().join(format!("pyberth-https-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let e = builder(Some(&empty)).err().unwrap_or_default();
        assert!(e.contains("has no certificate") && e.contains("empty.pem"), "{e}");
        let e = builder(Some(&dir.join("missing.pem"))).err().unwrap_or_default();
        assert!(e.contains("cannot read the CA bundle"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
