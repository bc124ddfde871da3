//! Durable sessions (issue 18, parts 1, 2 and 4): snapshots of a session's workspace and
//! interpreter state, their restoration into a fresh container, hibernation of idle sessions
//! and their transparent wake, and the catalogue of a server's snapshots.
//!
//! Why this file passes 500 lines: the save, the restore and the wake of one session share
//! its lock and its agent, read top to bottom; the storage, the packer and the tar rules are
//! in `docker::snapshot`, the catalogue in `durable`, the caps in `registry/snapshots.rs`.
//!
//! The agent saves what `pickle` can (`Durable` in `images/python/agent.py`) and packs it with
//! the workspace as the code's uid; the server re-packs that tar as hostile input into a
//! volume of its own (`docker::snapshot`). Restoring checks the stored tar against what was
//! stored, unpacks it into the new session's empty workspace, and has the agent load the
//! state. Nothing half-succeeds silently: every name not saved or not restored is listed, and
//! a restore that fails leaves the session fresh (no variables, an empty workspace) and says so.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Error, Inner, Prepared, Session, agent};
use crate::docker::snapshot::{self as store, Bounds, Summary};
use crate::protocol::{Event, Lost, Request};

/// How long the agent may take to load a snapshot's state.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
/// Below this many bytes of state and files, a snapshot goes through the agent's stream: a
/// packer's container costs 250-650 ms before it copies (the Benchmark), the stream moves
/// about 37 MiB/s, so the packer wins only above some 10-25 MiB.
const STREAM_BELOW: u64 = 16 << 20;
/// What `save_state` answers for a session below [`STREAM_BELOW`].
const SMALL: &str = "small enough for the stream";
/// Most names listed as restored or lost.
const MAX_NAMES: usize = 1000;
/// Longest name or reason kept, in characters.
const MAX_NAME_TEXT: usize = 300;

/// Takes a started container from the warm pool, if one is there.
pub(crate) type PoolTake = Arc<dyn Fn() -> Option<Prepared> + Send + Sync>;

/// How much of a session a snapshot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub(crate) enum Grade {
    /// The workspace files only: the interpreter's state could not be saved at all.
    #[serde(rename = "files")]
    Files,
    /// The workspace files and every global that could be saved (the rest are listed).
    #[serde(rename = "files+globals")]
    FilesAndGlobals,
}

impl Grade {
    /// As the results spell it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Grade::Files => "files",
            Grade::FilesAndGlobals => "files+globals",
        }
    }
}

/// A snapshot in the store.
#[derive(Debug, Clone)]
pub(crate) struct Saved {
    /// Its volume.
    pub(crate) store: store::Stored,
    /// The environment of the session it was taken from.
    pub(crate) environment: String,
    /// Requirements that session had (a restore starts from the layer holding them).
    pub(crate) requirements: Vec<String>,
    /// The session's own environment variables.
    pub(crate) env: BTreeMap<String, String>,
    /// What the store holds, as checked on the way in.
    pub(crate) summary: Summary,
    /// How much it holds.
    pub(crate) grade: Grade,
    /// Globals saved.
    pub(crate) saved: Vec<String>,
    /// Globals not saved, and why.
    pub(crate) lost: Vec<Lost>,
    /// Time taken.
    pub(crate) took: Duration,
    /// Of which the agent saving the state (the volume made meanwhile).
    pub(crate) state_took: Duration,
    /// Of which copying state and files into the volume.
    pub(crate) copy_took: Duration,
}

/// What a restore brought back.
#[derive(Debug, Clone, Default)]
pub(crate) struct Restored {
    /// Names that came back.
    pub(crate) restored: Vec<String>,
    /// Names that did not, with why (those the snapshot could not save included).
    pub(crate) lost: Vec<Lost>,
    /// Workspace files and bytes copied.
    pub(crate) files: u64,
    /// Bytes of workspace files.
    pub(crate) bytes: u64,
    /// Time taken.
    pub(crate) took: Duration,
    /// Of which copying the files (and the state's files) into the workspace.
    pub(crate) copy: Duration,
    /// Of which the agent loading the state.
    pub(crate) globals: Duration,
}

/// The part of `meta.json` the server reads: what was saved and what was not.
#[derive(Debug, serde::Deserialize)]
struct Meta {
    #[serde(default)]
    saved: Vec<String>,
    #[serde(default)]
    lost: Vec<Lost>,
}

