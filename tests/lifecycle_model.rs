//! The lifecycle model test (issue 26): the real `pyberth` binary, driven through the real MCP
//! client against the real engine by a seeded random sequence of operations (runs, hibernation,
//! wakes, forks, snapshots, restores, closes, restarts by EOF, SIGTERM and kill -9, containers
//! removed behind the server's back, OOM runs, jobs across restarts), with a small model of what
//! each session must hold. After every step: every model session is listed and reads back every
//! variable and file the model gives it (a loss is a failure, told as reported or SILENT); the
//! engine and the state dir's records account for each other and for what the server lists.
//! At the end, with everything closed and the server stopped, nothing of the run is left.
//!
//! On failure it prints the seed and the shortest failing sequence it found (steps dropped and
//! the rest replayed, within `PYBERTH_MODEL_SHRINK_S`, default 300 s).
//! CI runs [`CI_SEEDS`]; `PYBERTH_MODEL_SEED=S` runs one seed, `PYBERTH_MODEL_SOAK=N` runs N
//! seeds from S (or from the clock), `PYBERTH_MODEL_LEN` sets the length of each sequence.
//! Seeds play `PYBERTH_MODEL_PARALLEL` at a time (default 3, CI's all at once), each in its own world.
#![allow(unreachable_pub)] // a test crate: its helpers are shared between its modules

#[allow(dead_code)] // the shared harness; this binary uses part of it
#[path = "integration/common.rs"]
mod common;

#[path = "lifecycle_model/audit.rs"]
mod audit;
#[path = "lifecycle_model/exec.rs"]
mod exec;
#[path = "lifecycle_model/ops.rs"]
mod ops;
#[path = "lifecycle_model/world.rs"]
mod world;

use std::sync::atomic::{AtomicU32, Ordering};

use futures::StreamExt;
use std::time::{Duration, Instant};

use ops::{Op, Stop, generate};
use world::{Broke, World};

/// The seeds CI runs, and the length of each sequence: chosen so the set covers every
/// operation (hibernate → wake → restart among them) in a few minutes on a 2-core machine.
/// Three came from soaks: 1795799209002 closes a session after its snapshot, then restarts
/// (a stop with no session left removed every snapshot); 1795799593015 runs code right after
/// a job followed across a `kill -9` (its output was read as nobody's and lost);
/// 1795802945017 closes a session with jobs and forks another into its name (their records
/// stayed in the state dir for good).
const CI_SEEDS: [u64; 6] = [328, 272, 197, 1_795_799_209_002, 1_795_799_593_015, 1_795_802_945_017];
const CI_LEN: usize = 20;

/// A failed play: at which step (None: in the final checks), and why.
#[derive(Debug)]
struct Failure {
    step: Option<usize>,
    broke: Broke,
    log: String,
}

static PLAYS: AtomicU32 = AtomicU32::new(0);

/// Plays `ops` in a fresh world (its own state dir and instance prefix); step lines carry `tag`.
async fn play(ops: &[Op], tag: &str) -> Result<(), Failure> {
    let prefix = format!("m{}-{}", std::process::id(), PLAYS.fetch_add(1, Ordering::Relaxed));
    let mut w = World::new(prefix).await.map_err(|broke| Failure { step: None, broke, log: String::new() })?;
    for (i, op) in ops.iter().enumerate() {
        let started = Instant::now();
        let done = match exec::apply(&mut w, *op).await {
            Ok(true) => exec::verify(&mut w).await.map(|()| true),
            other => other,
        };
        match done {
            Ok(applied) => {
                let mark = if applied { "" } else { " (skipped)" };
                eprintln!("{tag} {i:>2}. {op}{mark} [{} ms]", started.elapsed().as_millis());
            }
            Err(broke) => {
                eprintln!("{tag} {i:>2}. {op} FAILED: {}: {}", broke.kind, broke.what);
                eprintln!("{tag} model:\n{}", exec::describe(&w));
                return Err(Failure { step: Some(i), broke, log: w.log_tail(25) });
            }
        }
    }
    finish(&mut w).await.map_err(|broke| Failure { step: None, broke, log: w.log_tail(25) })
}

