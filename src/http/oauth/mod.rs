//! OAuth 2.1 resource server (issue 31, item 3): JWT access tokens of one authorization server,
//! checked against its published keys, beside the static tokens. The Protected Resource
//! Metadata (RFC 9728) tells clients where to get a token; refusals say why in
//! `WWW-Authenticate` (RFC 6750) and point at that metadata.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};

use super::{Error, HttpArgs};

mod keys;

/// Clock skew allowed on `exp` and `nbf`, seconds.
const LEEWAY_S: u64 = 30;
/// Where the metadata is served (and, with the resource's path appended, also there).
pub(super) const PRM_PATH: &str = "/.well-known/oauth-protected-resource";

/// Why a presented JWT is refused.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    /// 401 `invalid_token`, with the reason.
    Invalid(String),
    /// 403 `insufficient_scope`.
    Scope,
}

/// The resource server's settings and the issuer's keys.
#[derive(Debug)]
pub(super) struct OAuth {
    issuer: String,
    resource: String,
    metadata_url: String,
    scopes: Vec<String>,
    claim: String,
    algs: Vec<Algorithm>,
    keys: keys::KeySet,
}

impl OAuth {
    /// From the `oauth_*` settings; `None` when OAuth is off (no issuer).
    pub(super) fn from_args(args: &HttpArgs, ca_bundle: Option<&std::path::Path>) -> Result<Option<Self>, Error> {
        let Some(issuer) = args.oauth_issuer.clone() else {
            if args.oauth_resource.is_some() || args.oauth_jwks_url.is_some() {
                return Err(Error::OAuth("oauth_resource and oauth_jwks_url need oauth_issuer".into()));
            }
            return Ok(None);
        };
        let bad = |m: String| Error::OAuth(m);
        keys::check_url(&issuer).map_err(|e| bad(format!("oauth_issuer: {e}")))?;
        if let Some(j) = &args.oauth_jwks_url {
            keys::check_url(j).map_err(|e| bad(format!("oauth_jwks_url: {e}")))?;
        }
        let Some(resource) = args.oauth_resource.clone() else {
            return Err(bad("oauth_resource is needed with oauth_issuer: this server's URL as clients reach it \
                            (e.g. https://sandbox.example.com/mcp), the audience its tokens must name"
                .into()));
        };
        let metadata_url = metadata_url(&resource).map_err(|e| bad(format!("oauth_resource: {e}")))?;
        let claim = args.oauth_principal_claim.trim().to_owned();
        if claim.is_empty() || !claim.chars().all(|c| c.is_ascii_alphanumeric() || "._-:/".contains(c)) {
            return Err(bad("oauth_principal_claim: a claim name such as sub, email or preferred_username".into()));
        }
        let algs = parse_algs(&args.oauth_algs).map_err(bad)?;
        let scopes: Vec<String> =
            args.oauth_scope.as_deref().unwrap_or_default().split_whitespace().map(Into::into).collect();
        if scopes.iter().any(|s| s.chars().any(|c| c == '"' || c == '\\' || !c.is_ascii_graphic())) {
            return Err(bad("oauth_scope: scope names are printable ASCII without quotes or backslashes".into()));
        }
        if args.oauth_jwks_refetch_s == 0 {
            return Err(Error::Limit { flag: "oauth-jwks-refetch-s", rule: "at least 1" });
        }
        let client = crate::https::builder(ca_bundle)
            .map_err(bad)?
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| bad(format!("the HTTPS client: {e}")))?;
        let keys = keys::KeySet::new(
            client,
            issuer.clone(),
            args.oauth_jwks_url.clone(),
            Duration::from_secs(args.oauth_jwks_refetch_s),
            Duration::from_secs(args.oauth_jwks_ttl_s.max(args.oauth_jwks_refetch_s)),
        );
        Ok(Some(Self { issuer, resource, metadata_url, scopes, claim, algs, keys }))
    }

    /// The metadata document's own URL (for `resource_metadata`).
    pub(super) fn metadata_url(&self) -> &str {
        &self.metadata_url
    }

    /// The path under which the metadata is served besides [`PRM_PATH`] (RFC 9728 §3.1: the
    /// well-known path followed by the resource's path).
    pub(super) fn metadata_path(&self) -> Option<String> {
        let u = reqwest::Url::parse(&self.resource).ok()?;
        let path = u.path().trim_end_matches('/');
        (!path.is_empty()).then(|| format!("{PRM_PATH}{path}"))
    }

    /// The Protected Resource Metadata document (RFC 9728 §2).
    pub(super) fn metadata(&self) -> serde_json::Value {
        serde_json::json!({
            "resource": self.resource,
            "authorization_servers": [self.issuer],
            "scopes_supported": self.scopes,
            "bearer_methods_supported": ["header"],
            "resource_signing_alg_values_supported": self.algs.iter().map(|a| format!("{a:?}")).collect::<Vec<_>>(),
            "resource_name": "pyberth",
        })
    }

    /// The challenge of a 401 or 403 (RFC 6750 §3, RFC 9728 §5.1).
    pub(super) fn challenge(&self, refusal: Option<&Refusal>) -> String {
        let mut c = format!("Bearer resource_metadata=\"{}\"", self.metadata_url);
        match refusal {
            None => {}
            Some(Refusal::Invalid(why)) => {
                c.push_str(&format!(", error=\"invalid_token\", error_description=\"{}\"", quoted(why)));
            }
            Some(Refusal::Scope) => c.push_str(
                ", error=\"insufficient_scope\", error_description=\"the token lacks a scope this server requires\"",
            ),
        }
        if !self.scopes.is_empty() {
            c.push_str(&format!(", scope=\"{}\"", self.scopes.join(" ")));
        }
        c
    }

    /// The principal a JWT access token speaks for, or why it is refused.
    pub(super) async fn verify(&self, token: &str) -> Result<Arc<str>, Refusal> {
        let invalid = |s: &str| Refusal::Invalid(s.to_owned());
        // `alg: none` and any name jsonwebtoken does not know fail here.
        let header = jsonwebtoken::decode_header(token).map_err(|_| invalid("not a signed JWT this server accepts"))?;
        if !self.algs.contains(&header.alg) {
            return Err(invalid("the token's signing algorithm is not accepted"));
        }
        let Some(kid) = header.kid.as_deref() else { return Err(invalid("the token names no signing key (kid)")) };
        let Some(key) = self.keys.find(kid, header.alg).await else {
            return Err(invalid("the token's signing key (kid) is not one of the authorization server's keys"));
        };
        let mut v = Validation::new(header.alg);
        v.set_issuer(&[&self.issuer]);
        v.set_audience(&[&self.resource]);
        v.set_required_spec_claims(&["exp", "iss", "aud"]);
        v.validate_nbf = true;
        v.leeway = LEEWAY_S;
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(token, &key.decoding, &v)
            .map_err(|e| Refusal::Invalid(reason(e.kind()).to_owned()))?;
        let claims = data.claims;
        if !self.scopes.iter().all(|need| granted(&claims).any(|s| s == need)) {
            return Err(Refusal::Scope);
        }
        let who = claims.get(&self.claim).and_then(|v| v.as_str()).unwrap_or_default();
        if !principal_name_ok(who) {
            return Err(Refusal::Invalid(format!(
                "the token's {} claim is not a principal name (1-64 letters, digits, '.', '_' or '-')",
                self.claim
            )));
        }
        Ok(Arc::from(who))
    }
}

