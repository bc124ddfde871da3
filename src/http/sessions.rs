//! MCP transport sessions belong to the principal whose `initialize` opened them.
//!
//! rmcp's session manager knows session ids, not principals: any valid token presenting an
//! `Mcp-Session-Id` could resume that session's streams, post into it or DELETE it. The layer
//! here records the id rmcp hands out in the response to an `initialize`, per principal, and
//! answers a request carrying an id of another principal, or of none, exactly as rmcp answers
//! an unknown one (404). [`Bound`] wraps rmcp's manager to forget an id when its session ends
//! for any reason: DELETE, idle expiry, the client's service ending, shutdown.
//!
//! Each principal may have a bounded number of sessions open: past it an `initialize` gets a
//! JSON-RPC error naming the flag, which says nothing of other principals.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::Request;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::session::{EventStore, ServerSseMessage};
use rmcp::transport::streamable_http_server::{RestoreOutcome, SessionId, SessionManager};

use crate::server::Principal;

/// The header that carries an MCP transport session id.
const SESSION_HEADER: &str = "mcp-session-id";

/// Which principal opened each live MCP transport session, and how many each may open.
#[derive(Debug)]
pub(super) struct Owners {
    state: Mutex<State>,
    /// Sessions one principal may have open, `initialize` requests in flight included.
    per_principal: usize,
}

#[derive(Debug, Default)]
struct State {
    owner_of: HashMap<String, Arc<str>>,
    /// `initialize` requests admitted and not answered yet, per principal.
    pending: HashMap<Arc<str>, usize>,
}

impl Owners {
    pub(super) fn new(per_principal: usize) -> Self {
        Owners { state: Mutex::default(), per_principal }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state stays consistent whatever panicked while it was held: one insert or remove.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn belongs(&self, id: &str, principal: &str) -> bool {
        self.lock().owner_of.get(id).is_some_and(|owner| **owner == *principal)
    }

    fn record(&self, id: &str, principal: Arc<str>) {
        self.lock().owner_of.insert(id.to_owned(), principal);
    }

    fn forget(&self, id: &str) {
        self.lock().owner_of.remove(id);
    }

    /// A place for one more session of `principal`, if it has one left.
    fn reserve(self: &Arc<Self>, principal: &Arc<str>) -> Option<Reservation> {
        let mut state = self.lock();
        let open = state.owner_of.values().filter(|p| **p == *principal).count();
        let pending = state.pending.get(principal).copied().unwrap_or(0);
        if open + pending >= self.per_principal {
            return None;
        }
        *state.pending.entry(principal.clone()).or_default() += 1;
        Some(Reservation { owners: self.clone(), principal: principal.clone() })
    }
}

/// A place held for an `initialize` in flight; given back when dropped.
struct Reservation {
    owners: Arc<Owners>,
    principal: Arc<str>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut state = self.owners.lock();
        if let Some(n) = state.pending.get_mut(&self.principal) {
            *n -= 1;
            if *n == 0 {
                state.pending.remove(&self.principal);
            }
        }
    }
}

/// rmcp's in-memory session manager, which tells [`Owners`] when a session closes.
#[derive(Debug)]
pub(super) struct Bound {
    inner: LocalSessionManager,
    owners: Arc<Owners>,
}

impl Bound {
    pub(super) fn new(owners: Arc<Owners>) -> Self {
        Bound { inner: LocalSessionManager::default(), owners }
    }
}

impl SessionManager for Bound {
    type Error = <LocalSessionManager as SessionManager>::Error;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        self.inner.create_session().await
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        self.inner.initialize_session(id, message).await
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        self.inner.has_session(id).await
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        let closed = self.inner.close_session(id).await;
        self.owners.forget(id);
        closed
    }

    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.create_stream(id, message).await
    }

    async fn accept_message(&self, id: &SessionId, message: ClientJsonRpcMessage) -> Result<(), Self::Error> {
        self.inner.accept_message(id, message).await
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.create_standalone_stream(id).await
    }

    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.resume(id, last_event_id).await
    }

    async fn restore_session(&self, id: SessionId) -> Result<RestoreOutcome<Self::Transport>, Self::Error> {
        self.inner.restore_session(id).await
    }

    fn event_store(&self) -> Option<Arc<dyn EventStore>> {
        self.inner.event_store()
    }
}

