//! Durable sessions (issue 18): `snapshot_session`, `restore_session`, `fork_session`,
//! `list_snapshots`, `delete_snapshot`.
//!
//! A snapshot belongs to the principal that took it; another principal's behaves exactly as a
//! missing one (the same answer). Snapshots are bounded in total by `--snapshot-cache-mb`,
//! least recently used first out (the caller's own before anyone else's), and per caller by
//! `--max-snapshots-per-caller` and `--snapshot-mb-per-caller`, its hibernated sessions
//! included. The policy and the engine calls are the snapshot owner's
//! (`session/registry/snapshots.rs`): these handlers check arguments, call it and render.

use rmcp::handler::server::common::schema_for_output;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::{tool, tool_router};
use serde::{Deserialize, Serialize};

use super::error::ToolResult;
use super::render::structured;
use super::{Caller, SandboxServer};
use crate::checks::session_name;
use crate::durable::catalogue::Entry;
use crate::output::{count, one_line};
use crate::protocol::Lost;
use crate::session::snapshot::Grade;
use crate::telemetry;
use tracing::Instrument as _;
/// Names shown in a result's text; the structured content has them all.
const SHOWN: usize = 50;

/// Arguments of `snapshot_session`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SnapshotArgs {
    /// Session to save. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
    /// Name of the snapshot (1-40 letters, digits, '.', '_' or '-'); an existing snapshot of
    /// yours with this name is replaced. Omitted: one is made up and returned.
    #[serde(default)]
    pub name: Option<String>,
}

/// Arguments of `restore_session`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RestoreArgs {
    /// Name of one of your snapshots (list_snapshots).
    pub snapshot: String,
    /// Name of the new session to make from it; it must not exist yet.
    pub session: String,
}

/// Arguments of `fork_session`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ForkArgs {
    /// Session to copy. Omit for the default session.
    #[serde(default)]
    pub session: Option<String>,
    /// Name of the new session; it must not exist yet.
    pub new_session: String,
}

/// Arguments of `delete_snapshot`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct DeleteSnapshotArgs {
    /// Name of one of your snapshots.
    pub snapshot: String,
}

/// One snapshot, as listed and as `snapshot_session` returns it.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct SnapshotOutput {
    /// Snapshot name.
    pub snapshot: String,
    /// The session it was taken from.
    pub session: String,
    /// `files+globals`: workspace files and every global that pickled (the rest are in
    /// `lost`); `files`: the interpreter's state could not be saved at all.
    pub grade: Grade,
    /// Workspace files saved.
    pub files: u64,
    /// Their bytes.
    pub workspace_bytes: u64,
    /// Bytes of the saved interpreter state.
    pub state_bytes: u64,
    /// Links, FIFOs and other entries of the workspace not saved.
    pub skipped_entries: u64,
    /// Globals saved (modules, definitions and values).
    pub saved: Vec<String>,
    /// Globals not saved, with why: open files, sockets, threads, lambdas, closures, objects
    /// that refuse to pickle.
    pub lost: Vec<Lost>,
    /// Time the snapshot took, ms.
    pub took_ms: u64,
    /// Of `took_ms`, the interpreter saving its state, ms.
    pub state_ms: u64,
    /// Of `took_ms`, copying the state and the files into the snapshot's volume, ms.
    pub copy_ms: u64,
    /// Seconds since it was taken.
    pub age_s: u64,
}

/// Structured result of `list_snapshots`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct SnapshotList {
    /// Your snapshots, newest first (without their lists of names).
    pub snapshots: Vec<SnapshotOutput>,
    /// Bytes all snapshots of the server take, and the bound (--snapshot-cache-mb).
    pub total_bytes: u64,
    /// The bound, bytes; least recently used snapshots go above it.
    pub cache_bytes: u64,
}

