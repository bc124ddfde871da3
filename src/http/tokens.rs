//! Bearer tokens: the tokens file, `PYBERTH_TOKEN`, and the layer that turns a request's token
//! into its [`Principal`].

use std::path::Path;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq as _;

use super::admission::Authenticated;
use super::oauth::{OAuth, Refusal};
use super::{Error, HttpArgs, TokenProblem};
use crate::server::Principal;

/// Principal of the single `PYBERTH_TOKEN`, and of callers of a token-less loopback server.
pub const DEFAULT_PRINCIPAL: &str = "default";
/// Shortest token accepted: shorter ones are guessable.
const MIN_TOKEN_LEN: usize = 16;

/// One principal and its token.
type Entry = (Arc<str>, Vec<u8>);

/// The accepted tokens.
#[derive(Debug, Default)]
pub struct Tokens(Vec<Entry>);

impl Tokens {
    /// Reads the tokens file and/or the single token.
    pub fn load(args: &HttpArgs) -> Result<Self, Error> {
        let mut tokens = Vec::new();
        if let Some(path) = &args.tokens_file {
            tokens = parse_tokens_file(path)?;
        }
        if let Some(t) = &args.token {
            check_token(t).map_err(Error::Token)?;
            tokens.push((Arc::from(DEFAULT_PRINCIPAL), t.as_bytes().to_vec()));
        }
        Ok(Self(tokens))
    }

    /// Whether no tokens are configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The principal a presented token belongs to. Every token is compared in full, each in
    /// time independent of where it differs.
    fn principal(&self, presented: &[u8]) -> Option<Arc<str>> {
        let mut found = None;
        for (principal, token) in &self.0 {
            let same: bool = token.as_slice().ct_eq(presented).into();
            if same && found.is_none() {
                found = Some(principal.clone());
            }
        }
        found
    }
}

fn check_token(t: &str) -> Result<(), TokenProblem> {
    if t.len() < MIN_TOKEN_LEN || t.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(TokenProblem::Weak);
    }
    Ok(())
}

fn parse_tokens_file(path: &Path) -> Result<Vec<Entry>, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::ReadTokens { path: path.to_owned(), source })?;
    let mut out: Vec<Entry> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |problem| Error::TokensLine { path: path.to_owned(), line: n + 1, problem };
        let Some((principal, token)) = line.split_once(':') else {
            return Err(at(TokenProblem::NoColon));
        };
        let principal = principal.trim();
        if !super::oauth::principal_name_ok(principal) {
            return Err(at(TokenProblem::Principal));
        }
        let token = token.trim();
        check_token(token).map_err(at)?;
        if out.iter().any(|(_, t)| t == token.as_bytes()) {
            return Err(at(TokenProblem::Duplicate));
        }
        out.push((Arc::from(principal), token.as_bytes().to_vec()));
    }
    if out.is_empty() {
        return Err(Error::NoTokens(path.to_owned()));
    }
    Ok(out)
}

/// What a request may authenticate with: static tokens, and JWTs of an OAuth issuer.
#[derive(Debug)]
pub(super) struct Auth {
    pub(super) tokens: Arc<Tokens>,
    pub(super) oauth: Option<Arc<OAuth>>,
}

