//! Idle memory per part of a session (issue 29): which processes hold the anonymous memory a
//! session costs. Each container's processes come from the engine (`docker top`, host pids);
//! their memory from the host's `/proc/<pid>/smaps_rollup`, so only when the engine runs on
//! this host (otherwise the rows say "n/a"). Anonymous memory is what each session adds;
//! file pages are charged to the first container that reads them.

use std::collections::{BTreeMap, HashMap};

use bollard::query_parameters::StatsOptionsBuilder;
use futures::StreamExt;
use pyberth::docker::Engine;

use super::drive::mib;
use super::table::Table;

/// The parts, in the order the rows show them.
const PARTS: [&str; 6] = [
    "relay (the exec's end)",
    "keeper",
    "keeper + forwarder",
    "interpreter",
    "forwarder (fork)",
    "tether, init, sleep",
];

/// One process of a container, as `ps` lists it.
pub(super) struct Proc {
    pub(super) pid: u32,
    ppid: u32,
    cmd: String,
}

/// Which part a process is, by its command line and parent. Two layouts are told apart: the
/// keeper as its own interpreter (`keeper.py keep`, the agent a process of its own that forks
/// its forwarder) and the keeper folded into the agent (whose forked child is the
/// interpreter).
pub(super) fn part_of(p: &Proc, procs: &[Proc]) -> &'static str {
    // A keeper.py command line names agent.py too: it is the command the keeper runs. The
    // folded keeper loads the agent as a module (`-c ... agent.main(sys.argv[1:]) keep ...`).
    let kept = |cmd: &str| cmd.contains("agent.py keep") || cmd.contains("agent.main(");
    // The relay's command line names agent.py too (the command it starts), and a first attach
    // is the parent of the agent it started.
    let relay = |cmd: &str| cmd.starts_with("/opt/pyberth/relay ") || cmd.contains("keeper.py attach");
    let agent = |cmd: &str| (cmd.contains("agent.py") || kept(cmd)) && !cmd.contains("keeper.py") && !relay(cmd);
    let parent_is_agent = procs.iter().any(|q| q.pid == p.ppid && agent(&q.cmd));
    if relay(&p.cmd) {
        PARTS[0]
    } else if p.cmd.contains("keeper.py keep") {
        PARTS[1]
    } else if kept(&p.cmd) {
        if parent_is_agent { PARTS[3] } else { PARTS[2] }
    } else if agent(&p.cmd) {
        if parent_is_agent { PARTS[4] } else { PARTS[3] }
    } else {
        PARTS[5]
    }
}

/// kB figures of `/proc/<pid>/smaps_rollup`: Pss_Anon (shared pages split among their
/// sharers, so the parts add up to the cgroup's anonymous memory), Anonymous, Rss.
fn smaps(pid: u32) -> Option<[u64; 3]> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let field = |name: &str| {
        text.lines().find_map(|l| {
            l.strip_prefix(name)?.strip_prefix(':')?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
        })
    };
    let anon = field("Anonymous")?;
    Some([field("Pss_Anon").unwrap_or(anon), anon, field("Rss")?])
}

/// The processes of one container, from the engine.
pub(super) async fn processes(docker: &dyn Engine, id: &str) -> Option<Vec<Proc>> {
    let top = docker.top_processes(id, None).await.ok()?;
    let titles = top.titles?;
    let col = |names: &[&str]| titles.iter().position(|t| names.contains(&t.as_str()));
    let (pid, ppid, cmd) = (col(&["PID"])?, col(&["PPID"])?, col(&["CMD", "COMMAND"])?);
    let rows = top.processes.unwrap_or_default();
    Some(
        rows.iter()
            .filter_map(|r| {
                Some(Proc {
                    pid: r.get(pid)?.parse().ok()?,
                    ppid: r.get(ppid)?.parse().ok()?,
                    cmd: r.get(cmd)?.clone(),
                })
            })
            .collect(),
    )
}

/// The cgroup's anonymous memory and the rest of what it is charged (page cache it read
/// first, kernel memory), kB, without inactive file pages (as the idle-memory row counts).
async fn cgroup(docker: &dyn Engine, id: &str) -> Option<(u64, u64)> {
    let opts = StatsOptionsBuilder::default().stream(false).one_shot(true).build();
    let s = docker.stats(id, Some(opts)).next().await?.ok()?;
    let m = s.memory_stats?;
    let stats = m.stats.unwrap_or_default();
    let get = |names: &[&str]| names.iter().find_map(|n| stats.get(*n).copied());
    let inactive = get(&["total_inactive_file", "inactive_file"]).unwrap_or(0);
    let anon = get(&["anon", "total_rss", "rss"])?;
    let used = m.usage?.saturating_sub(inactive);
    Some((anon / 1024, used.saturating_sub(anon) / 1024))
}

/// Sums per part over the containers measured: [Pss_Anon, Anonymous, Rss], processes.
#[derive(Default)]
struct Sums {
    parts: BTreeMap<&'static str, ([u64; 3], usize)>,
    cgroup_anon: u64,
    cgroup_rest: u64,
    containers: usize,
}

/// Rows of idle memory per part, averaged over up to `most` of the containers `ids`.
pub(super) async fn memory_parts(docker: &dyn Engine, ids: &[String], local: bool, most: usize, table: &mut Table) {
    let mut sums = Sums::default();
    if local {
        for id in ids.iter().take(most) {
            let (Some(procs), Some((anon, rest))) = (processes(docker, id).await, cgroup(docker, id).await) else {
                continue;
            };
            let mut mine: HashMap<&'static str, ([u64; 3], usize)> = HashMap::new();
            let mut read_all = !procs.is_empty();
            for p in &procs {
                let Some(m) = smaps(p.pid) else {
                    // Gone meanwhile, or not a process of this host: this container is skipped.
                    read_all = false;
                    break;
                };
                let e = mine.entry(part_of(p, &procs)).or_default();
                (0..3).for_each(|i| e.0[i] += m[i]);
                e.1 += 1;
            }
            if !read_all {
                continue;
            }
            for (k, (m, n)) in mine {
                let e = sums.parts.entry(k).or_default();
                (0..3).for_each(|i| e.0[i] += m[i]);
                e.1 += n;
            }
            sums.cgroup_anon += anon;
            sums.cgroup_rest += rest;
            sums.containers += 1;
        }
    }
    show(&sums, table);
}

fn show(sums: &Sums, table: &mut Table) {
    let n = sums.containers as u64;
    let avg = |kb: u64| (n > 0).then(|| kb / n.max(1));
    let why = if n == 0 { "the engine is not on this host (or its processes are not readable here)" } else { "" };
    for part in PARTS {
        let (m, procs) = sums.parts.get(part).copied().unwrap_or_default();
        if n > 0 && procs == 0 {
            continue;
        }
        let note = if n == 0 {
            why.to_owned()
        } else {
            format!(
                "anonymous {}, rss {}; {:.1} processes per session",
                mib(avg(m[1])),
                mib(avg(m[2])),
                procs as f64 / n as f64
            )
        };
        table.text(&format!("  idle: {part}, anonymous (pss)"), mib(avg(m[0])), note);
    }
    table.text(
        "  idle: page cache and kernel (cgroup)",
        mib(avg(sums.cgroup_rest)),
        if n == 0 {
            why.to_owned()
        } else {
            format!("cgroup anonymous {}; {n} containers", mib(avg(sums.cgroup_anon)))
        },
    );
}