/// Structured result of `restore_session` and `fork_session`.
#[derive(Debug, Serialize, schemars::JsonSchema)]
pub(super) struct RestoreOutput {
    /// The new session.
    pub session: String,
    /// The snapshot it was made from (for a fork, the session forked).
    pub from: String,
    /// Grade of the snapshot.
    pub grade: Grade,
    /// Workspace files copied, and their bytes.
    pub files: u64,
    /// Bytes of workspace files copied.
    pub bytes: u64,
    /// Names that came back.
    pub restored: Vec<String>,
    /// Names that did not, with why (those the snapshot could not save included).
    pub lost: Vec<Lost>,
    /// Time the restore took, ms (for a fork, the snapshot's time is in `snapshot_ms`).
    pub took_ms: u64,
    /// Of `took_ms`, copying the files into the new workspace, ms.
    pub copy_ms: u64,
    /// Of `took_ms`, loading the interpreter state, ms.
    pub globals_ms: u64,
    /// For a fork: time its snapshot took, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot_ms: Option<u64>,
}

fn describe(entry: &Entry, with_names: bool) -> SnapshotOutput {
    let s = &entry.saved;
    SnapshotOutput {
        snapshot: entry.name.clone(),
        session: entry.session.clone(),
        grade: s.grade,
        files: s.summary.files,
        workspace_bytes: s.summary.workspace_bytes,
        state_bytes: s.summary.state_bytes,
        skipped_entries: s.summary.skipped,
        saved: if with_names { s.saved.clone() } else { Vec::new() },
        lost: if with_names { s.lost.clone() } else { Vec::new() },
        took_ms: ms(s.took),
        state_ms: ms(s.state_took),
        copy_ms: ms(s.copy_took),
        age_s: entry.created.elapsed().map(|d| d.as_secs()).unwrap_or(0),
    }
}

fn lost_lines(text: &mut String, lost: &[Lost], heading: &str) {
    if lost.is_empty() {
        return;
    }
    text.push_str(&format!("{heading} ({}):\n", lost.len()));
    for l in lost.iter().take(SHOWN) {
        text.push_str(&format!("  {}: {}\n", one_line(&l.name), one_line(&l.why)));
    }
    if lost.len() > SHOWN {
        text.push_str(&format!("  ... and {} more (structured content: lost)\n", lost.len() - SHOWN));
    }
}

fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn restore_text(out: &RestoreOutput, what: &str) -> String {
    let mut text = format!(
        "session {:?} made from {what} {:?} ({}): {} ({} bytes) and {} restored in {} ms\n",
        out.session,
        out.from,
        out.grade.as_str(),
        count(out.files, "file"),
        out.bytes,
        count(out.restored.len() as u64, "name"),
        out.took_ms
    );
    lost_lines(&mut text, &out.lost, "not restored");
    text
}

#[tool_router(router = snapshots_router, vis = "pub(super)")]
impl SandboxServer {
    /// Save a session: its workspace files and, as far as pickle allows, its interpreter
    /// state (variables, modules re-imported by name, functions and classes defined in cells
    /// from their source). What cannot be saved (open files, sockets, threads, lambdas,
    /// closures, objects that refuse to pickle) is listed by name. restore_session or
    /// fork_session make new sessions from it.
    #[tool(annotations(title = "Snapshot session"), output_schema = schema_for_output::<SnapshotOutput>())]
    async fn snapshot_session(&self, Parameters(args): Parameters<SnapshotArgs>, Caller(who): Caller) -> ToolResult {
        let session_name_ = session_name(args.session.as_deref())?;
        let snap = match args.name.as_deref() {
            Some(n) => session_name(Some(n)).map_err(|e| e.replace("session name", "snapshot name"))?,
            None => self.registry.default_snapshot_name(&session_name_),
        };
        let entry = self
            .registry
            .save_snapshot(&who, &session_name_, &snap)
            .instrument(telemetry::step_span("snapshot save"))
            .await?;
        let out = describe(&entry, true);
        let mut text = format!(
            "snapshot {:?} of session {:?} ({}): {} ({} bytes), {} bytes of interpreter state, {} saved, in {} ms\n",
            out.snapshot,
            out.session,
            out.grade.as_str(),
            count(out.files, "file"),
            out.workspace_bytes,
            out.state_bytes,
            count(out.saved.len() as u64, "name"),
            out.took_ms
        );
        if out.skipped_entries > 0 {
            text.push_str(&format!("{} links or special files of the workspace were not saved\n", out.skipped_entries));
        }
        lost_lines(&mut text, &out.lost, "not saved");
        Ok(structured(&out, text))
    }

