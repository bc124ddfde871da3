//! The authorization server's signing keys: its JWKS, fetched (the URL configured or found in
//! the issuer's metadata, RFC 8414 / OpenID discovery), cached, and fetched again when a token
//! names a key we do not have (rotation) or the set is older than its time to live. Fetches
//! are spaced by at least the refetch interval whatever tokens arrive, so a flood of made-up
//! `kid`s costs the authorization server one request per interval.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey};

/// Largest JWKS or metadata document read.
const DOC_CAP: usize = 256 << 10;
/// Time limit of one fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// One usable verification key.
#[derive(Clone)]
pub(super) struct Key {
    pub(super) decoding: Arc<DecodingKey>,
    family: AlgorithmFamily,
    /// The `alg` the JWK is bound to, if it says.
    alg: Option<String>,
}

impl Key {
    /// Whether a token signed with `alg` may be checked with this key.
    fn fits(&self, alg: Algorithm) -> bool {
        self.family == alg.family() && self.alg.as_ref().is_none_or(|a| *a == format!("{alg:?}"))
    }
}

#[derive(Default)]
struct State {
    keys: HashMap<String, Key>,
    /// When the key set was last fetched successfully.
    fetched: Option<Instant>,
    /// When a fetch was last started, successful or not: the rate limit.
    attempted: Option<Instant>,
    /// The JWKS URL, configured or discovered.
    jwks_url: Option<String>,
}

/// The keys of one issuer.
pub(super) struct KeySet {
    client: reqwest::Client,
    issuer: String,
    refetch: Duration,
    ttl: Duration,
    state: Mutex<State>,
    /// One fetch at a time; waiters then read what it brought.
    fetching: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySet").field("issuer", &self.issuer).finish_non_exhaustive()
    }
}

impl KeySet {
    pub(super) fn new(
        client: reqwest::Client,
        issuer: String,
        jwks_url: Option<String>,
        refetch: Duration,
        ttl: Duration,
    ) -> Self {
        let state = State { jwks_url, ..State::default() };
        Self { client, issuer, refetch, ttl, state: Mutex::new(state), fetching: tokio::sync::Mutex::new(()) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The key `kid` for a token signed with `alg`, fetching the set again if the key is
    /// unknown or the set stale and the rate limit allows.
    pub(super) async fn find(&self, kid: &str, alg: Algorithm) -> Option<Key> {
        let lookup = |s: &State| s.keys.get(kid).filter(|k| k.fits(alg)).cloned();
        let (hit, stale, may_fetch) = {
            let s = self.state();
            let stale = s.fetched.is_none_or(|t| t.elapsed() >= self.ttl);
            (lookup(&s), stale, s.attempted.is_none_or(|t| t.elapsed() >= self.refetch))
        };
        if (hit.is_some() && !stale) || !may_fetch {
            return hit;
        }
        let _one = self.fetching.lock().await;
        {
            let mut s = self.state();
            // Another request fetched while this one waited: use what it brought.
            if s.attempted.is_some_and(|t| t.elapsed() < self.refetch) {
                return lookup(&s);
            }
            s.attempted = Some(Instant::now());
        }
        match self.fetch().await {
            Ok(keys) => {
                tracing::info!(issuer = %self.issuer, keys = keys.len(), "OAuth signing keys fetched");
                let mut s = self.state();
                s.keys = keys;
                s.fetched = Some(Instant::now());
            }
            // Logged at most once per refetch interval (the rate limit above); the keys we had
            // stay in use meanwhile.
            Err(e) => tracing::warn!(issuer = %self.issuer, "cannot fetch the OAuth signing keys: {e}"),
        }
        lookup(&self.state())
    }

    async fn fetch(&self) -> Result<HashMap<String, Key>, String> {
        let configured = self.state().jwks_url.clone();
        let url = match configured {
            Some(u) => u,
            None => {
                let u = self.discover().await?;
                self.state().jwks_url = Some(u.clone());
                u
            }
        };
        let doc = self.get_json(&url).await.map_err(|e| format!("{url}: {e}"))?;
        let listed = doc.get("keys").and_then(|k| k.as_array()).ok_or_else(|| format!("{url}: no \"keys\" array"))?;
        Ok(listed.iter().filter_map(usable).collect())
    }

    /// The JWKS URL from the issuer's metadata: RFC 8414 first, then OpenID discovery.
    async fn discover(&self) -> Result<String, String> {
        let mut why = Vec::new();
        for url in metadata_urls(&self.issuer) {
            match self.get_json(&url).await {
                Ok(meta) => {
                    // RFC 8414 §3.3: metadata for another issuer must not be used.
                    if meta.get("issuer").and_then(|i| i.as_str()) != Some(self.issuer.as_str()) {
                        return Err(format!("{url} describes another issuer"));
                    }
                    let jwks = meta.get("jwks_uri").and_then(|j| j.as_str()).unwrap_or_default();
                    return check_url(jwks).map(|()| jwks.to_owned()).map_err(|e| format!("{url}: jwks_uri {e}"));
                }
                Err(e) => why.push(format!("{url}: {e}")),
            }
        }
        Err(format!("no authorization server metadata: {}", why.join("; ")))
    }

    async fn get_json(&self, url: &str) -> Result<serde_json::Value, String> {
        let resp = self
            .client
            .get(url)
            .header("accept", "application/json")
            .timeout(FETCH_TIMEOUT)
            .send()
            .await
            .map_err(|e| format!("{e}"))?;
        if !resp.status().is_success() {
            return Err(format!("answered {}", resp.status()));
        }
        let body = crate::https::body_capped(resp, DOC_CAP).await?;
        serde_json::from_slice(&body).map_err(|e| format!("not JSON: {e}"))
    }
}

/// A JWK we may verify signatures with: a public key with a `kid`, for signatures, never a
/// symmetric (`oct`) key: a JWKS is public, so an HMAC key in it would let anyone sign.
fn usable(v: &serde_json::Value) -> Option<(String, Key)> {
    let jwk: Jwk = serde_json::from_value(v.clone()).ok()?;
    let kid = jwk.common.key_id.clone()?;
    if matches!(jwk.common.public_key_use, Some(ref u) if *u != PublicKeyUse::Signature) {
        return None;
    }
    let decoding = DecodingKey::from_jwk(&jwk).ok()?;
    let family = match &jwk.algorithm {
        jsonwebtoken::jwk::AlgorithmParameters::RSA(_) => AlgorithmFamily::Rsa,
        jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_) => AlgorithmFamily::Ec,
        jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_) => AlgorithmFamily::Ed,
        _ => return None,
    };
    let alg = jwk.common.key_algorithm.map(|a| format!("{a:?}"));
    Some((kid, Key { decoding: Arc::new(decoding), family, alg }))
}

