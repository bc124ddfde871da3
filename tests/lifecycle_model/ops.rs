//! The operations of the model test, and their seeded generator.

use std::fmt;

/// SplitMix64: a tiny seeded generator, enough to pick operations (no crate needed).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// An index below `n` (n > 0).
    pub fn index(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).unwrap_or_default()
    }
}

/// How a server is stopped before the next one starts on the same state dir.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// The client leaves (stdin closes).
    Eof,
    /// SIGTERM.
    Term,
    /// SIGKILL: no shutdown code runs.
    Kill,
}

/// One step. Sessions are `s0`..`s3`, snapshots `p0`..`p2`; an operation whose precondition
/// does not hold when it comes (a shrunk sequence dropped what made it hold) is skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Sets `v{var} = val` and writes `f{var}.txt` in `s` (made if absent).
    Run {
        s: u8,
        var: u32,
        val: u64,
    },
    /// Reads `s` back explicitly (wakes it if it sleeps).
    Check {
        s: u8,
    },
    /// Waits until every session without a job has hibernated; nothing is read after it.
    Idle,
    Fork {
        s: u8,
        to: u8,
    },
    Snapshot {
        s: u8,
        snap: u8,
    },
    Restore {
        snap: u8,
        to: u8,
    },
    DeleteSnapshot {
        snap: u8,
    },
    Close {
        s: u8,
    },
    /// Stops the server, then starts the next on the same state dir.
    Restart(Stop),
    /// `docker rm -f` of the session's container, behind the server's back.
    Remove {
        s: u8,
    },
    /// A run that allocates past the memory limit.
    Oom {
        s: u8,
    },
    /// A background job that sets `v{var} = val` after a few seconds.
    Job {
        s: u8,
        var: u32,
        val: u64,
    },
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Op::Run { s, var, val } => write!(f, "run s{s}: v{var} = {val}, f{var}.txt"),
            Op::Check { s } => write!(f, "check s{s}"),
            Op::Idle => write!(f, "idle until hibernated"),
            Op::Fork { s, to } => write!(f, "fork s{s} -> s{to}"),
            Op::Snapshot { s, snap } => write!(f, "snapshot s{s} as p{snap}"),
            Op::Restore { snap, to } => write!(f, "restore p{snap} -> s{to}"),
            Op::DeleteSnapshot { snap } => write!(f, "delete snapshot p{snap}"),
            Op::Close { s } => write!(f, "close s{s}"),
            Op::Restart(Stop::Eof) => write!(f, "server: stdin closed, restart"),
            Op::Restart(Stop::Term) => write!(f, "server: SIGTERM, restart"),
            Op::Restart(Stop::Kill) => write!(f, "server: kill -9, restart"),
            Op::Remove { s } => write!(f, "docker rm -f the container of s{s}"),
            Op::Oom { s } => write!(f, "OOM run in s{s}"),
            Op::Job { s, var, val } => write!(f, "background job in s{s}: v{var} = {val}"),
        }
    }
}

pub const SESSIONS: u8 = 4;
pub const SNAPSHOTS: u8 = 3;

/// Whether the OOM operation is generated (see the note where it is used).
pub fn oom_enabled() -> bool {
    std::env::var("PYBERTH_MODEL_NO_OOM").map_or(true, |v| v.is_empty() || v == "0")
}

