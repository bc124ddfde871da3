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
        c if c.starts_with("containerd") || c == "runc" || c == "docker-init" => Some("containerd, shims, runc"),
        _ => None,
    }
}

/// Nanoseconds process `pid` spent on a CPU, all its threads.
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
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

    /// CPU nanoseconds by part now.
    pub(super) fn sample(&self) -> Sample {
        let mut parts: BTreeMap<&'static str, u64> = BTreeMap::new();
        for (part, pid) in &self.0 {
            *parts.entry(part).or_default() += cpu_ns(*pid);
        }
        Sample(parts)
    }
}

/// CPU nanoseconds by part at one moment.
pub(super) struct Sample(BTreeMap<&'static str, u64>);

impl Sample {
    /// Rows of what each part spent per call since `before`, over `calls` calls in `wall`.
    pub(super) fn rows_since(&self, before: &Sample, calls: usize, wall: std::time::Duration, table: &mut Table) {
        let per_call = |ns: u64| ns as f64 / 1e6 / calls.max(1) as f64;
        let mut total = 0;
        for (part, now) in &self.0 {
            // A process that ended meanwhile reads 0 now: no negative share.
            let spent = now.saturating_sub(before.0.get(part).copied().unwrap_or(0));
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