/// Where an issuer's metadata may be: RFC 8414 inserts the well-known path before the
/// issuer's path; OpenID Connect appends it.
pub(super) fn metadata_urls(issuer: &str) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(u) = reqwest::Url::parse(issuer) {
        let path = u.path().trim_end_matches('/');
        let mut m = u.clone();
        m.set_path(&format!("/.well-known/oauth-authorization-server{path}"));
        out.push(m.to_string());
    }
    out.push(format!("{}/.well-known/openid-configuration", issuer.trim_end_matches('/')));
    out
}

/// Keys and metadata travel over https; plain http only to this machine (a local
/// authorization server in development).
pub(super) fn check_url(url: &str) -> Result<(), String> {
    let u = reqwest::Url::parse(url).map_err(|_| format!("`{url}` is not a URL"))?;
    let host = u.host_str().unwrap_or_default().trim_start_matches('[').trim_end_matches(']');
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    match u.scheme() {
        "https" if !host.is_empty() => Ok(()),
        "http" if loopback => Ok(()),
        _ => Err(format!("`{url}` must be an https:// URL (http:// only to localhost)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_urls_follow_rfc_8414_and_openid() {
        assert_eq!(
            metadata_urls("https://as.example.com"),
            [
                "https://as.example.com/.well-known/oauth-authorization-server",
                "https://as.example.com/.well-known/openid-configuration"
            ]
        );
        assert_eq!(
            metadata_urls("https://as.example.com/tenant1/"),
            [
                "https://as.example.com/.well-known/oauth-authorization-server/tenant1",
                "https://as.example.com/tenant1/.well-known/openid-configuration"
            ]
        );
    }

    #[test]
    fn only_https_or_loopback_http_is_fetched() {
        assert!(check_url("https://as.example.com/jwks").is_ok());
        assert!(check_url("http://127.0.0.1:9/jwks").is_ok());
        assert!(check_url("http://localhost/jwks").is_ok());
        for bad in ["http://as.example.com/jwks", "ftp://x/", "file:///etc/passwd", "jwks"] {
            assert!(check_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn symmetric_and_encryption_keys_are_never_used() {
        let oct = serde_json::json!({ "kty": "oct", "kid": "h", "k": "c2VjcmV0" });
        assert!(usable(&oct).is_none());
        let ec = serde_json::json!({
            "kty": "EC", "crv": "P-256", "kid": "e", "use": "enc",
            "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
            "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"
        });
        assert!(usable(&ec).is_none());
        let mut sig = ec.clone();
        sig["use"] = "sig".into();
        let (kid, key) = usable(&sig).expect("a signing key");
        assert_eq!(kid, "e");
        assert!(key.fits(Algorithm::ES256) && !key.fits(Algorithm::RS256) && !key.fits(Algorithm::HS256));
    }
}
