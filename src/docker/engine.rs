//! The engine under us: version checks at start-up, and the seccomp profile sandboxes get.
//!
//! Docker's own default profile leaves io_uring open before engine 25 (moby#46762), and the
//! io_uring class holds many kernel privilege escalations. On such engines sandboxes get our
//! profile instead: an allowlist of the native architecture's syscalls without io_uring, the
//! kernel-admin and namespace calls, the tracing calls, keyrings, bpf and perf, and the legacy
//! oddities nothing needs. Namespace-creating clone flags and AF_VSOCK sockets are refused by
//! argument, clone3 answers ENOSYS so libc falls back to clone.
//!
//! The OCI runtime is settled here too: gVisor (runsc) is looked for among the engine's
//! runtimes, said in one line, and `--runtime auto` picks it when present.
//!
//! Why this file passes 500 lines: the syscall allowlist is most of it, one name a line.
//!
//! Why this file passes 500 lines: most of it is our seccomp profile, a syscall list per
//! architecture, which reads best in one place beside the version checks that decide it.

use std::collections::HashMap;

use crate::docker::Engine;
use bollard::models::Runtime;
use serde_json::{Value, json};

/// Syscalls a sandbox may make (names of x86_64 and aarch64; a name unknown on the running
/// architecture is skipped by libseccomp). Everything else answers EPERM.
const ALLOWED: &[&str] = &[
    "accept",
    "accept4",
    "access",
    "adjtimex",
    "alarm",
    "arch_prctl",
    "bind",
    "brk",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chroot",
    "clock_getres",
    "clock_gettime",
    "clock_nanosleep",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fallocate",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchown",
    "fchownat",
    "fcntl",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstatfs",
    "fsync",
    "ftruncate",
    "futex",
    "futex_waitv",
    "futimesat",
    "get_robust_list",
    "get_thread_area",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "geteuid",
    "getgid",
    "getgroups",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresuid",
    "getrlimit",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "gettid",
    "gettimeofday",
    "getuid",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_setup",
    "io_submit",
    "ioctl",
    "ioprio_get",
    "ioprio_set",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "madvise",
    "membarrier",
    "memfd_create",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedsend",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "nanosleep",
    "newfstatat",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "pselect6",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recvfrom",
    "recvmmsg",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_tgsigqueueinfo",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "sendfile",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "set_robust_list",
    "set_thread_area",
    "set_tid_address",
    "setfsgid",
    "setfsuid",
    "setgid",
    "setgroups",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setresgid",
    "setresuid",
    "setreuid",
    "setrlimit",
    "setsid",
    "setsockopt",
    "setuid",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "socketpair",
    "splice",
    "stat",
    "statfs",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_settime",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_settime",
    "times",
    "tkill",
    "truncate",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "write",
    "writev",
];

/// clone flags that create namespaces: CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
const CLONE_NAMESPACE_FLAGS: u64 =
    0x0002_0000 | 0x0200_0000 | 0x0400_0000 | 0x0800_0000 | 0x1000_0000 | 0x2000_0000 | 0x4000_0000;
/// personality() values ordinary programs use: PER_LINUX, UNAME26 and ADDR_NO_RANDOMIZE
/// combinations, and the 0xffffffff query.
const PERSONALITIES: &[u64] = &[0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];
const AF_VSOCK: u64 = 40;
const ENOSYS: u64 = 38;