fn cut(text: String) -> String {
    super::cut(text, MAX_NAME_TEXT)
}

fn cut_lost(lost: Vec<Lost>) -> Vec<Lost> {
    lost.into_iter().take(MAX_NAMES).map(|l| Lost { name: cut(l.name), why: cut(l.why) }).collect()
}

/// The names a snapshot saved and lost: as the agent answered when it saved into the
/// workspace, else from the state's summary in the snapshot, else the reason nothing was saved.
fn saved_and_lost(
    summary: &Summary,
    names: Option<(Vec<String>, Vec<Lost>)>,
    why: Option<&str>,
) -> (Vec<String>, Vec<Lost>) {
    match (&summary.meta, why, names) {
        (_, None, Some(names)) => names,
        (Some(meta), _, _) => match serde_json::from_slice::<Meta>(meta) {
            Ok(m) => (m.saved, m.lost),
            Err(e) => {
                (Vec::new(), vec![Lost { name: "*".into(), why: format!("the state's summary is unreadable: {e}") }])
            }
        },
        (None, Some(why), _) => {
            (Vec::new(), vec![Lost { name: "*".into(), why: format!("the interpreter state was not saved: {why}") }])
        }
        (None, None, None) => (Vec::new(), Vec::new()),
    }
}

impl Session {
    /// Saves the session into a new snapshot volume named after `id`.
    pub(crate) async fn snapshot(&self, id: &str, bounds: Bounds) -> Result<Saved, String> {
        let mut inner = self.inner.lock().await;
        self.touch();
        self.snapshot_locked(&mut inner, id, bounds).await
    }

    async fn snapshot_locked(&self, inner: &mut Inner, id: &str, bounds: Bounds) -> Result<Saved, String> {
        let started = Instant::now();
        if let Some(n) = self.ensure_agent(inner).await.map_err(|e| e.to_string())? {
            inner.pending.push(n);
            inner.pending_lost = true;
        }
        // The agent pickles the state into the workspace while the volume is made.
        let (volume, state) =
            tokio::join!(store::create(&self.docker, &self.owner, &self.principal, id), self.save_state(inner, bounds));
        let volume = match volume {
            Ok(v) => v,
            Err(e) => {
                if state.is_ok() {
                    self.drop_state(inner).await;
                }
                return Err(format!("cannot create the snapshot's volume: {e}"));
            }
        };
        let created = started.elapsed();
        let copying = Instant::now();
        let (first, names, copy_took) = self.copy_first(inner, &volume, bounds, state).await;
        let (grade, summary, why, volume) = match first {
            Ok(summary) => (Grade::FilesAndGlobals, summary, None, volume),
            Err(e) if e.to_string().contains("would be larger than") => {
                store::remove(&self.docker, &volume).await;
                return Err(format!(
                    "the session holds more than --snapshot-cache-mb ({} MiB) to save: make its workspace or its \
                     variables smaller",
                    bounds.bytes >> 20
                ));
            }
            Err(Streamed::Agent(why)) if !self.closed.load(Ordering::SeqCst) => {
                store::remove(&self.docker, &volume).await;
                self.files_only(inner, id, bounds, why).await?
            }
            Err(e) => {
                store::remove(&self.docker, &volume).await;
                return Err(e.to_string());
            }
        };
        let (saved, lost) = saved_and_lost(&summary, names, why.as_deref());
        tracing::debug!(
            session = %self.name,
            store_ms = created.as_millis() as f64,
            total_ms = started.elapsed().as_millis() as f64,
            bytes = summary.bytes(),
            "snapshot taken"
        );
        Ok(Saved {
            store: volume,
            environment: self.environment.clone(),
            requirements: self.requirements(),
            env: self.env(),
            summary,
            grade,
            saved: saved.into_iter().take(MAX_NAMES).map(cut).collect(),
            lost: cut_lost(lost),
            took: started.elapsed(),
            state_took: created,
            copy_took: copy_took.unwrap_or_else(|| copying.elapsed()),
        })
    }

