//! OAuth 2.1 resource server (issue 31, item 3): JWT access tokens of an authorization server
//! the test plays, with ES256 keys it makes and a JWKS it serves over HTTPS (its own test CA,
//! given to the server as its CA bundle; the JWKS URL found through RFC 8414 metadata).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

use crate::common::{text, web};
use crate::http::{ALICE, HttpServer, call};

const RESOURCE: &str = "https://pyberth.test/mcp";
const PRM: &str = "https://pyberth.test/.well-known/oauth-protected-resource/mcp";
const SCOPE: &str = "sandbox.run";

/// A signing key of the test's authorization server.
struct SigningKey {
    kid: String,
    pair: rcgen::KeyPair,
}

impl SigningKey {
    fn new(kid: &str) -> Self {
        Self { kid: kid.into(), pair: rcgen::KeyPair::generate().expect("P-256 key") }
    }

    /// Its public half as a JWK.
    fn jwk(&self) -> Value {
        let raw = self.pair.public_key_raw(); // 0x04 || x || y
        json!({ "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": self.kid,
                "x": B64.encode(&raw[1..33]), "y": B64.encode(&raw[33..65]) })
    }

    fn sign(&self, claims: &Value) -> String {
        self.sign_as(&self.kid, claims)
    }

    fn sign_as(&self, kid: &str, claims: &Value) -> String {
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(kid.into());
        jsonwebtoken::encode(&header, claims, &EncodingKey::from_ec_der(&self.pair.serialize_der())).expect("sign")
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default()
}

/// A site on loopback over HTTPS, with a certificate for 127.0.0.1 from a CA of its own (in
/// `ca_file`, to give a server as its CA bundle). Stops when dropped.
pub(crate) struct TlsSite {
    pub(crate) port: u16,
    pub(crate) ca_file: std::path::PathBuf,
    stop: tokio_util::sync::CancellationToken,
}

impl TlsSite {
    pub(crate) async fn serve(tag: &str, app: axum::Router) -> TlsSite {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, SanType};
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca.self_signed(&ca_key).expect("CA");
        let leaf_key = rcgen::KeyPair::generate().expect("leaf key");
        let mut leaf = CertificateParams::new(Vec::<String>::new()).expect("leaf params");
        leaf.subject_alt_names = vec![SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into())];
        let leaf_cert = leaf.signed_by(&leaf_key, &ca_cert, &ca_key).expect("leaf");
        let ca_file = std::env::temp_dir().join(format!("pyberth-test-ca-{tag}-{}.pem", std::process::id()));
        std::fs::write(&ca_file, ca_cert.pem()).expect("write CA");