    /// List your snapshots, newest first, with their grade and sizes.
    #[tool(annotations(title = "List snapshots", read_only_hint = true), output_schema = schema_for_output::<SnapshotList>())]
    async fn list_snapshots(&self, Parameters(_): Parameters<super::NoArgs>, Caller(who): Caller) -> ToolResult {
        let (entries, cache) = self.registry.list_snapshots(&who);
        let snapshots: Vec<SnapshotOutput> = entries.iter().map(|e| describe(e, false)).collect();
        let list = SnapshotList { snapshots, total_bytes: cache.total_bytes, cache_bytes: cache.cache_bytes };
        let mut text = format!("{}\n", count(list.snapshots.len() as u64, "snapshot"));
        for s in &list.snapshots {
            text.push_str(&format!(
                "{}: of session {}, {}, {} ({} bytes) + {} bytes of state, {} s old\n",
                s.snapshot,
                s.session,
                s.grade.as_str(),
                count(s.files, "file"),
                s.workspace_bytes,
                s.state_bytes,
                s.age_s
            ));
        }
        Ok(structured(&list, text))
    }

    /// Delete one of your snapshots.
    #[tool(annotations(title = "Delete snapshot", destructive_hint = true))]
    async fn delete_snapshot(
        &self,
        Parameters(args): Parameters<DeleteSnapshotArgs>,
        Caller(who): Caller,
    ) -> ToolResult {
        let entry = self.registry.delete_snapshot(&who, &args.snapshot).await?;
        Ok(rmcp::model::CallToolResult::success(vec![rmcp::model::ContentBlock::text(format!(
            "snapshot {:?} deleted",
            entry.name
        ))]))
    }

    /// Make a new session from one of your snapshots: its files, then its interpreter state.
    /// What could not come back is listed. A damaged snapshot gives an error and leaves the
    /// new session fresh (empty).
    #[tool(annotations(title = "Restore session"), output_schema = schema_for_output::<RestoreOutput>())]
    async fn restore_session(&self, Parameters(args): Parameters<RestoreArgs>, Caller(who): Caller) -> ToolResult {
        let name = session_name(Some(&args.session))?;
        let (entry, r) = self
            .registry
            .restore_snapshot(&who, &args.snapshot, &name)
            .instrument(telemetry::step_span("snapshot restore"))
            .await?;
        let out = RestoreOutput {
            session: name,
            from: entry.name.clone(),
            grade: entry.saved.grade,
            files: r.files,
            bytes: r.bytes,
            restored: r.restored,
            lost: r.lost,
            took_ms: ms(r.took),
            copy_ms: ms(r.copy),
            globals_ms: ms(r.globals),
            snapshot_ms: None,
        };
        let text = restore_text(&out, "snapshot");
        Ok(structured(&out, text))
    }

    /// Copy a session into a new one (snapshot and restore in one call): both then go their
    /// own ways. What could not be copied is listed.
    #[tool(annotations(title = "Fork session"), output_schema = schema_for_output::<RestoreOutput>())]
    async fn fork_session(&self, Parameters(args): Parameters<ForkArgs>, Caller(who): Caller) -> ToolResult {
        let from = session_name(args.session.as_deref())?;
        let name = session_name(Some(&args.new_session))?;
        let (saved, r) =
            self.registry.fork_session(&who, &from, &name).instrument(telemetry::step_span("session fork")).await?;
        let out = RestoreOutput {
            session: name,
            from,
            grade: saved.grade,
            files: r.files,
            bytes: r.bytes,
            restored: r.restored,
            lost: r.lost,
            took_ms: ms(r.took),
            copy_ms: ms(r.copy),
            globals_ms: ms(r.globals),
            snapshot_ms: Some(u64::try_from(saved.took.as_millis()).unwrap_or(u64::MAX)),
        };
        let text = restore_text(&out, "session");
        Ok(structured(&out, text))
    }
}