    /// The first way of copying a snapshot: the packer when the agent saved its state into
    /// the workspace, the agent's stream otherwise. Also the names saved and lost, and the
    /// copy's time, when the packer ran.
    async fn copy_first(
        &self,
        inner: &mut Inner,
        volume: &store::Stored,
        bounds: Bounds,
        state: Result<(Vec<String>, Vec<Lost>), String>,
    ) -> (Result<Summary, Streamed>, Option<(Vec<String>, Vec<Lost>)>, Option<Duration>) {
        let copying = Instant::now();
        match state {
            Ok(pair) => {
                let c = inner.container.clone();
                let runtime = self.blueprint.spec.sandboxing.runtime.as_deref();
                let packed = store::pack(&self.packer(runtime, c.uid), &c.volume, volume, bounds, true).await;
                let copied = copying.elapsed();
                self.drop_state(inner).await;
                (packed.map_err(Streamed::Store), Some(pair), Some(copied))
            }
            Err(why) if why.contains("would be larger than") => (Err(Streamed::Agent(why)), None, None),
            Err(why) if why == SMALL => (self.stream_snapshot(inner, volume, bounds, false).await, None, None),
            Err(why) => {
                // An agent that cannot write its state into the workspace (a full one, an
                // older agent): the state travels through its stream instead.
                tracing::info!(session = %self.name, %why, "state not saved into the workspace; streaming it");
                (self.stream_snapshot(inner, volume, bounds, false).await, None, None)
            }
        }
    }

    /// The state could not be saved (out of memory, an agent that stopped): the files alone,
    /// into a new empty volume, and the reason is told.
    async fn files_only(
        &self,
        inner: &mut Inner,
        id: &str,
        bounds: Bounds,
        why: String,
    ) -> Result<(Grade, Summary, Option<String>, store::Stored), String> {
        tracing::warn!(session = %self.name, %why, "interpreter state not saved; saving the files only");
        let volume = store::create(&self.docker, &self.owner, &self.principal, id)
            .await
            .map_err(|e| format!("cannot create the snapshot's volume: {e}"))?;
        if let Some(n) = self.ensure_agent(inner).await.map_err(|e| e.to_string())? {
            inner.pending.push(n);
            inner.pending_lost = true;
        }
        match self.stream_snapshot(inner, &volume, bounds, true).await {
            Ok(summary) => Ok((Grade::Files, summary, Some(why), volume)),
            Err(e) => {
                store::remove(&self.docker, &volume).await;
                Err(e.to_string())
            }
        }
    }

    /// A packer as `uid`, of this session's image.
    fn packer<'a>(&'a self, runtime: Option<&'a str>, uid: u32) -> store::Packer<'a> {
        store::Packer { docker: &self.docker, owner: &self.owner, image: &self.image, runtime, uid }
    }