        pyberth::https::install_provider();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
        let tls = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![leaf_cert.der().clone()], key)
            .expect("server TLS");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        // Owned by the test: it ends when `stop` fires (on drop).
        tokio::spawn(async move {
            loop {
                let (tcp, _) = tokio::select! {
                    () = stopped.cancelled() => return,
                    r = listener.accept() => match r { Ok(c) => c, Err(_) => continue },
                };
                let (acceptor, app) = (acceptor.clone(), app.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else { return };
                    let service = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        TlsSite { port, ca_file, stop }
    }
}

impl Drop for TlsSite {
    fn drop(&mut self) {
        self.stop.cancel();
        let _ = std::fs::remove_file(&self.ca_file);
    }
}

/// The test's authorization server: metadata and JWKS over HTTPS, with a count of JWKS reads.
struct AuthServer {
    issuer: String,
    jwks: Arc<Mutex<Value>>,
    jwks_reads: Arc<AtomicUsize>,
    site: TlsSite,
}

impl AuthServer {
    async fn start(tag: &str) -> Self {
        // The port is known only once bound: the metadata reads the issuer from a cell.
        let issuer_cell: Arc<Mutex<String>> = Arc::default();
        let jwks = Arc::new(Mutex::new(json!({ "keys": [] })));
        let jwks_reads = Arc::new(AtomicUsize::new(0));
        let (doc, reads, iss) = (jwks.clone(), jwks_reads.clone(), issuer_cell.clone());
        let app = axum::Router::new()
            .route(
                "/.well-known/oauth-authorization-server",
                axum::routing::get(move || {
                    let issuer = iss.lock().expect("issuer").clone();
                    async move { axum::Json(json!({ "issuer": issuer, "jwks_uri": format!("{issuer}/jwks") })) }
                }),
            )
            .route(
                "/jwks",
                axum::routing::get(move || {
                    reads.fetch_add(1, Ordering::SeqCst);
                    let body = doc.lock().expect("jwks").clone();
                    async move { axum::Json(body) }
                }),
            );
        let site = TlsSite::serve(tag, app).await;
        let issuer = format!("https://127.0.0.1:{}", site.port);
        *issuer_cell.lock().expect("issuer") = issuer.clone();
        AuthServer { issuer, jwks, jwks_reads, site }
    }

    fn publish(&self, keys: &[&SigningKey]) {
        *self.jwks.lock().expect("jwks") = json!({ "keys": keys.iter().map(|k| k.jwk()).collect::<Vec<_>>() });
    }

    fn reads(&self) -> usize {
        self.jwks_reads.load(Ordering::SeqCst)
    }

    /// Claims of a good token for `sub`.
    fn claims(&self, sub: &str) -> Value {
        json!({ "iss": self.issuer, "aud": RESOURCE, "sub": sub, "scope": format!("openid {SCOPE}"),
                "iat": now(), "exp": now() + 600 })
    }
}

/// A bare MCP request with `token`: the status and the challenge.
async fn attempt(s: &HttpServer, token: Option<&str>) -> (u16, String) {
    let body = json!({ "jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": { "name": "t", "version": "1" } } });
    let mut req = web()
        .post(s.url("/mcp"))
        .header("accept", "application/json, text/event-stream")
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let r = req.send().await.expect("post");
    let challenge = r.headers().get("www-authenticate").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    (r.status().as_u16(), challenge.unwrap_or_default())
}

async fn start(tag: &str, auth: &AuthServer) -> HttpServer {
    let ca = auth.site.ca_file.to_string_lossy().into_owned();
    let env = [
        ("PYBERTH_OAUTH_ISSUER", auth.issuer.as_str()),
        ("PYBERTH_OAUTH_RESOURCE", RESOURCE),
        ("PYBERTH_OAUTH_SCOPE", SCOPE),
        ("PYBERTH_OAUTH_JWKS_REFETCH_S", "2"),
        ("PYBERTH_CA_BUNDLE", ca.as_str()),
    ];
    HttpServer::start_with(tag, &env, None).await
}

#[tokio::test(flavor = "multi_thread")]
async fn oauth_tokens_are_checked_and_their_subjects_are_principals() {
    let auth = AuthServer::start("main").await;
    let k1 = SigningKey::new("k1");
    auth.publish(&[&k1]);
    let s = start("oauth", &auth).await;

    // The metadata tells a client where to get a token, at both well-known places.
    for path in ["/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"] {
        let prm: Value = web().get(s.url(path)).send().await.expect("get").json().await.expect("json");
        assert_eq!(prm["resource"], RESOURCE, "{path}: {prm}");
        assert_eq!(prm["authorization_servers"], json!([auth.issuer]), "{prm}");
        assert_eq!(prm["scopes_supported"], json!([SCOPE]), "{prm}");
        assert_eq!(prm["bearer_methods_supported"], json!(["header"]), "{prm}");
    }
    let (status, challenge) = attempt(&s, None).await;
    assert_eq!(status, 401);
    assert!(
        challenge.starts_with("Bearer ") && challenge.contains(&format!("resource_metadata=\"{PRM}\"")),
        "{challenge}"
    );
    assert!(challenge.contains(&format!("scope=\"{SCOPE}\"")) && !challenge.contains("error="), "{challenge}");

    // Two subjects, two principals: neither sees the other's session; static tokens still work.
    let carol = s.client(&k1.sign(&auth.claims("carol"))).await;
    let dave = s.client(&k1.sign(&auth.claims("dave"))).await;
    let (r, _) = call(&carol, "run_python", json!({ "session": "work", "code": "secret = 'c'" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (_, sc) = call(&dave, "list_sessions", json!({})).await;
    assert_eq!(sc["sessions"], json!([]), "dave sees none of carol's sessions");
    let (r, _) = call(&dave, "run_python", json!({ "session": "work", "code": "secret" })).await;
    assert!(text(&r).contains("NameError"), "dave's 'work' is his own: {}", text(&r));
    let alice = s.client(ALICE).await;
    let (_, sc) = call(&alice, "list_sessions", json!({})).await;
    assert_eq!(sc["sessions"], json!([]), "a static token's principal sees no OAuth principal's sessions");
    let (_, sc) = call(&carol, "run_python", json!({ "session": "work", "code": "secret" })).await;
    assert_eq!(sc["result"], "'c'", "{sc}");

    bad_tokens_are_refused_with_the_reason(&s, &auth, &k1).await;
    let _ = (carol.cancel().await, dave.cancel().await, alice.cancel().await);
    s.stop().await;
}

/// Each bad token refused with the reason in the challenge, its status and its error code.
async fn bad_tokens_are_refused_with_the_reason(s: &HttpServer, auth: &AuthServer, k1: &SigningKey) {
    let other = SigningKey::new("k1"); // same kid, another key: a forged signature
    let mut cases: Vec<(&str, String, u16, &str)> = Vec::new();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut c = auth.claims("carol");
        change(&mut c);
        c
    };
    cases.push((
        "wrong aud",
        k1.sign(&with(&|c| c["aud"] = "https://elsewhere.test/mcp".into())),
        401,
        "another resource",
    ));
    cases.push(("expired", k1.sign(&with(&|c| c["exp"] = (now() - 600).into())), 401, "expired"));
    cases.push(("not yet", k1.sign(&with(&|c| c["nbf"] = (now() + 600).into())), 401, "not valid yet"));
    cases.push(("wrong issuer", k1.sign(&with(&|c| c["iss"] = "https://evil.test".into())), 401, "another issuer"));
    cases.push((
        "no exp",
        k1.sign(&with(&|c| {
            if let Some(o) = c.as_object_mut() {
                o.remove("exp");
            }
        })),
        401,
        "no exp",
    ));
    cases.push(("missing scope", k1.sign(&with(&|c| c["scope"] = "openid".into())), 403, "insufficient_scope"));
    cases.push(("bad signature", other.sign(&auth.claims("carol")), 401, "signature does not verify"));
    cases.push(("unknown kid", k1.sign_as("nobody", &auth.claims("carol")), 401, "signing key (kid)"));
    cases.push(("bad principal", k1.sign(&auth.claims("carol|admin")), 401, "principal name"));
    let head = B64.encode(json!({ "alg": "none", "typ": "JWT", "kid": "k1" }).to_string());
    let body = B64.encode(auth.claims("carol").to_string());
    cases.push(("alg none", format!("{head}.{body}."), 401, "invalid_token"));
    // Key confusion: HS256 keyed with the public key's bytes.
    let hs = jsonwebtoken::encode(
        &Header { kid: Some("k1".into()), ..Header::new(Algorithm::HS256) },
        &auth.claims("carol"),
        &EncodingKey::from_secret(k1.pair.public_key_raw()),
    )
    .expect("hs256");
    cases.push(("HS256 with the public key", hs, 401, "algorithm is not accepted"));
    cases.push(("garbage", "not.a.jwt".into(), 401, "invalid_token"));
    for (what, token, want_status, want) in &cases {
        let (status, challenge) = attempt(s, Some(token)).await;
        assert_eq!(status, *want_status, "{what}: {challenge}");
        assert!(challenge.contains(want), "{what}: {challenge}");
        assert!(challenge.contains(&format!("resource_metadata=\"{PRM}\"")), "{what}: {challenge}");
        let error = if *want_status == 403 { "error=\"insufficient_scope\"" } else { "error=\"invalid_token\"" };
        assert!(challenge.contains(error), "{what}: {challenge}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn oauth_keys_rotate_and_a_kid_flood_does_not_hammer_the_jwks() {
    let auth = AuthServer::start("rotate").await;
    let (k1, k2) = (SigningKey::new("k1"), SigningKey::new("k2"));
    auth.publish(&[&k1]);
    let s = start("oauth-rotate", &auth).await;
    let old = k1.sign(&auth.claims("erin"));
    let erin = s.client(&old).await;
    let (r, _) = call(&erin, "list_sessions", json!({})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let before = auth.reads();
    assert!(before >= 1, "the keys were fetched");

    // An attacker sends tokens naming made-up keys as fast as it can: at most one JWKS read
    // per refetch interval (2 s) follows.
    let t0 = Instant::now();
    let mut refused = 0;
    for i in 0..60 {
        let (status, _) = attempt(&s, Some(&k1.sign_as(&format!("made-up-{i}"), &auth.claims("erin")))).await;
        refused += usize::from(status == 401);
    }
    let spent = t0.elapsed().as_secs();
    let reads = auth.reads() - before;
    eprintln!("kid flood: 60 tokens in {spent} s, {reads} JWKS reads");
    assert_eq!(refused, 60);
    assert!(reads <= 1 + usize::try_from(spent / 2).unwrap_or(usize::MAX), "{reads} JWKS reads in {spent} s");

    // Rotation: k2 replaces k1. A k2 token works once the interval allows a fetch; k1 is then gone.
    auth.publish(&[&k2]);
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let frank = s.client(&k2.sign(&auth.claims("frank"))).await;
    let (r, _) = call(&frank, "list_sessions", json!({})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (status, challenge) = attempt(&s, Some(&old)).await;
    assert_eq!(status, 401, "a removed key's token is refused: {challenge}");
    assert!(challenge.contains("signing key (kid)"), "{challenge}");
    let _ = (erin.cancel().await, frank.cancel().await);
    s.stop().await;
}
