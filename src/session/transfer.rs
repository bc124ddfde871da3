//! Directories in and out of a session's workspace as tar, so that neither the MCP tools nor
//! `pyberth run` reach the engine themselves: everything a front end does goes through the
//! session.
//!
//! In, the engine unpacks (`archive::upload_dir`). Out, the agent packs, as the code's uid
//! (`Request::Pack`): the engine's archive API resolves paths as root inside the container,
//! so a link the code made (`etc_link -> /etc`) would lead it to files the code itself cannot
//! read. What the agent sends is as hostile as the code and is re-packed or unpacked here
//! under the same rules as before.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use bytes::Bytes;

use super::{Error, Inner, QUERY_TIMEOUT, Session};
pub(crate) use crate::docker::archive::Cap;
use crate::docker::archive::{self, CopyBack, Moved};
use crate::protocol::Request;

/// The upload reader (a pure hostile-tar check) and a download's bounds, for the transfer
/// tools: they reach the engine's module only through the session.
pub(crate) use crate::docker::archive::read_upload;

/// Told when a download stopped reading the agent's archive midway (over its bounds): the
/// agent was still sending, so a fresh one was started.
const ABANDONED_NOTICE: &str = "an archive download was stopped midway, so the interpreter was restarted: \
                                variables are gone, workspace files are kept";

/// What to pack: see [`Request::Pack`].
#[derive(Debug, Clone, Copy)]
struct Pack<'a> {
    path: &'a str,
    max_bytes: Option<u64>,
    max_entries: u64,
    newer: Option<u64>,
}

impl Session {
    /// Uploads a host directory as the workspace (without `.git`), at most `cap` bytes.
    pub async fn upload_dir(&self, dir: &Path, cap: Cap) -> Result<Moved, String> {
        let (id, uid) = self.container_and_uid();
        archive::upload_dir(&self.docker, &id, uid, dir, cap).await
    }

    /// Uploads one file into the workspace; returns its (mtime, size).
    pub async fn upload_file(&self, name: &str, data: &[u8]) -> Result<(u64, u64), String> {
        let (id, uid) = self.container_and_uid();
        archive::upload_file(&self.docker, &id, uid, name, data).await
    }

    /// Copies the files the run made or changed since `since` into the host directory `out`
    /// ([`unpacker`](crate::docker::unpack::unpacker)), from a tar of the whole workspace that the agent packs.
    pub async fn download_changed(
        &self,
        since: SystemTime,
        rules: CopyBack,
        out: &Path,
        cap: Cap,
    ) -> Result<Moved, String> {
        let since = since.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let (tx, unpacker) = crate::docker::unpack::unpacker(out, since, rules, cap)?;
        // One entry past the unpacker's own bound, so that its message is the one told.
        let max_entries = cap.files.saturating_mul(4).saturating_add(1);
        let pack = Pack { path: ".", max_bytes: None, max_entries, newer: Some(since) };
        let streamed = async {
            let mut inner = self.inner.lock().await;
            let id = self.pack(&mut inner, pack).await?;
            while let Some(piece) = self.piece(&mut inner, id).await? {
                if tx.send(Bytes::from(piece)).await.is_err() {
                    // The unpacker stopped; its error says why.
                    self.abandon(&mut inner).await;
                    return Ok(());
                }
            }
            Ok::<(), String>(())
        }
        .await;
        drop(tx);
        let moved = unpacker.await.map_err(|e| format!("the unpacker stopped: {e}"))??;
        streamed.map_err(|e| format!("cannot download the workspace: {e}"))?;
        Ok(moved)
    }

    /// A workspace file or directory as a tar of its regular files and directories, packed
    /// by the agent and re-packed here ([`archive::repack`]).
    pub async fn download_tree(&self, rel: &str, cap: Cap) -> Result<(Vec<u8>, Moved), String> {
        let limit = archive::raw_cap(cap);
        // The agent stops short of the limit: the end of the archive and its last record fit.
        let max_bytes = Some(limit.saturating_sub(64 << 10));
        let pack = Pack { path: rel, max_bytes, max_entries: cap.files.saturating_mul(4), newer: None };
        let raw = async {
            let mut inner = self.inner.lock().await;
            let id = self.pack(&mut inner, pack).await?;
            let mut raw = Vec::new();
            while let Some(piece) = self.piece(&mut inner, id).await? {
                raw.extend_from_slice(&piece);
                if raw.len() as u64 > limit {
                    self.abandon(&mut inner).await;
                    return Err(format!("{rel} holds more than {} MiB: download a smaller directory", cap.bytes >> 20));
                }
            }
            Ok(raw)
        }
        .await
        .map_err(|e| format!("cannot download {rel}: {e}"))?;
        let rel = rel.to_owned();
        tokio::task::spawn_blocking(move || archive::repack(&raw, &rel, cap))
            .await
            .map_err(|e| format!("the re-packer stopped: {e}"))?
    }

    /// Asks the agent to pack `what`; returns the request's id, for [`Session::piece`]. The
    /// agent is started in the session's own container if need be, never by replacing the
    /// container: its workspace is what is asked for.
    async fn pack(&self, inner: &mut Inner, what: Pack<'_>) -> Result<u64, String> {
        self.touch();
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed.to_string());
        }
        if inner.sleeping.is_some() {
            self.wake(inner).await.map_err(|e| e.to_string())?;
        }
        if inner.agent.is_none() {
            self.start_agent(inner).await.map_err(|e| e.to_string())?;
        }
        let Pack { path, max_bytes, max_entries, newer } = what;
        let make = |id| Request::Pack { id, path, max_bytes, max_entries, newer };
        self.submit(inner, &make).await.map_err(|e| e.to_string())
    }

    /// The next piece of the tar the agent packs for request `id`; `None` at its end.
    pub(super) async fn piece(&self, inner: &mut Inner, id: u64) -> Result<Option<Vec<u8>>, String> {
        let Some(agent) = inner.agent.as_mut() else { return Err(Error::AgentGone.to_string()) };
        match agent.piece(id, QUERY_TIMEOUT).await {
            Ok(piece) => Ok(piece),
            Err(Error::Refused(why)) => Err(why),
            Err(e) => {
                self.abandon(inner).await;
                Err(e.to_string())
            }
        }
    }

    /// The agent is still sending an archive nobody reads, or is dead: a fresh one.
    pub(super) async fn abandon(&self, inner: &mut Inner) {
        inner.pending.push(ABANDONED_NOTICE.into());
        inner.pending_lost = true;
        let notes = self.recover(inner).await;
        inner.pending.extend(notes);
    }
}