/// What rmcp answers for a session id it does not know, byte for byte: a foreign session must
/// be indistinguishable from one that never existed.
fn unknown_session() -> Response {
    let mut resp = Response::new(Body::from("Not Found: Session not found"));
    *resp.status_mut() = StatusCode::NOT_FOUND;
    resp.extensions_mut().insert(super::Refused("session"));
    resp
}

/// The first fields of a JSON-RPC message, enough to tell an `initialize`.
#[derive(serde::Deserialize)]
struct Probe {
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default)]
    method: Option<String>,
}

/// The answer to an `initialize` past the cap: a JSON-RPC error a client shows as it is.
fn too_many(id: Option<serde_json::Value>, cap: usize) -> Response {
    let message = format!(
        "this token already has {cap} open MCP sessions, the most --max-mcp-sessions-per-caller allows: end one \
         (clients send HTTP DELETE with its Mcp-Session-Id when they close) or let one expire (5 minutes without \
         requests)"
    );
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": id.unwrap_or(serde_json::Value::Null),
        "error": { "code": -32000, "message": message },
    });
    let mut resp = (StatusCode::OK, axum::Json(body)).into_response();
    resp.extensions_mut().insert(super::Refused("mcp_sessions"));
    resp
}

/// The layer: requests with a session id reach rmcp only from the principal that opened the
/// session; an `initialize` needs a place left under the principal's cap, and the id in its
/// answer is recorded for the principal. `max_body` is rmcp's own request body limit.
pub(super) async fn bind(
    owners: Arc<Owners>,
    manager: Arc<Bound>,
    max_body: usize,
    req: Request,
    next: Next,
) -> Response {
    let Some(principal) = req.extensions().get::<Principal>().map(|p| p.0.clone()) else {
        // The token layer runs first and always sets one.
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    if let Some(id) = req.headers().get(SESSION_HEADER) {
        let id = String::from_utf8_lossy(id.as_bytes());
        if !owners.belongs(&id, &principal) {
            return unknown_session();
        }
        let delete = req.method() == Method::DELETE;
        let mut resp = next.run(req).await;
        // rmcp answers 202; the spec names no code, and the Python SDK warns on any but 200
        // and 204 ("Session termination failed: 202"). 200 is what the TypeScript SDK answers.
        if delete && resp.status() == StatusCode::ACCEPTED {
            *resp.status_mut() = StatusCode::OK;
        }
        return resp;
    }
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    // Only an `initialize` opens a session: read the body (rmcp reads it whole anyway) to
    // tell, and hand it on.
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, max_body).await else {
        let message = format!("the request body is over {} MiB (--max-request-mb), or was cut", max_body >> 20);
        let mut resp = (StatusCode::PAYLOAD_TOO_LARGE, message).into_response();
        resp.extensions_mut().insert(super::Refused("too_large"));
        return resp;
    };
    let probe = serde_json::from_slice::<Probe>(&bytes).ok();
    let req = Request::from_parts(parts, Body::from(bytes));
    let Some(probe) = probe.filter(|p| p.method.as_deref() == Some("initialize")) else {
        return next.run(req).await;
    };
    let Some(place) = owners.reserve(&principal) else {
        return too_many(probe.id, owners.per_principal);
    };
    let resp = next.run(req).await;
    if let Some(id) = resp.headers().get(SESSION_HEADER).and_then(|v| v.to_str().ok()) {
        owners.record(id, principal);
        // The session may already have ended (its close forgot nothing then): check after
        // recording, so whichever comes last wins.
        if !manager.has_session(&SessionId::from(id)).await.unwrap_or(false) {
            owners.forget(id);
        }
    }
    drop(place);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_per_principal_and_given_back() {
        let owners = Arc::new(Owners::new(2));
        let (alice, bob): (Arc<str>, Arc<str>) = ("alice".into(), "bob".into());
        let first = owners.reserve(&alice).expect("first");
        owners.record("a1", alice.clone());
        drop(first);
        let second = owners.reserve(&alice).expect("second, in flight");
        assert!(owners.reserve(&alice).is_none(), "an initialize in flight holds its place");
        assert!(owners.reserve(&bob).is_some(), "bob's places are his own");
        drop(second);
        owners.record("a2", alice.clone());
        assert!(owners.reserve(&alice).is_none());
        assert!(owners.belongs("a1", "alice") && !owners.belongs("a1", "bob") && !owners.belongs("zz", "alice"));
        owners.forget("a1");
        assert!(!owners.belongs("a1", "alice"));
        assert!(owners.reserve(&alice).is_some(), "a closed session gives its place back");
    }
}
