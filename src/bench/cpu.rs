//! CPU time per call, part by part (issue 29: 8 sessions x 10 calls is bound by two cores):
//! what the server, the bench's own client, the engine (dockerd, containerd and its shims) and
//! each process of the sessions' containers spent over a row. Read from the host's
//! `/proc/<pid>/task/*/schedstat` (nanoseconds on a CPU, every thread), so only when the
//! engine runs on this host.

use std::collections::BTreeMap;

use pyberth::docker::Engine;

use super::parts::{part_of, processes};
use super::table::Table;

/// Host processes of the engine, by their command name.
fn engine_part(comm: &str) -> Option<&'static str> {
    match comm {
        "dockerd" => Some("dockerd"),
        // Not docker-init: each container's pid 1, counted with its container's processes.
        c if c.starts_with("containerd") || c == "runc" => Some("containerd, shims, runc"),
        _ => None,
    }
}

/// Nanoseconds each thread of process `pid` spent on a CPU, by thread id.
fn cpu_ns(pid: u32, into: &mut BTreeMap<u32, u64>) {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return };
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let read = std::fs::read_to_string(t.path().join("schedstat")).ok();
        if let Some(ns) = read.and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok()) {
            into.insert(tid, ns);
        }
    }
}

/// The processes watched, by part: found once before a row, so that looking them up (engine
/// calls) is not counted in it.
pub(super) struct Watched(Vec<(&'static str, u32)>);

impl Watched {
    /// The server (`server_pid`), this process, the engine's host processes and the processes
    /// of `containers`.
    pub(super) async fn find(docker: &dyn Engine, server_pid: u32, containers: &[String]) -> Self {
        let mut found = vec![("pyberth serve", server_pid), ("the bench's rmcp client", std::process::id())];
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for e in dir.flatten() {
                let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
                let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
                if let Some(part) = engine_part(comm.trim()) {
                    found.push((part, pid));
                }
            }
        }
        for id in containers {
            let Some(procs) = processes(docker, id).await else { continue };
            found.extend(procs.iter().map(|p| (part_of(p, &procs), p.pid)));
        }
        Self(found)
    }

    /// CPU nanoseconds of each thread now, by part.
    pub(super) fn sample(&self) -> Sample {
        let mut parts: BTreeMap<&'static str, BTreeMap<u32, u64>> = BTreeMap::new();
        for (part, pid) in &self.0 {
            cpu_ns(*pid, parts.entry(part).or_default());
        }
        Sample(parts)
    }
}

/// CPU nanoseconds of each thread (by id) at one moment, by part. Compared thread by thread:
/// a thread that ended meanwhile (a Tokio blocking thread, idle for 10 s) takes nothing of
/// the others' time with it, and one that began is not counted (an exec's runc).
pub(super) struct Sample(BTreeMap<&'static str, BTreeMap<u32, u64>>);

impl Sample {
    /// Rows of what each part spent per call since `before`, over `calls` calls in `wall`.
    pub(super) fn rows_since(&self, before: &Sample, calls: usize, wall: std::time::Duration, table: &mut Table) {
        let per_call = |ns: u64| ns as f64 / 1e6 / calls.max(1) as f64;
        let mut total = 0;
        for (part, now) in &self.0 {
            let then = before.0.get(part);
            let was = |tid: &u32| then.and_then(|t| t.get(tid)).copied();
            let spent: u64 = now.iter().filter_map(|(tid, ns)| Some(ns.saturating_sub(was(tid)?))).sum();
            total += spent;
            if spent > 0 {
                table.text(&format!("  cpu: {part}"), format!("{:.3} ms", per_call(spent)), "per call".into());
            }
        }
        let busy = total as f64 / 1e9 / wall.as_secs_f64().max(1e-9);
        table.text(
            "  cpu: all parts",
            format!("{:.3} ms", per_call(total)),
            format!("per call; {busy:.2} CPUs busy on average over the row"),
        );
    }
}
