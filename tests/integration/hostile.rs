//! Hostile code: resource exhaustion, output and protocol abuse, isolation probes. Every
//! payload is followed by the four checks of docs/threat-model.md §6: the host is unaffected (the
//! server still answers, nothing of ours is left after stop), a canary session answers
//! within 2 s, the attacked session works or says it was recycled, and nothing is left behind.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Server, assert_cleaned_up, gvisor, text};

/// The canary session answers quickly. Its first call makes its container, which under gVisor
/// on a loaded machine alone can take 2 s: that call is not timed, as the bound is about the
/// server staying responsive, not about container creation.
async fn canary(s: &Server) {
    s.ok("canary", "0").await;
    let t = Instant::now();
    let sc = s.ok("canary", "print(1)").await;
    assert_eq!(sc["stdout"], "1\n");
    assert!(t.elapsed() < Duration::from_secs(2), "the canary took {:?}", t.elapsed());
}

/// Runs a payload, then checks that the session either works or said it was recycled, and
/// that the canary answers.
async fn survive(s: &Server, session: &str, code: &str, timeout_s: u64) -> Value {
    let (r, sc) = s.run_with(json!({ "session": session, "code": code, "timeout_s": timeout_s })).await;
    assert!(r.structured_content.is_some(), "a result, not a protocol error: {}", text(&r));
    let after = s.run_with(json!({ "session": session, "code": "print('ok')" })).await.1;
    assert_eq!(after["stdout"], "ok\n", "the session works after {code:?}: {after}");
    if sc["state_lost"] == true {
        assert!(
            !sc["notices"].as_array().is_some_and(Vec::is_empty) || sc["status"] != "ok",
            "recycling is said: {sc}"
        );
    }
    canary(s).await;
    sc
}