    /// Has the agent pickle the state into the workspace (`.pyberth-snapshot`, for the
    /// packer); answers the names saved and lost.
    async fn save_state(&self, inner: &mut Inner, bounds: Bounds) -> Result<(Vec<String>, Vec<Lost>), String> {
        // No packer runs on Kubernetes (it would be a pod of its own): every state travels
        // through the agent's stream there.
        let small_below =
            if self.cfg.engine == crate::config::EngineKind::Kubernetes { u64::MAX } else { STREAM_BELOW };
        let id = self
            .submit(inner, &|id| Request::SaveState { id, max_bytes: bounds.bytes, small_below })
            .await
            .map_err(|e| e.to_string())?;
        let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone.to_string()) };
        let answer = agent
            .answer(
                id,
                |id, ev| match ev {
                    Event::Saved { id: i, small: true, .. } if i == id => Some(Err(SMALL.to_owned())),
                    Event::Saved { id: i, saved, lost, .. } if i == id => Some(Ok((saved, lost))),
                    Event::Failed { id: Some(i), message } if i == id => Some(Err(message)),
                    _ => None,
                },
                RESTORE_TIMEOUT,
            )
            .await;
        match answer {
            Ok(r) => r,
            Err(e) => {
                inner.agent = None;
                Err(e.to_string())
            }
        }
    }

    /// Deletes the state the agent saved into the workspace.
    async fn drop_state(&self, inner: &mut Inner) {
        let path = store::SAVE_DIR;
        match self.query(inner, |id| Request::Delete { id, path }, agent::file_answer).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(session = %self.name, error = %e, "cannot delete the saved state"),
            Err(e) => tracing::warn!(session = %self.name, error = %e, "cannot delete the saved state"),
        }
    }

    /// Streams the agent's snapshot (or, `files_only`, a pack of the workspace) through the
    /// hostile-input check into the volume.
    async fn stream_snapshot(
        &self,
        inner: &mut Inner,
        volume: &store::Stored,
        bounds: Bounds,
        files_only: bool,
    ) -> Result<Summary, Streamed> {
        let (tx, reader) = store::chunk_reader();
        let (mut writer, rx) = store::chunk_writer();
        let checker = tokio::task::spawn_blocking(move || {
            let checked = store::check_incoming(reader, &mut writer, bounds, files_only);
            if let Err(e) = &checked {
                writer.fail(e);
            }
            checked
        });
        let via = store::Via { docker: &self.docker, owner: &self.owner, image: &self.image };
        let stored = store::write(via, volume, rx);
        // The agent's bound counts tar bytes (headers and padding too), the checker's content
        // bytes: the agent stops first, ends its archive and says why, and keeps its state.
        let max_bytes = bounds.bytes;
        let fed = async move {
            let make = |id| {
                if files_only {
                    Request::Pack {
                        id,
                        path: ".",
                        max_bytes: Some(max_bytes),
                        max_entries: bounds.entries,
                        newer: None,
                    }
                } else {
                    Request::Snapshot { id, max_bytes, max_entries: bounds.entries }
                }
            };
            let id = self.submit(inner, &make).await.map_err(|e| Streamed::Agent(e.to_string()))?;
            loop {
                match self.piece(inner, id).await {
                    Ok(Some(piece)) => {
                        if tx.send(Bytes::from(piece)).await.is_err() {
                            // The checker stopped (over a bound); its error says why.
                            self.abandon(inner).await;
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => return Err(Streamed::Agent(e)),
                }
            }
        };
        let (fed, stored) = tokio::join!(fed, stored);
        let checked = checker.await.map_err(|e| Streamed::Store(format!("the snapshot checker stopped: {e}")))?;
        fed?;
        let summary = checked.map_err(|e| Streamed::Store(format!("cannot save the snapshot: {e}")))?;
        stored.map_err(|e| Streamed::Store(format!("cannot write the snapshot: {e}")))?;
        Ok(summary)
    }

    /// Restores a snapshot into this session, which must be fresh (just made).
    pub(crate) async fn restore(&self, saved: &Saved) -> Result<Restored, String> {
        let mut inner = self.inner.lock().await;
        self.touch();
        if let Some(n) = self.ensure_agent(&mut inner).await.map_err(|e| e.to_string())? {
            inner.pending.push(n);
        }
        let restored = self.restore_locked(&mut inner, saved).await;
        if restored.is_ok() {
            self.set_env(&saved.env);
        }
        restored
    }

    /// Copies the snapshot's files into the workspace and has the agent load its state. On
    /// any failure the session is made fresh again (a new interpreter, an empty workspace)
    /// and the error says so.
    async fn restore_locked(&self, inner: &mut Inner, saved: &Saved) -> Result<Restored, String> {
        let started = Instant::now();
        match self.restore_steps(inner, saved).await {
            Ok(mut r) => {
                r.took = started.elapsed();
                Ok(r)
            }
            Err(e) => {
                tracing::warn!(session = %self.name, error = %e, "restore failed; the session is left fresh");
                let fresh = self.wipe(inner).await;
                Err(match fresh {
                    Ok(()) => format!(
                        "{e}. Nothing of the snapshot was kept: session {:?} is fresh (no variables, an empty workspace)",
                        self.name
                    ),
                    Err(w) => format!("{e}. Session {:?} could not be made fresh either ({w}): close it", self.name),
                })
            }
        }
    }

    async fn restore_steps(&self, inner: &mut Inner, saved: &Saved) -> Result<Restored, String> {
        let copying = Instant::now();
        if saved.summary.packed {
            let c = inner.container.clone();
            let runtime = self.blueprint.spec.sandboxing.runtime.as_deref();
            store::unpack(&self.packer(runtime, c.uid), &saved.store, &c.volume, &saved.summary).await?;
        } else {
            self.restore_stream(inner, saved).await?;
        }
        self.charge_workspace(inner.container.id.clone(), inner.container.uid).await?;
        let mut restored = Restored {
            files: saved.summary.files,
            bytes: saved.summary.workspace_bytes,
            lost: saved.lost.clone(),
            copy: copying.elapsed(),
            ..Restored::default()
        };
        if saved.grade == Grade::Files {
            return Ok(restored);
        }
        let loading = Instant::now();
        let id = self.submit(inner, &|id| Request::Restore { id, if_saved: false }).await.map_err(|e| e.to_string())?;
        let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone.to_string()) };
        let answer = restore_answer(agent, id).await;
        let (names, lost) = match answer {
            Ok(Ok(pair)) => pair,
            Ok(Err(why)) => return Err(format!("the interpreter state could not be restored: {why}")),
            Err(e) => {
                inner.agent = None;
                return Err(format!("the interpreter state could not be restored: {e}"));
            }
        };
        // The agent's list includes the snapshot's own losses; it is the code's answer, so cut.
        restored.restored = names.into_iter().take(MAX_NAMES).map(cut).collect();
        restored.lost = cut_lost(lost);
        restored.globals = loading.elapsed();
        Ok(restored)
    }

    /// Restores a snapshot stored by the stream (not packed): the volume's tar, checked and
    /// re-packed for the session's uid, through the archive API into its workspace.
    async fn restore_stream(&self, inner: &mut Inner, saved: &Saved) -> Result<(), String> {
        let (id, uid) = (inner.container.id.clone(), inner.container.uid);
        let (tx, reader) = store::chunk_reader();
        let (mut writer, rx) = store::chunk_writer();
        let summary = saved.summary.clone();
        let checker = tokio::task::spawn_blocking(move || {
            let checked = store::check_outgoing(reader, &mut writer, uid, &summary);
            if let Err(e) = &checked {
                writer.fail(e);
            }
            checked
        });
        let via = store::Via { docker: &self.docker, owner: &self.owner, image: &self.image };
        let read = store::read(via, &saved.store, tx);
        let upload = store::upload_workspace(&self.docker, &id, rx);
        let (read, upload) = tokio::join!(read, upload);
        checker.await.map_err(|e| format!("the snapshot checker stopped: {e}"))??;
        read.map_err(|e| format!("cannot read the snapshot: {e}"))?;
        upload.map_err(|e| format!("cannot copy the snapshot's files: {e}"))?;
        Ok(())
    }

    /// A fresh interpreter and an empty workspace.
    async fn wipe(&self, inner: &mut Inner) -> Result<(), String> {
        self.restart_agent(inner).await.map_err(|e| e.to_string())?;
        let listed = self
            .query(inner, |id| Request::List { id, path: ".", recursive: false, limit: 100_000 }, agent::file_answer)
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        for entry in listed.entries {
            let path = entry.path.as_str();
            self.query(inner, |id| Request::Delete { id, path }, agent::file_answer)
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("cannot delete {path}: {e}"))?;
        }
        Ok(())
    }

    /// Puts an idle session to sleep: a snapshot, then its container goes. False when it is
    /// busy, closed or asleep already (nothing done).
    pub(crate) async fn hibernate(&self, id: &str, bounds: Bounds) -> Result<bool, String> {
        let Ok(mut inner) = self.inner.try_lock() else { return Ok(false) };
        if inner.sleeping.is_some() || self.closed.load(Ordering::SeqCst) {
            return Ok(false);
        }
        // Its packages need nothing kept: they are sets of the layer store, attached again to
        // the interpreter a wake starts.
        let saved = self.snapshot_locked(&mut inner, id, bounds).await?;
        tracing::info!(
            session = %self.name,
            bytes = saved.summary.bytes(),
            took_ms = u64::try_from(saved.took.as_millis()).unwrap_or(u64::MAX),
            lost = saved.lost.len(),
            "session hibernated"
        );
        // A close waits while the container goes (its egress network goes after it); one
        // that came first removes the container itself, and this the snapshot.
        let Ok(making) = self.may_make().await else {
            store::remove(&self.docker, &saved.store).await;
            return Ok(false);
        };
        // Recorded asleep before its container goes: a server killed in between leaves a
        // sleeper record (the next one adopts it and sweeps the container), never a session
        // with neither a container nor a record of its snapshot.
        self.hibernating(Some(&saved));
        // Its pod's address is free from now until the wake: its egress policy goes first.
        self.remove_once(&inner.container).await;
        inner.agent = None;
        inner.lease = None;
        if let Ok(mut asleep) = self.asleep.lock() {
            *asleep = Some(saved.clone());
        }
        drop(making);
        // A close does not wait for the session: one that came meanwhile found no snapshot
        // to remove (it reads the snapshot after it marks the session closed; this reads the
        // mark after it sets the snapshot: one of the two sees the other).
        if self.closed.load(Ordering::SeqCst) {
            store::remove(&self.docker, &saved.store).await;
            if let Ok(mut asleep) = self.asleep.lock() {
                *asleep = None;
            }
            self.hibernating(None);
            return Ok(false);
        }
        self.hibernating(None);
        inner.sleeping = Some(saved);
        Ok(true)
    }

    /// True while the session is hibernated, or stopped by its tether (`orphan.rs`).
    pub(crate) fn is_asleep(&self) -> bool {
        self.left_stopped.load(Ordering::SeqCst) || self.asleep.lock().map(|a| a.is_some()).unwrap_or(false)
    }

    /// Wakes a hibernated session: a container (from the warm pool when there is one of its
    /// image), the snapshot restored into it, and a notice for the next call naming what did
    /// not come back. A restore that fails leaves the session fresh, and says so.
    pub(super) async fn wake(&self, inner: &mut Inner) -> Result<(), Error> {
        if inner.sleeping.is_none() {
            return Ok(());
        }
        let making = self.may_make().await?;
        let Some(saved) = inner.sleeping.take() else { return Ok(()) };
        let started = Instant::now();
        let taken = self.pool.get().and_then(|take| take());
        let prepared = match taken {
            Some(p) => p,
            None => {
                match Prepared::make(
                    &self.docker,
                    &self.blueprint,
                    &self.image,
                    &self.owner,
                    &self.name,
                    &self.principal,
                )
                .await
                {
                    Ok(p) => p,
                    Err(e) => {
                        inner.sleeping = Some(saved);
                        return Err(e);
                    }
                }
            }
        };
        let Prepared { inner: fresh, python } = prepared;
        // The pid a next server reattaches to: this agent's, not the one that slept.
        self.agent_pid.store(fresh.agent.as_ref().and_then(agent::Agent::pid).unwrap_or(0), Ordering::Relaxed);
        // Closed meanwhile: the close removes the snapshot and the new container.
        self.take_container(inner, fresh.container)?;
        drop(making);
        inner.agent = fresh.agent;
        if let Ok(mut p) = self.python.lock() {
            *p = python;
        }
        match self.restore_locked(inner, &saved).await {
            Ok(r) => {
                let mut text = format!(
                    "the session had been hibernated while idle and was woken in {} ms: {} files ({} bytes) and {} \
                     names restored",
                    started.elapsed().as_millis(),
                    r.files,
                    r.bytes,
                    r.restored.len()
                );
                if !r.lost.is_empty() {
                    let names: Vec<String> = r.lost.iter().map(|l| format!("{} ({})", l.name, l.why)).collect();
                    text.push_str(&format!("; not restored: {}", names.join("; ")));
                    inner.pending_lost = true;
                }
                inner.pending.push(text);
            }
            Err(e) => {
                inner.pending.push(format!("the session had been hibernated while idle and could not be woken: {e}"));
                inner.pending_lost = true;
            }
        }
        store::remove(&self.docker, &saved.store).await;
        if let Ok(mut asleep) = self.asleep.lock() {
            *asleep = None;
        }
        // Its new container is the one a next server must adopt (issue 26: without this
        // record a woken session was swept at the next restart).
        self.write_through();
        self.blueprint.metrics.session_created(crate::metrics::Source::Wake, &self.principal, started.elapsed());
        Ok(())
    }

    /// The hibernation snapshot's storage, if the session sleeps (removed by close).
    pub(super) fn asleep_store(&self) -> Option<store::Stored> {
        self.asleep.lock().ok().and_then(|a| a.as_ref().map(|s| s.store.clone()))
    }
}

/// Where a snapshot stream failed.
#[derive(Debug)]
enum Streamed {
    /// The agent did not deliver (it refused, stopped or went silent).
    Agent(String),
    /// The check or the store failed.
    Store(String),
}

impl std::fmt::Display for Streamed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Streamed::Agent(e) => write!(f, "the interpreter could not save its state: {e}"),
            Streamed::Store(e) => f.write_str(e),
        }
    }
}
/// The agent's answer to restore request `id`: the names restored and those lost, or why not.
pub(super) async fn restore_answer(
    agent: &mut agent::Agent,
    id: u64,
) -> Result<Result<(Vec<String>, Vec<crate::protocol::Lost>), String>, Error> {
    agent
        .answer(
            id,
            |id, ev| match ev {
                Event::Restored { id: i, restored, lost } if i == id => Some(Ok((restored, lost))),
                Event::Failed { id: Some(i), message } if i == id => Some(Err(message)),
                _ => None,
            },
            RESTORE_TIMEOUT,
        )
        .await
}
