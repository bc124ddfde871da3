use std::collections::HashMap;

use bollard::query_parameters::ListContainersOptionsBuilder;

use crate::common::{Server, docker, gvisor, test_runtime};

#[tokio::test(flavor = "multi_thread")]
async fn the_sandbox_is_hardened_from_the_inside() {
    let s = Server::start("hardening", &[("SERVER_SECRET_TOKEN", "hunter2")]).await;
    let code = r#"
import ctypes, os, errno, signal, socket, getpass, pathlib, pwd
libc = ctypes.CDLL(None, use_errno=True)
status = dict(l.split(':\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\t' in l)
ifaces = sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:])
try:
    # World-writable on the image: only the read-only root can refuse (gVisor checks permissions
    # before the mount, so a root-owned directory would answer EACCES there).
    open('/var/tmp/pyberth-probe', 'w')
    rootfs = 'writable'
except OSError as e:
    rootfs = errno.errorcode[e.errno]
try:
    os.kill(1, signal.SIGTERM)
    pid1 = 'signalled'
except PermissionError:
    pid1 = 'EPERM'
try:
    socket.create_connection(('1.1.1.1', 53), timeout=2)
    net = 'connected'
except OSError as e:
    net = type(e).__name__
{
  'uid': os.getuid(), 'gid': os.getgid(),
  'capeff': status['CapEff'].strip(), 'nonewprivs': libc.prctl(39, 0, 0, 0, 0),
  'seccomp': status['Seccomp'].strip(), 'kernel': os.uname().release, 'ifaces': ifaces, 'rootfs': rootfs, 'pid1': pid1,
  'net': net, 'secret': 'SERVER_SECRET_TOKEN' in os.environ, 'cwd': os.getcwd(),
  'workspace_writable': os.access('/workspace', os.W_OK),
  'user': getpass.getuser(), 'home': os.path.expanduser('~'), 'path_home': str(pathlib.Path.home()),
  'groups': os.getgroups(), 'workspace_owner': os.stat('/workspace').st_uid == os.getuid(),
}
"#;
    let sc = s.ok("default", code).await;
    let r = sc["result"].as_str().expect("result");
    // gVisor: the code's system calls reach gVisor's Sentry, which reports its own kernel
    // release, and no seccomp filter of ours sits in front of it (runsc applies none to exec'd
    // processes); its own filter guards the host instead. Under runc the filter is there and the
    // kernel is the host's.
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("host kernel").trim().to_owned();
    let kernel = format!("'kernel': '{host_kernel}'");
    if gvisor() {
        assert!(!r.contains(&kernel), "gVisor answers uname, not the host kernel {host_kernel}: {r}");
    } else {
        assert!(r.contains(&kernel) && r.contains("'seccomp': '2'"), "the host kernel, behind seccomp: {r}");
    }
    let uid = s.ok("default", "os.getuid()").await["result"].as_str().expect("uid").parse::<u64>().expect("a number");
    assert!((0x7000_0000..=0x7FFD_FFFF).contains(&uid), "uid {uid} in the default --uid-range");
    for want in [
        format!("'uid': {uid}"),
        format!("'gid': {uid}"),
        format!("'groups': [{uid}]"),
        "'workspace_owner': True".to_owned(),
        "'user': 'sandbox'".to_owned(),
        "'home': '/workspace'".to_owned(),
        "'path_home': '/workspace'".to_owned(),
        "'capeff': '0000000000000000'".to_owned(),
        "'nonewprivs': 1".to_owned(),
        "'ifaces': ['lo']".to_owned(),
        "'rootfs': 'EROFS'".to_owned(),
        "'pid1': 'EPERM'".to_owned(),
        "'secret': False".to_owned(),
        "'cwd': '/workspace'".to_owned(),
        "'workspace_writable': True".to_owned(),
    ] {
        assert!(r.contains(&want), "missing {want} in {r}");
    }
    assert!(!r.contains("'net': 'connected'"), "{r}");
    // No passwd entry names the uid: lookups by uid fail plainly, lookups by name find nothing.
    let lookup = "try:\n    pwd.getpwuid(os.getuid())\n    r = 'found'\nexcept KeyError:\n    r = 'KeyError'\nr";
    assert_eq!(s.ok("default", lookup).await["result"], "'KeyError'");

    // The container itself, as the engine sees it.
    let label = format!("pyberth.instance={}", s.instance);
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    let list = docker().await.list_containers(Some(opts)).await.expect("list");
    assert_eq!(list.len(), 1);
    let id = list[0].id.clone().expect("id");
    let c = docker().await.inspect_container(&id, None).await.expect("inspect");
    let hc = c.host_config.expect("host config");
    let runtime = test_runtime().unwrap_or_else(|| "runc".to_owned());
    assert_eq!(hc.runtime.as_deref(), Some(runtime.as_str()), "the sandbox runs under the runtime asked for");
    assert_eq!(hc.network_mode.as_deref(), Some("none"));
    assert_eq!(hc.cap_drop, Some(vec!["ALL".to_owned()]));
    assert_eq!(hc.readonly_rootfs, Some(true));
    assert_eq!(hc.memory, Some(512 << 20));
    assert_eq!(hc.memory_swap, hc.memory, "no swap");
    // Under gVisor its own threads get 64 more (docker/container.rs): the code's budget stays 256.
    assert_eq!(hc.pids_limit, Some(if gvisor() { 256 + 64 } else { 256 }));
    assert_eq!(hc.init, Some(true));
    assert_eq!(hc.privileged, Some(false));
    assert!(hc.security_opt.unwrap_or_default().iter().any(|o| o.starts_with("no-new-privileges")));
    assert_eq!(hc.log_config.and_then(|l| l.typ).as_deref(), Some("none"));
    let cfg = c.config.expect("config");
    assert_eq!(cfg.user.as_deref(), Some("999:999"), "PID 1 runs under another uid than code");
    let labels = cfg.labels.clone().unwrap_or_default();
    assert_eq!(labels.get("pyberth.uid"), Some(&uid.to_string()), "the code's uid is recorded on the container");
    assert!(!cfg.env.unwrap_or_default().iter().any(|e| e.contains("SERVER_SECRET_TOKEN")));
    // The workspace is a tmpfs-backed volume, bounded by default.
    let mounts = s.ok("default", "[l.split()[2] for l in open('/proc/mounts') if l.split()[1] == '/workspace']").await;
    // gVisor shows the same host tmpfs volume through its gofer, as 9p: the bound is the host's.
    let want = if gvisor() { "['9p']" } else { "['tmpfs']" };
    assert_eq!(mounts["result"], want);
    s.stop().await;
}