fn result(sc: &Value) -> &str {
    sc["result"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn resource_exhaustion_is_contained() {
    let s = Server::start("exhaust", &[]).await;
    canary(&s).await;
    let threads = "import threading, time\nts = []\nerr = None\ntry:\n    for i in range(5000):\n        \
                   t = threading.Thread(target=time.sleep, args=(1,)); t.start(); ts.append(t)\n\
                   except RuntimeError as e:\n    err = 'RuntimeError'\n(len(ts) < 5000, err)";
    let bomb = survive(&s, "x", threads, 30).await;
    if gvisor() {
        // gVisor's threads are its own tasks, not host threads: the pids limit does not count
        // them, memory does (far past 5000, the sandbox ends). The four checks hold either way.
        assert!(["(True, 'RuntimeError')", "(False, None)"].contains(&result(&bomb)) || bomb["state_lost"] == true);
    } else {
        assert_eq!(result(&bomb), "(True, 'RuntimeError')", "thread bomb");
    }
    let alloc = "try:\n    b = bytearray(1 << 40)\n    r = 'allocated'\nexcept MemoryError:\n    r = 'MemoryError'\nr";
    if gvisor() {
        // gVisor grants the mapping and the zero-fill runs into the memory limit, where the
        // host's OOM killer ends the whole sandbox (gVisor is the process in the cgroup). The
        // exec stream can outlive the sandbox: the engine's `die` event ends the run, long
        // before its time limit.
        let started = std::time::Instant::now();
        let big = survive(&s, "x", alloc, 120).await;
        assert!(result(&big) == "'MemoryError'" || big["state_lost"] == true, "one huge allocation: {big}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "waited {:?} for a dead sandbox",
            started.elapsed()
        );
    } else {
        assert_eq!(result(&survive(&s, "x", alloc, 30).await), "'MemoryError'", "one huge allocation");
    }
    let recursion =
        "def f(n):\n    return f(n + 1)\ntry:\n    f(0)\nexcept RecursionError:\n    r = 'RecursionError'\nr";
    assert_eq!(result(&survive(&s, "x", recursion, 30).await), "'RecursionError'");
    // Past the interpreter's guard, the C stack overflows: the interpreter dies and comes back.
    let crash = "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)";
    let sc = survive(&s, "x", crash, 30).await;
    assert_eq!(sc["state_lost"], true, "{sc}");
    let fds = "import errno\nfs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\nexcept OSError as e:\n    \
               r = errno.errorcode[e.errno]\nfor f in fs:\n    f.close()\n(r, len(fs) < 2000)";
    assert_eq!(result(&survive(&s, "x", fds, 30).await), "('EMFILE', True)", "fd exhaustion");
    let tmp = "import errno, os\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        while True:\n            \
               f.write(b'x' * (1 << 20))\nexcept OSError as e:\n    r = errno.errorcode[e.errno]\nos.remove('/tmp/fill')\nr";
    assert_eq!(result(&survive(&s, "x", tmp, 60).await), "'ENOSPC'", "/tmp fill");
    // The fill stops itself after 10 s (runc's limit of 16384 inodes ends it long before).
    let inodes = "import errno, os, shutil, time\nos.makedirs('/tmp/i', exist_ok=True)\nn = 0\nr = 'time'\n\
                  end = time.time() + 10\ntry:\n    while time.time() < end:\n        \
                  open(f'/tmp/i/{n}', 'w').close(); n += 1\nexcept OSError as e:\n    r = errno.errorcode[e.errno]\n\
                  shutil.rmtree('/tmp/i')\n(r, n < 20000)";
    let filled = survive(&s, "x", inodes, 60).await;
    if gvisor() {
        // gVisor's own tmpfs ignores nr_inodes: its inodes are gVisor's memory, inside the
        // sandbox's memory limit (which ends the sandbox, as the huge allocation shows).
        assert!(["('ENOSPC', True)", "('time', False)"].contains(&result(&filled)), "inode fill: {filled}");
    } else {
        assert_eq!(result(&filled), "('ENOSPC', True)", "inode fill");
    }
    let big = "import errno\ntry:\n    with open('big', 'wb') as f:\n        f.seek((1 << 30) + 10)\n        f.write(b'x')\n\
               except OSError as e:\n    r = errno.errorcode[e.errno]\nr";
    assert_eq!(result(&survive(&s, "x", big, 30).await), "'EFBIG'", "a file past the size limit");
    // /var/tmp is world-writable on the image: only the read-only root refuses it, under any runtime.
    let rootfs =
        "import errno\ntry:\n    open('/var/tmp/evil', 'w')\nexcept OSError as e:\n    r = errno.errorcode[e.errno]\nr";
    assert_eq!(result(&survive(&s, "x", rootfs, 30).await), "'EROFS'");
    let int = "try:\n    str(10 ** 5000)\nexcept ValueError:\n    r = 'ValueError'\nr";
    assert_eq!(result(&survive(&s, "x", int, 30).await), "'ValueError'", "huge integers");
    let spin = survive(&s, "x", "while True:\n    pass", 1).await;
    assert_eq!(spin["status"], "timeout");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bounded_workspace_stops_disk_and_inode_fills_and_keeps_working() {
    let s = Server::start("workspace-fill", &[("PYBERTH_WORKSPACE_MB", "32")]).await;
    canary(&s).await;
    let fill = "import errno, os\ntry:\n    with open('fill', 'wb') as f:\n        while True:\n            \
                f.write(b'x' * (1 << 20))\nexcept OSError as e:\n    r = errno.errorcode[e.errno]\n\
                (r, os.path.getsize('fill') <= 32 << 20)";
    assert_eq!(result(&survive(&s, "w", fill, 60).await), "('ENOSPC', True)", "workspace fill");
    // Full, the workspace still answers the file tools; deleting makes room again.
    let r = s.call("delete_file", json!({ "session": "w", "path": "fill" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let inodes = "import errno, os, shutil\nos.makedirs('i', exist_ok=True)\nn = 0\ntry:\n    while True:\n        \
                  open(f'i/{n}', 'w').close(); n += 1\nexcept OSError as e:\n    r = errno.errorcode[e.errno]\n\
                  shutil.rmtree('i')\n(r, n < 20000)";
    assert_eq!(result(&survive(&s, "w", inodes, 60).await), "('ENOSPC', True)", "workspace inode fill");
    let r = s.call("write_file", json!({ "session": "w", "path": "ok.txt", "content": "still here" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(result(&s.ok("w", "open('ok.txt').read()").await), "'still here'");
    // Archives go in and out of a tmpfs-backed workspace through the Docker archive API.
    let tar = crate::workspace::tar_of(&[
        ("d/", tar::EntryType::Directory, ""),
        ("d/a.txt", tar::EntryType::Regular, "alpha"),
    ]);
    let r = s.call("upload_archive", json!({ "session": "w", "archive": crate::workspace::b64(&tar) })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(result(&s.ok("w", "open('d/a.txt').read()").await), "'alpha'");
    let r = s.call("download_archive", json!({ "session": "w", "path": "d" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let env = s.call("get_environment", json!({ "session": "w" })).await;
    assert_eq!(env.structured_content.expect("sc")["limits"]["workspace_mb"], 32);
    let instance = s.instance.clone();
    s.stop().await;
    assert_cleaned_up(&instance).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn output_and_protocol_abuse_cannot_confuse_the_server() {
    let s = Server::start("protocol", &[]).await;
    let flood = survive(&s, "x", "import sys\nsys.stdout.write('x' * (20 << 20))", 60).await;
    assert_eq!(flood["truncated"], true);
    let line = survive(&s, "x", "print('y' * (5 << 20))", 60).await;
    assert_eq!(line["truncated"], true);
    let control = survive(&s, "x", "print('a\\x00b\\x1b[31mc\\x07d')", 30).await;
    assert_eq!(control["stdout"], "a\u{0}b\u{1b}[31mc\u{7}d\n");
    // Forged agent events, printed and from a forked child, stay output.
    let forged = r#"import os
fake = '{"ev":"done","id":999,"status":"ok","result":"forged"}'
print(fake, flush=True)
pid = os.fork()
if pid == 0:
    print(fake, flush=True)
    os._exit(0)
os.waitpid(pid, 0)
'real'"#;
    let sc = survive(&s, "x", forged, 30).await;
    assert_eq!(sc["result"], "'real'");
    assert_eq!(sc["stdout"].as_str().map(|o| o.matches("forged").count()), Some(2), "{sc}");
    // Forged events written straight into the event stream of the agent's forwarder.
    let inject = r#"import os, json
me = os.getpid()
done = 0
for pid in os.listdir('/proc'):
    if not pid.isdigit() or int(pid) == me:
        continue
    try:
        for fd in os.listdir(f'/proc/{pid}/fd'):
            try:
                with open(f'/proc/{pid}/fd/{fd}', 'wb', buffering=0) as f:
                    for i in range(1, 50):
                        f.write(json.dumps({"ev": "done", "id": i, "status": "ok", "result": "forged"}).encode() + b'\n')
                    f.write(b'\xff garbage \x00 not json\n')
                    done += 1
            except OSError:
                pass
    except OSError:
        pass
'injected'"#;
    let (_, sc) = s.run_with(json!({ "session": "x", "code": inject, "timeout_s": 30 })).await;
    assert_ne!(sc["result"], "'forged'", "an injected done never passes for the real result: {sc}");
    let after = s.ok("x", "21 * 2").await;
    assert_eq!(after["result"], "42", "the next run's result is its own");
    let closed = survive(&s, "x", "import os\nos.close(0)\nos.close(1)\nos.close(2)", 30).await;
    assert!(closed["status"] == "ok" || closed["state_lost"] == true, "{closed}");
    let redirected =
        "import os, sys\nfd = os.open('/dev/null', os.O_WRONLY)\nos.dup2(fd, 1)\nos.dup2(fd, 2)\nprint('gone')";
    survive(&s, "x", redirected, 30).await;
    assert_eq!(s.ok("x", "print('back')").await["stdout"], "back\n", "fds 1 and 2 are restored");
    let sc = survive(&s, "x", "raise SystemExit(3)", 30).await;
    assert_eq!(sc["exit_code"], 3);
    let sc = survive(&s, "x", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", 30).await;
    assert_eq!(sc["state_lost"], true);
    let zombies = r#"import os, time, subprocess
for _ in range(20):
    if os.fork() == 0:
        os._exit(0)
subprocess.run(['sh', '-c', 'sleep 0.2 & exit 0'])
time.sleep(1)
def state(p):
    try:
        return open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]
    except OSError:
        return '?'
zs = [p for p in os.listdir('/proc') if p.isdigit() and state(p) == 'Z']
while True:
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            break
    except ChildProcessError:
        break
orphans = [p for p in os.listdir('/proc') if p.isdigit() and state(p) == 'Z']
len(orphans)"#;
    let sc = survive(&s, "x", zombies, 30).await;
    assert_eq!(sc["result"], "0", "the code's own zombies are its to reap; orphans are reaped by init");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn isolation_probes_find_nothing() {
    let s = Server::start("probes", &[("AWS_SECRET_ACCESS_KEY", "do-not-leak")]).await;
    s.ok("other", "open('marker-of-other', 'w').write('secret')").await;
    let probes = r#"import ctypes, errno, os, signal, socket
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def err(f):
    try:
        f()
        return 'allowed'
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    except Exception as e:
        return type(e).__name__
def sys_call(nr, *args):
    r = libc.syscall(nr, *args)
    return 'allowed' if r >= 0 else errno.errorcode.get(ctypes.get_errno(), '?')
out['io_uring'] = sys_call(425, 8, ctypes.create_string_buffer(120))
out['unshare_user'] = sys_call(272, 0x10000000)
out['keyctl'] = sys_call(250, 0, 0, 0, 0, 0)
out['ip'] = err(lambda: socket.create_connection(('1.1.1.1', 53), timeout=2))
out['metadata'] = err(lambda: socket.create_connection(('169.254.169.254', 80), timeout=2))
out['dns'] = err(lambda: socket.getaddrinfo('pypi.org', 443))
out['vsock'] = err(lambda: socket.socket(40, socket.SOCK_STREAM))
out['docker_sock'] = os.path.exists('/var/run/docker.sock') or os.path.exists('/run/docker.sock')
out['proc_sys'] = err(lambda: open('/proc/sys/kernel/hostname', 'w').write('x'))
out['sys'] = err(lambda: open('/sys/kernel/uevent_helper', 'w').write('x'))
out['kill_init'] = err(lambda: os.kill(1, signal.SIGTERM))
out['setuid'] = err(lambda: os.setuid(0))
status = open('/proc/self/status').read()
out['caps'] = [l.split()[1] for l in status.splitlines() if l.startswith('CapEff')][0]
out['suid_files'] = [os.path.join(d, f) for d, _, fs in os.walk('/usr') for f in fs
                     if os.path.isfile(os.path.join(d, f)) and os.stat(os.path.join(d, f)).st_mode & 0o6000][:3]
out['secret'] = 'AWS_SECRET_ACCESS_KEY' in os.environ
out['other'] = [d for d, _, fs in os.walk('/') if 'marker-of-other' in fs and not d.startswith('/proc')][:3]
out"#;
    let sc = s.ok("x", probes).await;
    let r = result(&sc).to_owned();
    // Under runc our seccomp profile answers the first three with EPERM, and the empty network
    // namespace has no route. Under gVisor the Sentry answers: io_uring is its own small
    // implementation (the host's is out of reach: gVisor's host filter never allows it), user
    // namespaces EINVAL, keyrings EACCES, and its network stack says no route to host.
    let unreachable = if gvisor() { "EHOSTUNREACH" } else { "ENETUNREACH" };
    if gvisor() {
        for (probe, answer) in [("unshare_user", "EINVAL"), ("keyctl", "EACCES")] {
            let said = [format!("'{probe}': 'EPERM'"), format!("'{probe}': '{answer}'")];
            assert!(said.iter().any(|w| r.contains(w.as_str())), "{probe} refused: {r}");
        }
    } else {
        for want in ["'io_uring': 'EPERM'", "'unshare_user': 'EPERM'", "'keyctl': 'EPERM'"] {
            assert!(r.contains(want), "missing {want} in {r}");
        }
    }
    for want in [format!("'ip': '{unreachable}'"), format!("'metadata': '{unreachable}'")] {
        assert!(r.contains(&want), "missing {want} in {r}");
    }
    for want in [
        "'docker_sock': False",
        "'kill_init': 'EPERM'",
        "'setuid': 'EPERM'",
        "'caps': '0000000000000000'",
        "'suid_files': []",
        "'secret': False",
        "'other': []",
    ] {
        assert!(r.contains(want), "missing {want} in {r}");
    }
    for written in ["'proc_sys': 'allowed'", "'sys': 'allowed'", "'dns': 'allowed'", "'vsock': 'allowed'"] {
        assert!(!r.contains(written), "{written} in {r}");
    }
    // A broadcast kill reaches only the code's own processes: the container survives.
    let sc = survive(&s, "x", "import os, signal\nos.kill(-1, signal.SIGKILL)", 30).await;
    assert_eq!(sc["state_lost"], true);
    assert_eq!(s.ok("other", "open('marker-of-other').read()").await["result"], "'secret'");
    let instance = s.instance.clone();
    s.stop().await;
    assert_cleaned_up(&instance).await;
}

/// Code that holds every inotify instance, POSIX message queue byte and process slot its uid
/// may have. Each session's code runs under a uid of its own (design.md D4), so none of it
/// reaches another session, nor a host user of the uid sessions used to share (1000).
#[tokio::test(flavor = "multi_thread")]
async fn sessions_and_the_host_user_do_not_share_per_uid_limits() {
    let s = Server::start("per-uid", &[]).await;
    let helpers = "import ctypes, errno, os, resource\nlibc = ctypes.CDLL(None, use_errno=True)\n\
                   libc.mq_open.restype = ctypes.c_int\n\
                   libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]\n\
                   def code():\n    return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))\n";
    s.ok("hog", helpers).await;
    s.ok("other", helpers).await;
    // inotify instances: 128 per uid by default (fs.inotify.max_user_instances).
    let fill = "held = []\nerr = None\nwhile len(held) < 4096:\n    fd = libc.inotify_init1(0)\n    \
                if fd < 0:\n        err = code()\n        break\n    held.append(fd)\nerr";
    assert_eq!(result(&s.ok("hog", fill).await), "'EMFILE'", "the hog holds every inotify instance of its uid");
    let one = "fd = libc.inotify_init1(0)\nr = 'ok' if fd >= 0 else code()\nos.close(fd) if fd >= 0 else None\nr";
    assert_eq!(result(&s.ok("other", one).await), "'ok'", "another session still gets an inotify instance");
    // The host's own uid 1000 (the uid every session used to run as) is untouched too.
    match host_inotify_as_1000().await {
        Some(r) => assert_eq!(r, "ok", "the host's uid 1000 still gets an inotify instance"),
        None => eprintln!("host check skipped: needs root, setpriv and /usr/bin/python3 on the host"),
    }
    // Let go of them: under gVisor the fill ends at the fd limit, not a per-uid one, and
    // the hog needs fds to go on.
    s.ok("hog", "for fd in held:\n    os.close(fd)\nheld = []").await;
    // POSIX message queues: RLIMIT_MSGQUEUE bytes per uid (819200 by default).
    let queues = "qs = []\nerr = None\nwhile len(qs) < 256:\n    q = libc.mq_open(b'/q%d' % len(qs), 0o102, 0o600, None)\n    \
                  if q < 0:\n        err = code()\n        break\n    qs.append(q)\n(err, len(qs) > 0)";
    // gVisor's Sentry has no POSIX message queues (mq_open fails at once), and its per-user
    // limits are its own sandbox's anyway; under runc they are the host kernel's, per uid.
    if !gvisor() {
        assert_eq!(result(&s.ok("hog", queues).await), "('EMFILE', True)", "the hog holds its uid's queue bytes");
        let q = "q = libc.mq_open(b'/mine', 0o102, 0o600, None)\n'ok' if q >= 0 else code()";
        assert_eq!(result(&s.ok("other", q).await), "'ok'", "another session still opens a message queue");
    }
    // RLIMIT_NPROC counts every process of a uid: the hog's 40 sleepers never count against
    // a limit another session sets for itself. Under gVisor, processes are the Sentry's, per
    // sandbox, and its own threads already take much of the pids limit: nothing to show there.
    if !gvisor() {
        s.ok("hog", "import subprocess\nsleepers = [subprocess.Popen(['sleep', '120']) for _ in range(40)]").await;
        let fork = "soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)\n\
                    resource.setrlimit(resource.RLIMIT_NPROC, (30, hard))\ntry:\n    pid = os.fork()\n    \
                    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n    r = 'forked'\nexcept OSError as e:\n    \
                    r = errno.errorcode[e.errno]\nfinally:\n    resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))\nr";
        assert_eq!(result(&s.ok("other", fork).await), "'forked'", "another session's processes do not count");
    }
    // Every session has a uid of its own, in the reserved range, and never 1000.
    let uid = |sc: Value| result(&sc).parse::<u64>().expect("a uid");
    let (a, b) = (uid(s.ok("hog", "os.getuid()").await), uid(s.ok("other", "os.getuid()").await));
    assert_ne!(a, b, "two sessions, two uids");
    for u in [a, b] {
        assert!((0x7000_0000..=0x7FFD_FFFF).contains(&u), "uid {u} is in the default --uid-range");
    }
    canary(&s).await;
    let instance = s.instance.clone();
    s.stop().await;
    assert_cleaned_up(&instance).await;
}

/// `inotify_init1` in a host process of uid 1000, when the test may start one (as root, with
/// `setpriv`); `None` otherwise.
async fn host_inotify_as_1000() -> Option<String> {
    let python = std::path::Path::new("/usr/bin/python3");
    if !rustix::process::geteuid().is_root() || !python.exists() || !std::path::Path::new("/usr/bin/setpriv").exists() {
        return None;
    }
    let code = "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.inotify_init1(0)\n\
                print('ok' if fd >= 0 else errno.errorcode.get(ctypes.get_errno()))";
    let out = tokio::process::Command::new("/usr/bin/setpriv")
        .args(["--reuid", "1000", "--regid", "1000", "--clear-groups", "/usr/bin/python3", "-I", "-c", code])
        .current_dir("/")
        .output()
        .await
        .ok()?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// With no disk setting at all, a session's workspace is bounded (half of its memory): filling
/// it with bytes, with empty files, or with `fallocate(FALLOC_FL_KEEP_SIZE)` (blocks past the
/// end of a file that shows size 0) stops at the bound with ENOSPC, and the session keeps
/// working: the next run succeeds, and deleting a file makes room again.
#[tokio::test(flavor = "multi_thread")]
async fn the_default_workspace_is_bounded_for_bytes_inodes_and_fallocate() {
    let s = Server::start("default-disk", &[]).await;
    let env = s.call("get_environment", json!({})).await.structured_content.expect("sc");
    assert_eq!(env["limits"]["workspace_mb"], 256, "half of the default 512 MiB of memory: {env}");
    // Bytes: 600 MiB asked for, in 1 MiB writes.
    let bytes = "import errno, os\nn = 0\nerr = None\ntry:\n    with open('fill', 'wb') as f:\n        \
                 while n < 600:\n            f.write(b'x' * (1 << 20))\n            n += 1\nexcept OSError as e:\n    \
                 err = errno.errorcode[e.errno]\n(err, os.stat('fill').st_blocks * 512 <= 256 << 20)";
    assert_eq!(result(&survive(&s, "w", bytes, 120).await), "('ENOSPC', True)", "a byte fill stops at the bound");
    // Full: a write fails with ENOSPC in the user's traceback, the run says error, the session lives.
    let (r, sc) = s.run_with(json!({ "session": "w", "code": "open('more', 'wb').write(b'y' * (4 << 20))" })).await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(sc["status"], "error", "{sc}");
    let tb = sc["error"]["traceback"].as_str().unwrap_or_default();
    assert!(tb.contains("No space left on device"), "ENOSPC in the traceback: {tb}");
    let r = s.call("delete_file", json!({ "session": "w", "path": "fill" })).await;
    assert_eq!(r.is_error, Some(false), "deleting works on a full workspace: {}", text(&r));
    assert_eq!(result(&s.ok("w", "open('more', 'wb').write(b'y' * (4 << 20))").await), "4194304", "room again");
    // Inodes: 200,000 empty files asked for.
    let inodes = "import errno, os, shutil\nos.makedirs('i', exist_ok=True)\nn = 0\nerr = None\ntry:\n    \
                  while n < 200000:\n        open(f'i/{n}', 'w').close()\n        n += 1\nexcept OSError as e:\n    \
                  err = errno.errorcode[e.errno]\nshutil.rmtree('i')\n(err, n < 200000)";
    assert_eq!(result(&survive(&s, "w", inodes, 120).await), "('ENOSPC', True)", "an inode fill stops at the bound");
    // fallocate past the end of a file (FALLOC_FL_KEEP_SIZE), which keeps showing size 0: 900
    // MiB (under the 1 GiB per-file limit) meets the workspace's bound; 1.5 GiB meets the
    // per-file limit first (tmpfs checks it even past the end of the file, ext4 does not).
    let falloc = "import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n\
                  libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]\n\
                  def pre(mb):\n    fd = os.open('pre', os.O_WRONLY | os.O_CREAT, 0o644)\n    \
                  r = libc.fallocate(fd, 1, 0, mb << 20)\n    err = errno.errorcode.get(ctypes.get_errno()) if r else None\n    \
                  st = os.fstat(fd)\n    os.close(fd)\n    os.remove('pre')\n    \
                  return (err, st.st_size, st.st_blocks * 512 <= 256 << 20)\n[pre(900), pre(1536)]";
    // gVisor refuses FALLOC_FL_KEEP_SIZE on the gofer-backed volume outright (ENOTSUP):
    // nothing is allocated either way, which is what the last field checks.
    let want = if gvisor() {
        "[('ENOTSUP', 0, True), ('ENOTSUP', 0, True)]"
    } else {
        "[('ENOSPC', 0, True), ('EFBIG', 0, True)]"
    };
    assert_eq!(result(&survive(&s, "w", falloc, 120).await), want, "fallocate stops at the bound");
    assert_eq!(result(&s.ok("w", "open('more', 'rb').read().count(b'y')").await), "4194304", "files are kept");
    let instance = s.instance.clone();
    s.stop().await;
    assert_cleaned_up(&instance).await;
}
