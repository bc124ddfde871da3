//! Why a session could not be had, as the registry says it to the fronts.

use super::*;

/// Why a session could not be had.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller's session cap is reached.
    #[error(
        "you have {0} sessions open (the limit per caller): close one with close_session, or wait for idle ones to expire"
    )]
    Capacity(usize),
    /// The server is stopping: nothing new is made.
    #[error("the server is stopping: call again once it is back")]
    Stopping,
    /// The server's session ceiling is reached; says nothing of who holds the sessions.
    #[error("the server has no room for another session right now: try again later, or close one of yours")]
    ServerFull,
    /// A tool that needs an existing session named one that does not exist.
    #[error("no session named {0:?}: run_python creates sessions; list_sessions shows the open ones")]
    NotFound(String),
    /// The session existed and ended: why, as [`Ended`] says it.
    #[error("no session named {name:?}: it {why}; run_python with that name starts a new, empty one")]
    Ended { name: String, why: String },
    /// The sandbox image could not be found or built.
    #[error("the sandbox image is unavailable: {0}")]
    Image(#[source] docker::Error),
    /// Installing packages failed.
    #[error(transparent)]
    Install(#[from] packages::Error),
    /// The session failed to start.
    #[error(transparent)]
    Session(#[from] SessionError),
    /// No such environment (said to an MCP caller: `pyberth run` checks the name first).
    #[error("{0} (list_environments describes them)")]
    Environment(String),
    /// The session exists in another environment.
    #[error(
        "session {session:?} runs in environment {has:?}, not {asked:?}: a session keeps its environment for life. \
         Use another session name for {asked:?}, or close_session {session:?} first (its variables and files go)"
    )]
    OtherEnvironment { session: String, has: String, asked: String },
    /// A quota of the caller is used up (the text says which, and how it frees).
    #[error("{0}")]
    Quota(String),
    /// The session's network could not be had, or a caller asked to widen its allow-list.
    #[error("{0}")]
    Egress(String),
}