/// Checks the bearer token and records the caller's principal for the layers and tools after.
/// A static token is looked up first; any other is tried as an OAuth access token. Each
/// outcome is audited (the principal, or `unknown`; never the token), coalesced per principal
/// and minute: a client that retries a bad token thousands of times makes two lines.
pub(super) async fn authenticate(
    auth: Arc<Auth>,
    audit: crate::audit::Audit,
    mut req: Request,
    next: Next,
) -> Response {
    if auth.tokens.is_empty() && auth.oauth.is_none() {
        // Loopback only (checked at start): the local user, as over stdio.
        req.extensions_mut().insert(Principal(Arc::from(DEFAULT_PRINCIPAL)));
        return authenticated(next.run(req).await);
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(|t| t.trim().to_owned());
    let found = match &presented {
        None => Err(None),
        Some(t) => match (auth.tokens.principal(t.as_bytes()), &auth.oauth) {
            (Some(p), _) => Ok(p),
            (None, Some(oauth)) => oauth.verify(t).await.map_err(Some),
            (None, None) => Err(Some(Refusal::Invalid(String::new()))),
        },
    };
    match found {
        Ok(principal) => {
            audit.emit(crate::audit::Event::new("token", &principal).outcome("accepted").coalesced());
            req.extensions_mut().insert(Principal(principal));
            authenticated(next.run(req).await)
        }
        Err(refusal) => {
            let outcome = if presented.is_some() { "refused" } else { "missing" };
            audit.emit(crate::audit::Event::new("token", "unknown").outcome(outcome).coalesced());
            let mut resp = match &auth.oauth {
                Some(oauth) => oauth_refusal(oauth, refusal),
                None => static_refusal(presented.is_some()),
            };
            resp.extensions_mut().insert(super::Refused("token"));
            resp
        }
    }
}

/// A refusal when only static tokens are configured.
fn static_refusal(presented: bool) -> Response {
    let why = if presented { "the token is not valid" } else { "a bearer token is required" };
    let body = serde_json::json!({ "error": format!("{why}: send Authorization: Bearer <token>") });
    let mut resp = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    // The reason in the challenge too (RFC 6750): MCP client libraries surface the
    // header (rmcp's AuthRequired carries it), not the body.
    let challenge = if presented {
        "Bearer error=\"invalid_token\", error_description=\"the token is not valid: send Authorization: Bearer <token>\""
    } else {
        "Bearer error_description=\"a bearer token is required: send Authorization: Bearer <token>\""
    };
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    resp
}

/// A refusal when OAuth is on: 401 (no token, or an invalid one) or 403 (a scope missing),
/// with the challenge pointing at the Protected Resource Metadata.
fn oauth_refusal(oauth: &OAuth, refusal: Option<Refusal>) -> Response {
    let (status, text) = match &refusal {
        None => (
            StatusCode::UNAUTHORIZED,
            format!(
                "a bearer token is required: get one from the authorization server named at {}",
                oauth.metadata_url()
            ),
        ),
        Some(Refusal::Invalid(why)) if why.is_empty() => (StatusCode::UNAUTHORIZED, "the token is not valid".into()),
        Some(Refusal::Invalid(why)) => (StatusCode::UNAUTHORIZED, why.clone()),
        Some(Refusal::Scope) => (StatusCode::FORBIDDEN, "the token lacks a scope this server requires".into()),
    };
    tracing::debug!(status = status.as_u16(), "bearer token refused: {text}");
    let mut resp = (status, axum::Json(serde_json::json!({ "error": text }))).into_response();
    let refusal = match refusal {
        Some(Refusal::Invalid(why)) if why.is_empty() => Some(Refusal::Invalid("the token is not valid".into())),
        r => r,
    };
    if let Ok(v) = HeaderValue::from_str(&oauth.challenge(refusal.as_ref())) {
        resp.headers_mut().insert(header::WWW_AUTHENTICATE, v);
    }
    resp
}

/// Tells admission the connection carried a valid token (it is then never displaced).
fn authenticated(mut resp: Response) -> Response {
    resp.extensions_mut().insert(Authenticated);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_file_lines_are_checked_and_name_their_line() {
        let dir = std::env::temp_dir().join(format!("pyberth-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("tokens");
        let write = |text: &str| std::fs::write(&file, text).expect("write");
        write("# team\nalice:aaaaaaaaaaaaaaaaaaaa\n\nbob : bbbbbbbbbbbbbbbbbbbb\n");
        let tokens = parse_tokens_file(&file).expect("valid");
        let t = Tokens(tokens);
        assert_eq!(t.principal(b"bbbbbbbbbbbbbbbbbbbb").as_deref(), Some("bob"));
        assert_eq!(t.principal(b"aaaaaaaaaaaaaaaaaaaa").as_deref(), Some("alice"));
        assert!(t.principal(b"aaaaaaaaaaaaaaaaaaab").is_none());
        assert!(t.principal(b"aaaaaaaaaaaaaaaaaaaaa").is_none());
        assert!(t.principal(b"").is_none());
        for (bad, why) in [
            ("alice\n", "line 1: write principal:token"),
            ("alice:short\n", "line 1: a token must be"),
            ("a b:cccccccccccccccccccc\n", "line 1: the principal"),
            ("x:dddddddddddddddddddd\ny:dddddddddddddddddddd\n", "line 2: this token is already"),
            ("# nothing\n", "no tokens"),
        ] {
            write(bad);
            let e = parse_tokens_file(&file).expect_err(bad).to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