/// The sequence of `len` operations of `seed`. The generator tracks which sessions and
/// snapshots would exist, so most operations hit something; the runner still checks.
pub fn generate(seed: u64, len: usize) -> Vec<Op> {
    let mut rng = Rng::new(seed);
    let mut live = [false; SESSIONS as usize];
    let mut snaps = [false; SNAPSHOTS as usize];
    let mut var = 0u32;
    let mut ops = Vec::with_capacity(len);
    while ops.len() < len {
        let pick_live = |rng: &mut Rng, want: bool, of: &[bool]| -> Option<u8> {
            let c: Vec<u8> = (0..SESSIONS.max(SNAPSHOTS)).filter(|i| of.get(*i as usize) == Some(&want)).collect();
            (!c.is_empty()).then(|| c[rng.index(c.len())])
        };
        let roll = rng.below(100);
        let op = match roll {
            0..=24 => {
                // Mostly an existing session, sometimes a new one.
                let s = if rng.below(4) == 0 { None } else { pick_live(&mut rng, true, &live) };
                let s = s.unwrap_or_else(|| u8::try_from(rng.index(SESSIONS.into())).unwrap_or_default());
                var += 1;
                Some(Op::Run { s, var, val: rng.below(1_000_000) })
            }
            25..=31 => pick_live(&mut rng, true, &live).map(|s| Op::Check { s }),
            32..=41 => Some(Op::Idle),
            42..=47 => pick_live(&mut rng, true, &live)
                .and_then(|s| pick_live(&mut rng, false, &live).map(|to| Op::Fork { s, to })),
            48..=54 => pick_live(&mut rng, true, &live)
                .and_then(|s| pick_live(&mut rng, false, &snaps).map(|snap| Op::Snapshot { s, snap })),
            55..=61 => pick_live(&mut rng, true, &snaps)
                .and_then(|snap| pick_live(&mut rng, false, &live).map(|to| Op::Restore { snap, to })),
            62..=64 => pick_live(&mut rng, true, &snaps).map(|snap| Op::DeleteSnapshot { snap }),
            65..=68 => pick_live(&mut rng, true, &live).map(|s| Op::Close { s }),
            69..=73 => Some(Op::Restart(Stop::Eof)),
            74..=78 => Some(Op::Restart(Stop::Term)),
            79..=83 => Some(Op::Restart(Stop::Kill)),
            84..=87 => pick_live(&mut rng, true, &live).map(|s| Op::Remove { s }),
            88..=91 => pick_live(&mut rng, true, &live).filter(|_| oom_enabled()).map(|s| Op::Oom { s }),
            _ => pick_live(&mut rng, true, &live).map(|s| {
                var += 1;
                Op::Job { s, var, val: rng.below(1_000_000) }
            }),
        };
        let Some(op) = op else { continue };
        // Half the jobs have a restart right behind them: a job running across a restart.
        let restart_after = matches!(op, Op::Job { .. }) && rng.below(2) == 0;
        match op {
            Op::Run { s, .. } => live[s as usize] = true,
            Op::Fork { to, .. } | Op::Restore { to, .. } => live[to as usize] = true,
            Op::Snapshot { snap, .. } => snaps[snap as usize] = true,
            Op::DeleteSnapshot { snap } => snaps[snap as usize] = false,
            Op::Close { s } => live[s as usize] = false,
            _ => {}
        }
        ops.push(op);
        if restart_after && ops.len() < len {
            let how = [Stop::Eof, Stop::Term, Stop::Kill][rng.index(3)];
            ops.push(Op::Restart(how));
        }
    }
    ops
}

/// The kind of an operation, for coverage.
pub fn kind(op: &Op) -> &'static str {
    match op {
        Op::Run { .. } => "run",
        Op::Check { .. } => "check",
        Op::Idle => "idle",
        Op::Fork { .. } => "fork",
        Op::Snapshot { .. } => "snapshot",
        Op::Restore { .. } => "restore",
        Op::DeleteSnapshot { .. } => "delete-snapshot",
        Op::Close { .. } => "close",
        Op::Restart(Stop::Eof) => "restart-eof",
        Op::Restart(Stop::Term) => "restart-term",
        Op::Restart(Stop::Kill) => "restart-kill",
        Op::Remove { .. } => "remove",
        Op::Oom { .. } => "oom",
        Op::Job { .. } => "job",
    }
}

/// Every kind, plus the two combinations the model exists for: a wake (any step after an
/// idle one) followed by a restart, and a job with a restart right behind it.
pub const ALL_KINDS: [&str; 16] = [
    "run",
    "check",
    "idle",
    "fork",
    "snapshot",
    "restore",
    "delete-snapshot",
    "close",
    "restart-eof",
    "restart-term",
    "restart-kill",
    "remove",
    "oom",
    "job",
    "idle-wake-restart",
    "job-restart",
];

/// The kinds a sequence covers.
pub fn coverage(ops: &[Op]) -> std::collections::BTreeSet<&'static str> {
    let mut out: std::collections::BTreeSet<&'static str> = ops.iter().map(kind).collect();
    for w in ops.windows(3) {
        if w[0] == Op::Idle && !matches!(w[1], Op::Idle | Op::Restart(_)) && matches!(w[2], Op::Restart(_)) {
            out.insert("idle-wake-restart");
        }
    }
    for w in ops.windows(2) {
        if matches!(w[0], Op::Job { .. }) && matches!(w[1], Op::Restart(_)) {
            out.insert("job-restart");
        }
    }
    out
}
