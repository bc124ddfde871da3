//! A session whose server went (docs/design.md D12, "Orphans"): after the grace its keeper had
//! the agent save its state into the workspace and end, and its tether stopped the container
//! (`docker/tether.rs`), which the engine then removed: its volumes and its record are what
//! is left. The next server takes it like a hibernated session: its first call makes a
//! container on those volumes again and restores that state in place.

use super::{Error, Inner, Session, agent};
use crate::docker::container;
use crate::protocol::{NOTHING_SAVED, Request};

impl Session {
    /// The session's container stopped (and went) while no server held it: a new one on its
    /// volumes, tethered, a fresh agent, and what it saved restored. Err: it cannot be made
    /// (its volume gone, say); the caller replaces it.
    pub(super) async fn restart_stopped(&self, inner: &mut Inner) -> Result<String, Error> {
        let making = self.may_make().await?;
        let old = inner.container.clone();
        let store = super::open_store(&self.docker).await?;
        let made = self
            .blueprint
            .recreate(
                &self.docker,
                store.session_mount(),
                &self.image,
                &self.owner,
                &self.name,
                &self.principal,
                &old.volume,
                old.uid,
            )
            .await?;
        self.take_container(inner, made.clone())?;
        drop(making);
        // A fresh container numbers its pids afresh: the old agent's pid proves nothing now.
        inner.reattach_pid = None;
        self.start_agent(inner).await?;
        tracing::info!(session = %self.name, container = %container::short(&made.id), "a session its server had left was given a container on its volumes again");
        Ok(match Box::pin(self.restore_saved(inner)).await {
            Some(text) => text,
            None => {
                inner.pending_lost = true;
                "the session's server had gone and its container stopped before its state was saved; it was started \
                 again: variables are gone, workspace files are kept"
                    .into()
            }
        })
    }

    /// Right after an adoption: reaches the interpreter the stopped server left, so that the
    /// session's first call does not wait for the attach (issue 29, reattach). What the attach
    /// finds (another interpreter, a restore) is said by that first call, as if it had made it.
    pub(crate) async fn preattach(&self) {
        let mut inner = self.inner.lock().await;
        // A call came first and attached, or the container went: the first call does it.
        if inner.agent.is_some() || inner.reattach_pid.is_none() || inner.sleeping.is_some() {
            return;
        }
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        match self.ensure_agent(&mut inner).await {
            Ok(None) => {}
            Ok(Some(notice)) => {
                inner.pending.push(notice);
                inner.pending_lost = true;
            }
            Err(e) => {
                tracing::info!(session = %self.name, error = %e, "no attach ahead of the first call; it tries again")
            }
        }
    }

    /// After a new agent answered where an earlier one was expected: the state the earlier
    /// one saved for a next server, restored; else the notice that its state is gone.
    pub(super) async fn after_reattach(&self, inner: &mut Inner) -> Option<String> {
        let expected = inner.reattach_pid?;
        if inner.agent.as_ref().and_then(agent::Agent::pid) == Some(expected) {
            return self.reattached(inner);
        }
        match Box::pin(self.restore_saved(inner)).await {
            Some(text) => {
                inner.reattach_pid = None;
                Some(text)
            }
            None => self.reattached(inner),
        }
    }

    /// Restores the state an agent saved for a next server. `None` when none was saved.
    async fn restore_saved(&self, inner: &mut Inner) -> Option<String> {
        let answer = async {
            let id = self.submit(inner, &|id| Request::Restore { id, if_saved: true }).await?;
            let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone) };
            super::snapshot::restore_answer(agent, id).await
        }
        .await;
        let head = "the session's server had gone, so it saved its state and stopped (asleep); it was woken now";
        match answer {
            Ok(Ok((restored, lost))) => {
                let mut text = format!("{head}: {} names restored, workspace files kept", restored.len());
                if !lost.is_empty() {
                    let names: Vec<String> = lost.iter().take(50).map(|l| format!("{} ({})", l.name, l.why)).collect();
                    text.push_str(&format!("; not restored: {}", names.join("; ")));
                    inner.pending_lost = true;
                }
                Some(text)
            }
            Ok(Err(why)) if why == NOTHING_SAVED => None,
            Ok(Err(why)) => {
                inner.pending_lost = true;
                Some(format!(
                    "{head}, but its state could not be restored ({why}): variables are gone, workspace files are kept"
                ))
            }
            Err(e) => {
                inner.pending_lost = true;
                Some(format!(
                    "{head}, but its state could not be restored ({e}): variables are gone, workspace files are kept"
                ))
            }
        }
    }
}
