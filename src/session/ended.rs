//! Terminal states are honest (issue 26 item 4): why a session's state was last lost, kept an
//! hour for `list_sessions` beside the notice of the result that first said it. Why a session
//! itself ended (closed, expired) is the registry's (`Registry::ended`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::run::RunOutcome;

/// How long an end or a loss is told after it happened.
pub(crate) const KEPT: Duration = Duration::from_secs(3600);
/// Longest reason kept, in characters.
const MAX_WHY: usize = 600;

/// Why and when a session's state was last lost.
#[derive(Debug, Default)]
pub(crate) struct LastLoss(Mutex<Option<(String, Instant)>>);

impl LastLoss {
    /// After a run: its notices, when it says the state was lost.
    pub(crate) fn note(&self, outcome: &RunOutcome) {
        if !outcome.state_lost {
            return;
        }
        let why: String = outcome.notices.join("; ").chars().take(MAX_WHY).collect();
        let why = if why.is_empty() { "the interpreter was restarted".to_owned() } else { why };
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some((why, Instant::now()));
    }

    /// The last loss within [`KEPT`], with how long ago.
    pub(crate) fn describe(&self) -> Option<String> {
        let last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (why, at) = last.as_ref()?;
        (at.elapsed() < KEPT).then(|| format!("{why} ({} s ago)", at.elapsed().as_secs()))
    }
}