/// The scopes a token grants: `scope` (space-separated, RFC 9068) or `scp` (a list or a
/// string, as some servers write it).
fn granted(claims: &serde_json::Map<String, serde_json::Value>) -> impl Iterator<Item = &str> {
    fn from(v: Option<&serde_json::Value>) -> Vec<&str> {
        match v {
            Some(serde_json::Value::String(s)) => s.split_whitespace().collect(),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_str()).collect(),
            _ => Vec::new(),
        }
    }
    let mut all = from(claims.get("scope"));
    all.extend(from(claims.get("scp")));
    all.into_iter()
}

/// The reason a validation failed, in words fit for a header.
fn reason(kind: &ErrorKind) -> &'static str {
    match kind {
        ErrorKind::ExpiredSignature => "the token has expired",
        ErrorKind::ImmatureSignature => "the token is not valid yet (nbf)",
        ErrorKind::InvalidIssuer => "the token is from another issuer",
        ErrorKind::InvalidAudience => "the token is for another resource (aud)",
        ErrorKind::InvalidSignature => "the token's signature does not verify",
        ErrorKind::MissingRequiredClaim(c) if c == "exp" => "the token has no exp claim",
        ErrorKind::MissingRequiredClaim(c) if c == "aud" => "the token has no aud claim",
        ErrorKind::MissingRequiredClaim(_) => "the token has no iss claim",
        _ => "the token is not valid",
    }
}

/// Text safe inside a quoted header parameter.
fn quoted(s: &str) -> String {
    s.chars().map(|c| if c == '"' || c == '\\' || c.is_control() { '\'' } else { c }).collect()
}

/// The algorithms accepted: asymmetric ones only. An HMAC algorithm with keys from a public
/// JWKS would let anyone who reads the JWKS sign tokens; `none` signs nothing.
fn parse_algs(names: &[String]) -> Result<Vec<Algorithm>, String> {
    let mut out = Vec::new();
    for n in names {
        let alg: Algorithm = n
            .trim()
            .parse()
            .map_err(|_| format!("oauth_algs: `{n}` is not a JWS algorithm (RS256, ES256, PS256, EdDSA, ...)"))?;
        if alg.family() == jsonwebtoken::AlgorithmFamily::Hmac {
            return Err(format!("oauth_algs: `{n}` is symmetric and cannot be checked against a public key set"));
        }
        out.push(alg);
    }
    if out.is_empty() {
        return Err("oauth_algs: at least one algorithm, e.g. RS256,ES256".into());
    }
    let unique: HashSet<String> = out.iter().map(|a| format!("{a:?}")).collect();
    if unique.len() != out.len() {
        return Err("oauth_algs: an algorithm is named twice".into());
    }
    Ok(out)
}

