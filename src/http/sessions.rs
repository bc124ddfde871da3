//! MCP transport sessions belong to the principal whose `initialize` opened them.
//!
//! rmcp's session manager knows session ids, not principals: any valid token presenting an
//! `Mcp-Session-Id` could resume that session's streams, post into it or DELETE it. The layer
//! here records the id rmcp hands out in the response to an `initialize`, per principal, and
//! answers a request carrying an id of another principal, or of none, exactly as rmcp answers
//! an unknown one (404). [`Bound`] wraps rmcp's manager to forget an id when its session ends
//! for any reason: DELETE, idle expiry, the client's service ending, shutdown.

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

/// Which principal opened each live MCP transport session.
#[derive(Debug, Default)]
pub(super) struct Owners(Mutex<HashMap<String, Arc<str>>>);

impl Owners {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<str>>> {
        // The map stays consistent whatever panicked while it was held: one insert or remove.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn belongs(&self, id: &str, principal: &str) -> bool {
        self.lock().get(id).is_some_and(|owner| **owner == *principal)
    }

    fn record(&self, id: &str, principal: Arc<str>) {
        self.lock().insert(id.to_owned(), principal);
    }

    fn forget(&self, id: &str) {
        self.lock().remove(id);
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
    resp
}

/// The layer: requests with a session id reach rmcp only from the principal that opened the
/// session; the id in the answer to an `initialize` is recorded for its principal.
pub(super) async fn bind(owners: Arc<Owners>, manager: Arc<Bound>, req: Request, next: Next) -> Response {
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
    let resp = next.run(req).await;
    if let Some(id) = resp.headers().get(SESSION_HEADER).and_then(|v| v.to_str().ok()) {
        owners.record(id, principal);
        // The session may already have ended (its close forgot nothing then): check after
        // recording, so whichever comes last wins.
        if !manager.has_session(&SessionId::from(id)).await.unwrap_or(false) {
            owners.forget(id);
        }
    }
    resp
}