/// `--workspace-mb disk`: the workspace on the engine's volume disk, as before, still writable
/// by the session's own uid (the image's /workspace is 1777, and a volume copies its mode),
/// through the agent, the code and the engine's archive API alike.
#[tokio::test(flavor = "multi_thread")]
async fn an_on_disk_workspace_is_writable_by_the_sessions_own_uid() {
    let s = Server::start("on-disk", &[("PYBERTH_WORKSPACE_MB", "disk")]).await;
    let env = s.call("get_environment", serde_json::json!({})).await.structured_content.expect("sc");
    assert_eq!(env["limits"]["workspace_mb"], 0, "0: on disk: {env}");
    let code = "import os\nopen('mine.txt', 'w').write('x')\nos.makedirs('d/e')\n\
                m = [l.split()[2] for l in open('/proc/mounts') if l.split()[1] == '/workspace']\n\
                (m != ['tmpfs'], os.stat('mine.txt').st_uid == os.getuid(), oct(os.stat('.').st_mode & 0o7777))";
    assert_eq!(s.ok("default", code).await["result"], "(True, True, '0o1777')");
    let r = s.call("write_file", serde_json::json!({ "path": "d/e/f.txt", "content": "agent" })).await;
    assert_eq!(r.is_error, Some(false));
    assert_eq!(s.ok("default", "open('d/e/f.txt').read()").await["result"], "'agent'");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_bomb_is_contained() {
    let s = Server::start("forkbomb", &[]).await;
    let code = "import os\nn = 0\ntry:\n    for _ in range(10000):\n        if os.fork() == 0:\n            import time; time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError as e:\n    err = type(e).__name__\nn, err";
    let (_, sc) = s.run_with(serde_json::json!({ "code": code, "timeout_s": 20 })).await;
    let r = sc["result"].as_str().unwrap_or_default().to_owned();
    if gvisor() {
        // The pids limit counts the host threads and processes of gVisor itself, not the code's
        // tasks: past it gVisor cannot grow, and the whole sandbox ends (the engine's `die`
        // event then ends the run: the attached exec stream can outlive the sandbox).
        // Contained either way.
        assert!(r.contains("BlockingIOError") || sc["state_lost"] == true, "fork refused or sandbox ended: {sc}");
    } else {
        assert!(r.contains("BlockingIOError"), "fork failed at the pids limit: {sc}");
    }
    // Reset kills the forked children; the session answers again.
    let r = s.call("reset_session", serde_json::json!({})).await;
    assert_eq!(r.is_error, Some(false));
    assert_eq!(s.ok("default", "1 + 1").await["result"], "2");
    s.stop().await;
}