/// `https://host/.well-known/oauth-protected-resource/path` for the resource
/// `https://host/path` (RFC 9728 §3.1).
fn metadata_url(resource: &str) -> Result<String, String> {
    let u = reqwest::Url::parse(resource).map_err(|_| format!("`{resource}` is not a URL"))?;
    if !matches!(u.scheme(), "https" | "http") || u.host_str().is_none() {
        return Err(format!("`{resource}` must be an http(s) URL"));
    }
    if u.fragment().is_some() || u.query().is_some() {
        return Err(format!("`{resource}` must have no query or fragment (RFC 8707)"));
    }
    let path = u.path().trim_end_matches('/');
    let mut m = u.clone();
    m.set_path(&format!("{PRM_PATH}{path}"));
    Ok(m.to_string())
}

/// The rule for principal names, from the tokens file and from OAuth claims alike.
pub(in crate::http) fn principal_name_ok(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_asymmetric_algorithms_are_accepted() {
        let names = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(parse_algs(&names(&["RS256", "ES256"])), Ok(vec![Algorithm::RS256, Algorithm::ES256]));
        for (bad, why) in [
            (&["HS256"][..], "symmetric"),
            (&["none"], "not a JWS"),
            (&[], "at least one"),
            (&["RS256", "RS256"], "twice"),
        ] {
            let e = parse_algs(&names(bad)).expect_err(why);
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn the_metadata_url_inserts_the_well_known_path() {
        assert_eq!(
            metadata_url("https://sb.example.com/mcp").as_deref(),
            Ok("https://sb.example.com/.well-known/oauth-protected-resource/mcp")
        );
        assert_eq!(
            metadata_url("http://127.0.0.1:8080").as_deref(),
            Ok("http://127.0.0.1:8080/.well-known/oauth-protected-resource")
        );
        assert!(metadata_url("https://sb.example.com/mcp#x").is_err());
        assert!(metadata_url("mcp").is_err());
    }

    #[test]
    fn scopes_come_from_scope_or_scp() {
        let claims = |v: serde_json::Value| v.as_object().cloned().unwrap_or_default();
        let c = claims(serde_json::json!({ "scope": "a  b" }));
        assert_eq!(granted(&c).collect::<Vec<_>>(), ["a", "b"]);
        let c = claims(serde_json::json!({ "scp": ["c", 1, "d"] }));
        assert_eq!(granted(&c).collect::<Vec<_>>(), ["c", "d"]);
        assert_eq!(granted(&claims(serde_json::json!({ "scope": 5 }))).count(), 0);
    }

    #[test]
    fn settings_are_checked_before_start() {
        let args = |f: &dyn Fn(&mut HttpArgs)| {
            let mut a = HttpArgs {
                oauth_issuer: Some("https://as.example.com".into()),
                oauth_resource: Some("https://sb.example.com/mcp".into()),
                oauth_principal_claim: "sub".into(),
                oauth_algs: vec!["ES256".into()],
                oauth_jwks_refetch_s: 60,
                oauth_jwks_ttl_s: 600,
                ..HttpArgs::default()
            };
            f(&mut a);
            a
        };
        let err = |a: HttpArgs| OAuth::from_args(&a, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(OAuth::from_args(&HttpArgs::default(), None).is_ok_and(|o| o.is_none()), "off without an issuer");
        for (change, want) in [
            (&(|a: &mut HttpArgs| a.oauth_resource = None) as &dyn Fn(&mut HttpArgs), "oauth_resource is needed"),
            (&|a: &mut HttpArgs| a.oauth_issuer = Some("http://as.example.com".into()), "must be an https"),
            (&|a: &mut HttpArgs| a.oauth_jwks_url = Some("http://as.example.com/jwks".into()), "oauth_jwks_url"),
            (&|a: &mut HttpArgs| a.oauth_algs = vec!["HS256".into()], "symmetric"),
            (&|a: &mut HttpArgs| a.oauth_principal_claim = "a b".into(), "oauth_principal_claim"),
            (&|a: &mut HttpArgs| a.oauth_scope = Some("a\"b".into()), "oauth_scope"),
            (&|a: &mut HttpArgs| a.oauth_jwks_refetch_s = 0, "oauth-jwks-refetch-s"),
            (&|a: &mut HttpArgs| a.oauth_issuer = None, "need oauth_issuer"),
        ] {
            let e = err(args(change));
            assert!(e.contains(want), "{want}: {e}");
        }
        let ok = OAuth::from_args(&args(&|_| {}), None).ok().flatten().expect("valid settings");
        assert_eq!(ok.metadata_path().as_deref(), Some("/.well-known/oauth-protected-resource/mcp"));
        let c = ok.challenge(Some(&Refusal::Scope));
        assert!(
            c.contains("error=\"insufficient_scope\"") && c.contains("resource_metadata=\"https://sb.example.com/"),
            "{c}"
        );
    }

    #[test]
    fn header_text_cannot_break_out_of_its_quotes() {
        assert_eq!(quoted("a\"b\\c\nd"), "a'b'c'd");
    }
}