/// Our seccomp profile, as the JSON Docker takes in `security_opt: seccomp=…`.
pub fn profile() -> String {
    let arch = match std::env::consts::ARCH {
        "aarch64" => "SCMP_ARCH_AARCH64",
        _ => "SCMP_ARCH_X86_64",
    };
    let mut rules: Vec<Value> = vec![json!({ "names": ALLOWED, "action": "SCMP_ACT_ALLOW" })];
    rules.push(json!({
        "names": ["clone"],
        "action": "SCMP_ACT_ALLOW",
        "args": [{ "index": 0, "value": CLONE_NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ" }],
    }));
    rules.push(json!({ "names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS }));
    rules.push(json!({
        "names": ["socket"],
        "action": "SCMP_ACT_ALLOW",
        "args": [{ "index": 0, "value": AF_VSOCK, "valueTwo": 0, "op": "SCMP_CMP_NE" }],
    }));
    for p in PERSONALITIES {
        rules.push(json!({
            "names": ["personality"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{ "index": 0, "value": p, "valueTwo": 0, "op": "SCMP_CMP_EQ" }],
        }));
    }
    json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": [arch],
        "syscalls": rules,
    })
    .to_string()
}

/// What start-up learned of the engine.
#[derive(Debug, Clone, Default)]
pub struct EngineFacts {
    /// Engine version, e.g. "20.10.24+dfsg1".
    pub engine: String,
    /// runc version, when the engine reports it.
    pub runc: Option<String>,
    /// The runtime sandboxes run under, e.g. "runc" or "runsc".
    pub runtime: String,
    /// The engine's default runtime, usually "runc".
    pub default_runtime: String,
    /// The engine's gVisor runtime, when it has one.
    pub gvisor: Option<Gvisor>,
    /// Known problems, one line each.
    pub warnings: Vec<String>,
    /// What every sandbox is made with: the runtime chosen, gVisor or not, the seccomp profile.
    pub sandboxing: super::container::Sandboxing,
}

/// `--runtime auto`: gVisor when the engine has it, else the engine's default runtime.
pub const AUTO: &str = "auto";

/// A gVisor runtime registered in the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gvisor {
    /// Its name in the engine, usually "runsc".
    pub name: String,
    /// The arguments the engine gives it, e.g. `--network=none`.
    pub args: Vec<String>,
}

impl Gvisor {
    /// Registered with `--network=none`: no container under it has a network, the installer's
    /// neither.
    pub fn offline(&self) -> bool {
        self.args.iter().any(|a| a == "--network=none" || a == "-network=none")
    }
}

/// The engine's gVisor runtime: the one named runsc, else the first (by name) whose name starts
/// with runsc or whose binary is runsc.
pub fn find_gvisor(runtimes: &HashMap<String, Runtime>) -> Option<Gvisor> {
    let mut names: Vec<&String> = runtimes.keys().filter(|n| gvisor_named(runtimes, n).is_some()).collect();
    names.sort_by_key(|n| (n.as_str() != "runsc", n.as_str()));
    gvisor_named(runtimes, names.first()?)
}

/// The runtime `name` of the engine, if it is gVisor (named runsc…, or its binary is runsc).
pub fn gvisor_named(runtimes: &HashMap<String, Runtime>, name: &str) -> Option<Gvisor> {
    let rt = runtimes.get(name)?;
    let binary = rt.path.as_deref().and_then(|p| std::path::Path::new(p).file_name()).is_some_and(|f| f == "runsc");
    (name.starts_with("runsc") || binary)
        .then(|| Gvisor { name: name.to_owned(), args: rt.runtime_args.clone().unwrap_or_default() })
}

/// The runtime sandboxes get: the one asked for (which the engine must have), gVisor for
/// `auto` when the engine has it, else the engine's default (`None`). Also the line that says so.
pub fn choose(
    asked: Option<&str>,
    runtimes: &HashMap<String, Runtime>,
    default: &str,
) -> Result<(Option<String>, String), String> {
    let gvisor = find_gvisor(runtimes);
    // An empty PYBERTH_RUNTIME means none asked for, as it always has.
    let asked = asked.filter(|a| !a.is_empty());
    let chosen = match asked {
        Some(AUTO) => gvisor.as_ref().map(|g| g.name.clone()),
        Some(name) if runtimes.contains_key(name) => Some(name.to_owned()),
        Some(name) => {
            let mut known: Vec<&str> = runtimes.keys().map(String::as_str).collect();
            known.sort_unstable();
            return Err(format!(
                "the runtime {name:?} (--runtime) is not installed in this engine (it has: {}); for gVisor, add \
                 runsc to the engine's daemon.json \"runtimes\" (or run `runsc install`) and reload dockerd",
                known.join(", ")
            ));
        }
        None => None,
    };
    let under = chosen.as_deref().unwrap_or(default);
    let line = match (&gvisor, asked) {
        _ if gvisor_named(runtimes, under).is_some() => {
            format!("gVisor ({under}) is installed in this engine: sandboxes run under it")
        }
        (Some(g), _) => format!(
            "gVisor ({}) is installed in this engine; sandboxes run under {under} (--runtime {} or auto puts them \
             under gVisor)",
            g.name, g.name
        ),
        (None, Some(AUTO)) => {
            format!("gVisor (runsc) is not installed in this engine: --runtime auto runs sandboxes under {under}")
        }
        (None, _) => format!("gVisor (runsc) is not installed in this engine; sandboxes run under {under}"),
    };
    Ok((chosen, line))
}

/// What gVisor's registration means for pyberth, one line each.
pub fn assess_gvisor(g: &Gvisor) -> Vec<String> {
    let mut w = Vec::new();
    if g.offline() {
        w.push(format!(
            "the engine runs {} with --network=none: sessions with egress cannot run under it (they are \
             refused, saying so); the package installer runs under the engine's default runtime instead",
            g.name
        ));
    }
    w
}

/// Leading numeric parts of a version string: "1.1.5+ds1" → [1, 1, 5].
fn numbers(v: &str) -> Vec<u64> {
    v.trim_start_matches('v')
        .split(|c: char| !c.is_ascii_digit() && c != '.')
        .next()
        .unwrap_or("")
        .split('.')
        .map_while(|p| p.parse().ok())
        .collect()
}

fn older(v: &str, than: &[u64]) -> bool {
    let n = numbers(v);
    !n.is_empty() && n.as_slice() < than
}

/// Known escapes and gaps by version (docs/threat-model.md §4). Distributions backport fixes without
/// changing the upstream number, so these are warnings, not verdicts. Under gVisor, runc runs
/// none of our containers and the code's system calls never reach the host's io_uring: those
/// warnings are left out.
pub fn assess(engine: &str, runc: Option<&str>, under_gvisor: bool) -> Vec<String> {
    let mut w = Vec::new();
    let runc = if under_gvisor { None } else { runc };
    if older(engine, &[25]) && !under_gvisor {
        w.push(format!(
            "Docker {engine} does not block io_uring in its default seccomp profile (fixed in 25.0); \
             pyberth applies its own profile (--seccomp)"
        ));
    }
    if older(engine, &[26]) {
        w.push(format!(
            "Docker {engine} is older than 26.0 (CVE-2024-29018: DNS of internal networks leaks); sandboxes use \
             network none, which it does not affect"
        ));
    }
    match runc {
        Some(r) if older(r, &[1, 1, 12]) => w.push(format!(
            "runc {r} is older than 1.1.12 (CVE-2024-21626, container escape) unless your distribution backported the fix"
        )),
        _ => {}
    }
    match runc {
        Some(r) if older(r, &[1, 2, 8]) => w.push(format!(
            "runc {r} is older than 1.2.8 (CVE-2024-45310, CVE-2025-31133, CVE-2025-52565, CVE-2025-52881); \
             upgrade runc, or use gVisor (--runtime runsc) or user-namespace remapping"
        )),
        _ => {}
    }
    w
}

/// True the first time `versions` is seen by this state dir (a marker file records it).
fn first_time(state_dir: &std::path::Path, versions: &str) -> bool {
    let key: String = versions.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
    let marker = state_dir.join(format!("engine-warned-{key}"));
    // create_new: an existing marker (or anything planted there) means "already said".
    std::fs::OpenOptions::new().write(true).create_new(true).open(marker).is_ok()
}

/// Which seccomp profile sandboxes get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeccompMode {
    /// Ours where the engine's default leaves io_uring open (Docker < 25), Docker's otherwise.
    Auto,
    /// Always ours.
    Pyberth,
    /// Always Docker's default.
    Docker,
}

/// What the operator asks of the engine check.
#[derive(Debug, Clone)]
pub struct Ask {
    /// `--runtime`: a runtime name, `auto`, or `None` for the engine's default.
    pub runtime: Option<String>,
    /// `--seccomp`.
    pub seccomp: SeccompMode,
    /// `--strict-engine`: refuse engines with known escapes.
    pub strict: bool,
    /// Where the once-per-version marker of the warnings lives (the state dir).
    pub state_dir: std::path::PathBuf,
}

/// Checks the engine, logs what is known to be wrong with it (as warnings when `announce`,
/// else at debug level: `pyberth run` shares stderr with the program), refuses to go on under
/// `--strict-engine`, and says what sandboxes are made with (runtime, seccomp profile).
pub async fn check(
    docker: &dyn Engine,
    ask: &Ask,
    announce: bool,
    greeting: Option<super::Greeting>,
) -> Result<EngineFacts, String> {
    // What the connection read already, else both at once: one round trip, not two. Read
    // again when either failed (a later bollard that versions every request would fail them on
    // an older engine before the negotiation's answer).
    let (version, info) = match greeting {
        Some(super::Greeting { version: Ok(v), info: Ok(i) }) => (Ok(v), Ok(i)),
        _ => {
            let (version, info) = tokio::join!(docker.version(), docker.info());
            (version.map_err(|e| e.to_string()), info.map_err(|e| e.to_string()))
        }
    };
    let version = version.map_err(|e| format!("cannot read the engine's version: {e}"))?;
    let engine = version.version.clone().unwrap_or_default();
    let runc = version
        .components
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.name.eq_ignore_ascii_case("runc"))
        .map(|c| c.version);
    let info = info.map_err(|e| format!("cannot read the engine's runtimes: {e}"))?;
    let runtimes = info.runtimes.unwrap_or_default();
    let default = info.default_runtime.unwrap_or_else(|| "runc".to_owned());
    let (chosen, line) = choose(ask.runtime.as_deref(), &runtimes, &default)?;
    let gvisor = find_gvisor(&runtimes);
    let under = gvisor_named(&runtimes, chosen.as_deref().unwrap_or(&default));
    let under_gvisor = under.is_some();
    if announce {
        tracing::info!(target: "pyberth::engine", "{line}");
    } else {
        tracing::debug!(target: "pyberth::engine", "{line}");
    }
    let warnings = assess(&engine, runc.as_deref(), under_gvisor);
    for w in &warnings {
        tracing::debug!(target: "pyberth::engine", "{w}");
    }
    // Once per engine and runc version, in one line: the same four warnings at every start
    // teach nothing and bury what follows.
    let versions = format!("Docker {engine}, runc {}", runc.as_deref().unwrap_or("?"));
    if announce && !warnings.is_empty() && first_time(&ask.state_dir, &versions) {
        tracing::warn!(
            target: "pyberth::engine",
            "{versions}: {} known security issue(s) (RUST_LOG=pyberth::engine=debug lists them; \
             --strict-engine refuses such engines); said once per engine version",
            warnings.len()
        );
    }
    // Limits of the gVisor set-up, not escapes: said, never a reason for --strict-engine.
    let notes = under.as_ref().map(assess_gvisor).unwrap_or_default();
    for w in &notes {
        if announce {
            tracing::warn!(target: "pyberth::engine", "{w}");
        } else {
            tracing::debug!(target: "pyberth::engine", "{w}");
        }
    }
    if ask.strict && !warnings.is_empty() {
        return Err(format!(
            "refusing to start under --strict-engine: {} (upgrade the engine, or drop --strict-engine)",
            warnings.join("; ")
        ));
    }
    let ours = match ask.seccomp {
        SeccompMode::Auto => older(&engine, &[25]),
        SeccompMode::Pyberth => true,
        SeccompMode::Docker => false,
    };
    let sandboxing = super::container::Sandboxing {
        runtime: chosen.clone(),
        gvisor: under_gvisor,
        seccomp_profile: ours.then(|| profile().into()),
    };
    let runtime = chosen.unwrap_or_else(|| default.clone());
    Ok(EngineFacts { engine, runc, runtime, default_runtime: default, gvisor, warnings, sandboxing })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_by_their_numbers() {
        assert_eq!(numbers("20.10.24+dfsg1"), vec![20, 10, 24]);
        assert_eq!(numbers("1.1.5+ds1"), vec![1, 1, 5]);
        assert_eq!(numbers("v1.2.8"), vec![1, 2, 8]);
        assert!(older("20.10.24+dfsg1", &[25]));
        assert!(!older("27.3.1", &[25]));
        assert!(!older("garbage", &[25]), "unknown versions are not judged");
        let w = assess("20.10.24+dfsg1", Some("1.1.5+ds1"), false);
        assert!(w.iter().any(|l| l.contains("io_uring")) && w.iter().any(|l| l.contains("CVE-2024-21626")), "{w:?}");
        assert!(assess("28.0.1", Some("1.3.3"), false).is_empty());
        let w = assess("20.10.24+dfsg1", Some("1.1.5+ds1"), true);
        assert!(w.iter().all(|l| !l.contains("runc") && !l.contains("io_uring")), "not runc's, under gVisor: {w:?}");
    }

    fn runtimes(list: &[(&str, &str, &[&str])]) -> HashMap<String, Runtime> {
        list.iter()
            .map(|(name, path, args)| {
                let args = args.iter().map(|a| (*a).to_owned()).collect();
                ((*name).to_owned(), Runtime { path: Some((*path).to_owned()), runtime_args: Some(args), status: None })
            })
            .collect()
    }

    #[test]
    fn gvisor_is_found_by_name_or_binary() {
        let plain = runtimes(&[("runc", "runc", &[]), ("io.containerd.runc.v2", "runc", &[])]);
        assert_eq!(find_gvisor(&plain), None);
        let named = runtimes(&[
            ("runc", "runc", &[]),
            ("runsc-kvm", "/x/runsc", &[]),
            ("runsc", "/usr/bin/runsc", &["--network=none"]),
        ]);
        let g = find_gvisor(&named).expect("found");
        assert_eq!((g.name.as_str(), g.args.as_slice()), ("runsc", ["--network=none".to_owned()].as_slice()));
        let by_binary = runtimes(&[("runc", "runc", &[]), ("gvisor", "/usr/local/bin/runsc", &[])]);
        assert_eq!(find_gvisor(&by_binary).map(|g| g.name), Some("gvisor".to_owned()));
    }

    #[test]
    fn auto_prefers_gvisor_and_a_missing_runtime_is_refused() {
        let with = runtimes(&[("runc", "runc", &[]), ("runsc", "/usr/bin/runsc", &["--network=none"])]);
        let without = runtimes(&[("runc", "runc", &[])]);
        let (chosen, line) = choose(Some(AUTO), &with, "runc").expect("auto");
        assert_eq!(chosen.as_deref(), Some("runsc"));
        assert!(line.contains("run under it"), "{line}");
        let (chosen, line) = choose(Some(AUTO), &without, "runc").expect("auto without gVisor");
        assert_eq!(chosen, None, "the engine's default");
        assert!(line.contains("not installed") && line.contains("under runc"), "{line}");
        let (chosen, line) = choose(None, &with, "runc").expect("default");
        assert_eq!(chosen, None, "the default is unchanged by gVisor being there");
        assert_eq!(choose(Some(""), &with, "runc").expect("empty").0, None, "empty is unset");
        assert!(line.contains("--runtime runsc or auto"), "{line}");
        assert_eq!(choose(Some("runsc"), &with, "runc").expect("named").0.as_deref(), Some("runsc"));
        let e = choose(Some("runsc"), &without, "runc").expect_err("missing");
        assert!(e.contains("not installed") && e.contains("runc"), "{e}");
        let g = find_gvisor(&with).expect("gVisor");
        assert!(assess_gvisor(&g).iter().any(|l| l.contains("egress")), "--network=none is said");
    }

    #[test]
    fn the_profile_denies_io_uring_and_namespaces() {
        let p: Value = serde_json::from_str(&profile()).expect("json");
        assert_eq!(p["defaultAction"], "SCMP_ACT_ERRNO");
        let allowed: Vec<&str> =
            p["syscalls"][0]["names"].as_array().expect("names").iter().filter_map(Value::as_str).collect();
        for denied in ["io_uring_setup", "io_uring_enter", "keyctl", "bpf", "unshare", "setns", "ptrace", "mount"] {
            assert!(!allowed.contains(&denied), "{denied} must not be allowed");
        }
        assert!(allowed.contains(&"read") && allowed.contains(&"execve"));
    }
}