/// The final checks: jobs end, every session reads back (woken), then everything is closed
/// and the server stops: nothing of the run may be left on the engine or in the state dir.
async fn finish(w: &mut World) -> Result<(), Broke> {
    let sessions: Vec<u8> = w.model.sessions.keys().copied().collect();
    for s in &sessions {
        exec::settle_job(w, *s).await?;
        exec::readback(w, *s).await?;
    }
    audit::settled(w).await?;
    for s in &sessions {
        w.ok("close_session", serde_json::json!({ "session": world::sname(*s) })).await?;
    }
    for p in w.model.snaps.keys() {
        w.ok("delete_snapshot", serde_json::json!({ "snapshot": world::pname(*p) })).await?;
    }
    w.stop(Stop::Eof).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut left = audit::left(&w.prefix).await;
        left.extend(audit::records_left(w));
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(world::broke("leak", format!("left after everything was closed: {left:?}")));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The shortest sequence found that still fails the same way, within `budget`: chunks of
/// halving size are dropped, and a drop is kept when the rest still fails.
async fn shrink(ops: &[Op], first: &Failure, budget: Duration) -> (Vec<Op>, String) {
    let at =
        |step: Option<usize>| step.map_or(" in the final checks (every session read back)", |_| " at its last step");
    let deadline = Instant::now() + budget;
    let mut cur: Vec<Op> = match first.step {
        Some(i) => ops[..=i].to_vec(),
        None => ops.to_vec(),
    };
    let mut why = format!("{}: {}: {}", at(first.step), first.broke.kind, first.broke.what);
    let mut size = (cur.len() / 2).max(1);
    loop {
        let mut i = 0;
        while i < cur.len() && Instant::now() < deadline {
            let mut cand = cur.clone();
            cand.drain(i..(i + size).min(cand.len()));
            eprintln!("shrink: trying {} steps", cand.len());
            match play(&cand, "shrink").await {
                Err(f) if f.broke.kind == first.broke.kind => {
                    why = format!("{}: {}: {}", at(f.step), f.broke.kind, f.broke.what);
                    cur = match f.step {
                        Some(s) => cand[..=s].to_vec(),
                        None => cand,
                    };
                }
                _ => i += size,
            }
        }
        if size == 1 || Instant::now() >= deadline {
            return (cur, why);
        }
        size = (size / 2).max(1);
    }
}

fn env_u64(key: &str) -> Option<u64> {
    std::env::var(key).ok().and_then(|v| v.trim().parse().ok())
}

/// The seeds to run: one named, a soak from the clock, or CI's.
fn seeds() -> Vec<u64> {
    let seed = env_u64("PYBERTH_MODEL_SEED");
    if let Some(n) = env_u64("PYBERTH_MODEL_SOAK") {
        let clock = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_secs());
        let base = seed.unwrap_or_else(|| clock().wrapping_mul(1_000));
        return (0..n).map(|k| base.wrapping_add(k)).collect();
    }
    if let Some(s) = seed {
        return vec![s];
    }
    CI_SEEDS.to_vec()
}

/// How many seeds play at once: each has its own server, state dir and prefix, and most of a
/// step is waiting on the engine, so CI's three at a time on 2 cores take little more than one.
fn at_once() -> usize {
    env_u64("PYBERTH_MODEL_PARALLEL").and_then(|n| usize::try_from(n).ok()).unwrap_or(CI_SEEDS.len()).max(1)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lifecycle_holds_under_random_sequences() {
    let len = env_u64("PYBERTH_MODEL_LEN").and_then(|l| usize::try_from(l).ok()).unwrap_or(CI_LEN);
    let budget = Duration::from_secs(env_u64("PYBERTH_MODEL_SHRINK_S").unwrap_or(300));
    let plays = futures::stream::iter(seeds())
        .map(|seed| async move {
            let ops = generate(seed, len);
            eprintln!("seed {seed}, {len} steps:");
            let started = Instant::now();
            let played = play(&ops, &format!("[{seed}]")).await;
            if played.is_ok() {
                eprintln!("seed {seed}: held, {:.1} s", started.elapsed().as_secs_f64());
            }
            (seed, ops, played)
        })
        .buffered(at_once())
        .collect::<Vec<_>>()
        .await;
    // Shrunk one at a time, after every seed has played: a shrink replays alone.
    for (seed, ops, played) in plays {
        let Err(first) = played else { continue };
        let at = first.step.map_or("the final checks".to_owned(), |s| format!("step {s}"));
        eprintln!("seed {seed} failed at {at}; shrinking (up to {} s)", budget.as_secs());
        let (shortest, why) = shrink(&ops, &first, budget).await;
        let listing: Vec<String> = shortest.iter().enumerate().map(|(i, op)| format!("  {i:>2}. {op}")).collect();
        panic!(
            "lifecycle model: seed {seed} (PYBERTH_MODEL_SEED={seed} PYBERTH_MODEL_LEN={len}) failed at {at}: {}: {}\n\
             shortest failing sequence ({} steps), failing{why}:\n{}\n--- server log tail ---\n{}",
            first.broke.kind,
            first.broke.what,
            shortest.len(),
            listing.join("\n"),
            first.log
        );
    }
}

/// The sequence of the first finding of issue 26, as a user met it: a session that hibernated
/// and woke must still be there after the server restarts on the same state dir.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_that_hibernated_and_woke_survives_a_restart() {
    for how in [Stop::Eof, Stop::Term, Stop::Kill] {
        let ops =
            [Op::Run { s: 0, var: 1, val: 42 }, Op::Idle, Op::Check { s: 0 }, Op::Restart(how), Op::Check { s: 0 }];
        eprintln!("hibernate, wake, restart by {how:?}:");
        if let Err(f) = play(&ops, &format!("[{how:?}]")).await {
            panic!(
                "{how:?}: step {:?}: {}: {}\n--- server log tail ---\n{}",
                f.step, f.broke.kind, f.broke.what, f.log
            );
        }
    }
}

/// The CI set, as generated, covers every operation and both combinations the model exists for
/// (hibernate → wake → restart; a job with a restart behind it): the seeds were picked for it.
#[test]
fn the_ci_seeds_cover_every_operation() {
    let covered: std::collections::BTreeSet<&str> =
        CI_SEEDS.iter().flat_map(|s| ops::coverage(&generate(*s, CI_LEN))).collect();
    let missing: Vec<&&str> = ops::ALL_KINDS.iter().filter(|k| !covered.contains(*k)).collect();
    assert!(missing.is_empty(), "the CI seeds miss {missing:?}");
}
