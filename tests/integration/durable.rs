//! Durable sessions (issue 18): snapshots, restore, fork, hibernation, and why a session ended.
//! Every test against the real engine through the real binary and client.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bollard::query_parameters::ListVolumesOptionsBuilder;
use serde_json::{Value, json};

use crate::common::{Server, containers_of, docker, text};
use crate::http::{ALICE, BOB, HttpServer, call};

/// Defines the state every snapshot test checks: ints, a dict, a class and a function defined
/// in the cell, an instance, a file, and a DataFrame when pandas is importable.
const STATE: &str = r#"
import json, os
n = 41
conf = {"a": [1, 2, {"b": 3}], "t": (1, "x")}
shared = [1, 2]
alias = shared
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
    def norm2(self):
        return self.x * self.x + self.y * self.y
def bump(k):
    return n + k
p = Point(3, 4)
with open("notes.txt", "w") as f:
    f.write("kept\n")
os.makedirs("sub/deep", exist_ok=True)
with open("sub/deep/data.bin", "wb") as f:
    f.write(bytes(range(256)) * 64)
try:
    import pandas as pd
    df = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", "z"]})
    have_pandas = True
except ImportError:
    have_pandas = False
del f  # a closed file does not pickle either; the test of what is lost has its own
"#;

/// What every restored copy of [`STATE`] must answer.
const CHECK: &str = r#"
import hashlib
assert n == 41 and conf == {"a": [1, 2, {"b": 3}], "t": (1, "x")}, (n, conf)
assert alias is shared, "objects shared between names stay shared"
assert bump(1) == 42
assert isinstance(p, Point) and p.norm2() == 25 and Point(1, 1).norm2() == 2
assert open("notes.txt").read() == "kept\n"
assert hashlib.sha256(open("sub/deep/data.bin", "rb").read()).hexdigest() == hashlib.sha256(bytes(range(256)) * 64).hexdigest()
if have_pandas:
    assert df.shape == (3, 2) and list(df["b"]) == ["x", "y", "z"]
print("pandas" if have_pandas else "no pandas")
"#;

fn names(v: &Value, field: &str) -> Vec<String> {
    v[field].as_array().map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect()).unwrap_or_default()
}

fn lost_names(v: &Value) -> Vec<String> {
    v["lost"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x["name"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// Whether pandas is importable in the session image, as the check printed it.
fn pandas_seen(sc: &Value) -> bool {
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert!(out.contains("pandas"), "the check says which case ran: {out}");
    !out.contains("no pandas")
}

#[tokio::test(flavor = "multi_thread")]
async fn state_and_files_survive_snapshot_restore_and_fork() {
    let s = Server::start("durable-basic", &[]).await;
    s.ok("origin", STATE).await;
    let r = s.call("snapshot_session", json!({"session": "origin", "name": "first"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.clone().expect("structured");
    assert_eq!(sc["grade"], "files+globals", "{sc}");
    assert_eq!(sc["snapshot"], "first");
    assert!(sc["files"].as_u64() >= Some(2), "{sc}");
    assert!(sc["workspace_bytes"].as_u64() >= Some(16384), "{sc}");
    assert!(sc["state_bytes"].as_u64() > Some(0), "{sc}");
    let saved = names(&sc, "saved");
    for n in ["n", "conf", "Point", "bump", "p", "json", "os", "shared", "alias"] {
        assert!(saved.iter().any(|s| s == n), "{n} saved: {saved:?}");
    }
    assert!(lost_names(&sc).is_empty(), "nothing lost: {sc}");

    let r = s.call("restore_session", json!({"snapshot": "first", "session": "copy"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let rc = r.structured_content.clone().expect("structured");
    assert!(lost_names(&rc).is_empty(), "{rc}");
    assert!(names(&rc, "restored").iter().any(|n| n == "p"), "{rc}");
    let checked = s.ok("copy", CHECK).await;
    let pandas = pandas_seen(&checked);
    eprintln!("DataFrame case: {}", if pandas { "ran (pandas importable)" } else { "skipped: pandas not importable" });
    let probe = s.ok("copy", "import importlib.util; importlib.util.find_spec('pandas') is not None").await;
    assert_eq!(probe["result"] == "True", pandas, "skipped only when pandas is not importable");
    // Defined again, not merely loaded: tracebacks still show the cell's lines.
    let (r, sc) = s.run("copy", "bump(None)").await;
    assert_eq!(r.is_error, Some(true));
    assert!(sc["error"]["traceback"].as_str().unwrap_or_default().contains("return n + k"), "{sc}");

    let r = s.call("fork_session", json!({"session": "origin", "new_session": "forked"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let fc = r.structured_content.clone().expect("structured");
    assert!(fc["snapshot_ms"].as_u64().is_some(), "{fc}");
    s.ok("forked", CHECK).await;
    // A restore never replaces a session.
    let r = s.call("restore_session", json!({"snapshot": "first", "session": "origin"})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("exists"), "{}", text(&r));
    let listed = s.call("list_snapshots", json!({})).await;
    let lc = listed.structured_content.clone().expect("structured");
    assert_eq!(lc["snapshots"].as_array().map(Vec::len), Some(1), "a fork keeps no snapshot: {lc}");
    let r = s.call("delete_snapshot", json!({"snapshot": "first"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("restore_session", json!({"snapshot": "first", "session": "again"})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("no snapshot named"), "{}", text(&r));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn what_cannot_be_pickled_is_listed_not_dropped() {
    let s = Server::start("durable-lost", &[]).await;
    let code = r#"
import socket, threading, time
keep = 7
fh = open("open.txt", "w")
stop = threading.Event()
th = threading.Thread(target=stop.wait, daemon=True)
th.start()
sock = socket.socket(socket.AF_UNIX)
def make():
    seen = []
    return lambda x: seen.append(x)
closure = make()
lam = lambda: 1
class Refuses:
    def __reduce__(self):
        raise TypeError("I refuse")
no = Refuses()
"#;
    s.ok("s", code).await;
    let r = s.call("snapshot_session", json!({"session": "s", "name": "lossy"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.clone().expect("structured");
    let lost = lost_names(&sc);
    for n in ["fh", "th", "stop", "sock", "closure", "lam", "no"] {
        assert!(lost.iter().any(|l| l == n), "{n} listed as not saved: {sc}");
    }
    assert!(text(&r).contains("I refuse"), "the reason is told: {}", text(&r));
    assert!(names(&sc, "saved").iter().any(|n| n == "keep"));
    let r = s.call("restore_session", json!({"snapshot": "lossy", "session": "back"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let rc = r.structured_content.clone().expect("structured");
    let lost = lost_names(&rc);
    for n in ["fh", "th", "sock", "closure", "lam", "no"] {
        assert!(lost.iter().any(|l| l == n), "{n} listed as not restored: {rc}");
    }
    s.ok("back", "assert keep == 7 and Refuses is not None and 'fh' not in globals()").await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_diverges_from_its_parent() {
    let s = Server::start("durable-fork", &[]).await;
    s.ok("parent", "x = [1]\nopen('f.txt', 'w').write('parent')").await;
    let r = s.call("fork_session", json!({"session": "parent", "new_session": "child"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.ok("child", "x.append(2)\nopen('f.txt', 'w').write('child')\nopen('only-child', 'w').close()").await;
    s.ok("parent", "x.append(3)\nopen('only-parent', 'w').close()").await;
    let p = s.ok("parent", "import os; (x, open('f.txt').read(), sorted(os.listdir('.')))").await;
    assert_eq!(p["result"], "([1, 3], 'parent', ['f.txt', 'only-parent'])", "{p}");
    let c = s.ok("child", "import os; (x, open('f.txt').read(), sorted(os.listdir('.')))").await;
    assert_eq!(c["result"], "([1, 2], 'child', ['f.txt', 'only-child'])", "{c}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_sessions_hibernate_and_wake_with_their_state() {
    let s = Server::start("durable-sleep", &[("PYBERTH_HIBERNATE_AFTER_S", "2"), ("PYBERTH_IDLE_TTL", "600")]).await;
    s.ok(
        "nap",
        "import threading\nclass C:\n    v = 5\nc = C()\ntotal = 10\nopen('w.txt', 'w').write('w')\nfh = open('w.txt')",
    )
    .await;
    // A session with a job going stays awake.
    let r = s
        .call("run_python", json!({"session": "busy", "code": "import time; time.sleep(8)", "background": true}))
        .await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = s.call("list_sessions", json!({})).await;
        let sc = l.structured_content.clone().expect("structured");
        let state = |name: &str| {
            sc["sessions"].as_array().and_then(|a| a.iter().find(|x| x["session"] == name)).map(|x| x["state"].clone())
        };
        if state("nap") == Some(json!("hibernated")) {
            assert_eq!(state("busy"), Some(json!("running")), "a running job keeps its session awake: {sc}");
            assert!(text(&l).contains("nap: hibernated"), "{}", text(&l));
            break;
        }
        assert!(Instant::now() < deadline, "not hibernated: {sc}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let running: Vec<String> = containers_of(&s.instance)
        .await
        .into_iter()
        .filter(|c| c.labels.as_ref().and_then(|l| l.get("pyberth.session")).is_some_and(|n| n == "nap"))
        .filter_map(|c| c.id)
        .collect();
    assert!(running.is_empty(), "a hibernated session holds no container: {running:?}");
    let started = Instant::now();
    let (r, sc) = s.run("nap", "(total, c.v, open('w.txt').read())").await;
    eprintln!("wake and first run: {} ms", started.elapsed().as_millis());
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "(10, 5, 'w')", "{sc}");
    let all = text(&r);
    assert!(all.contains("hibernated") && all.contains("fh"), "the notice names what did not come back: {all}");
    // A reset of a hibernated session keeps its files and drops its variables, as for any other.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !text(&s.call("list_sessions", json!({})).await).contains("nap: hibernated") {
        assert!(Instant::now() < deadline, "not hibernated again");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let r = s.call("reset_session", json!({"session": "nap"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let after = s.ok("nap", "('total' in globals(), open('w.txt').read())").await;
    assert_eq!(after["result"], "(False, 'w')", "{after}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_of_one_principal_are_invisible_to_another() {
    let s = HttpServer::start("durable-principals").await;
    let alice = s.client(ALICE).await;
    let bob = s.client(BOB).await;
    let (r, _) = call(&alice, "run_python", json!({"session": "a", "code": "secret = 'alice'"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, _) = call(&alice, "snapshot_session", json!({"session": "a", "name": "mine"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (_, listed) = call(&bob, "list_snapshots", json!({})).await;
    assert_eq!(listed["snapshots"].as_array().map(Vec::len), Some(0), "{listed}");
    let (r, _) = call(&bob, "restore_session", json!({"snapshot": "mine", "session": "b"})).await;
    assert_eq!(r.is_error, Some(true));
    let theirs = text(&r);
    let (r, _) = call(&bob, "restore_session", json!({"snapshot": "nothing-here", "session": "b"})).await;
    assert_eq!(theirs, text(&r).replace("nothing-here", "mine"), "the same answer as for no snapshot at all");
    let (r, _) = call(&bob, "delete_snapshot", json!({"snapshot": "mine"})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("no snapshot named"), "{}", text(&r));
    // Bob's own snapshot of the same name is his, and alice's is untouched.
    let (r, _) = call(&bob, "run_python", json!({"session": "a", "code": "secret = 'bob'"})).await;
    assert_eq!(r.is_error, Some(false));
    let (r, _) = call(&bob, "snapshot_session", json!({"session": "a", "name": "mine"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, _) = call(&alice, "restore_session", json!({"snapshot": "mine", "session": "a2"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (_, sc) = call(&alice, "run_python", json!({"session": "a2", "code": "secret"})).await;
    assert_eq!(sc["result"], "'alice'");
    let _ = alice.cancel().await;
    let _ = bob.cancel().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cache_bound_prunes_the_least_recently_used() {
    let s = Server::start("durable-cache", &[("PYBERTH_SNAPSHOT_CACHE_MB", "1")]).await;
    s.ok("s", "open('blob', 'wb').write(b'x' * 400_000)").await;
    for name in ["one", "two"] {
        let r = s.call("snapshot_session", json!({"session": "s", "name": name})).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    // Using "one" makes "two" the least recently used.
    let r = s.call("restore_session", json!({"snapshot": "one", "session": "r"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("snapshot_session", json!({"session": "s", "name": "three"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let l = s.call("list_snapshots", json!({})).await;
    let sc = l.structured_content.clone().expect("structured");
    let mut listed: Vec<String> = sc["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .filter_map(|x| x["snapshot"].as_str().map(str::to_owned))
        .collect();
    listed.sort();
    assert_eq!(listed, ["one", "three"], "{sc}");
    assert!(sc["total_bytes"].as_u64() <= Some(1 << 20), "{sc}");
    // The pruned snapshot's volume is gone too.
    let vols = snapshot_volumes(&s.instance).await;
    assert_eq!(vols.len(), 2, "{vols:?}");
    // One snapshot over the whole bound is refused, and nothing is left of it.
    s.ok("s", "open('big', 'wb').write(b'y' * 1_200_000)").await;
    let r = s.call("snapshot_session", json!({"session": "s", "name": "big"})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("--snapshot-cache-mb"), "{}", text(&r));
    // The session itself is untouched by the refusal.
    s.ok("s", "import os; assert os.path.getsize('big') == 1_200_000").await;
    assert_eq!(snapshot_volumes(&s.instance).await.len(), 2);
    s.stop().await;
}

/// Snapshot volumes of an instance, by their labels.
async fn snapshot_volumes(instance: &str) -> Vec<(String, HashMap<String, String>)> {
    let label = format!("pyberth.instance={instance}");
    let filters = HashMap::from([("label", vec![label.as_str(), "pyberth.snapshot"])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let list = docker().await.list_volumes(Some(opts)).await.expect("list volumes");
    list.volumes.unwrap_or_default().into_iter().map(|v| (v.name, v.labels)).collect()
}

/// Runs `sh -c script` in a throwaway container with the volume at /snap (the test's own,
/// removed at once).
async fn tamper(volume: &str, script: &str) {
    let image = std::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .args(["image", "tag"])
        .output()
        .expect("pyberth image tag");
    let image = String::from_utf8_lossy(&image.stdout).trim().to_owned();
    let status = std::process::Command::new("docker")
        .args([
            "run",
            "--rm",
            "--network",
            "none",
            "-u",
            "0",
            "-v",
            &format!("{volume}:/snap"),
            &image,
            "sh",
            "-c",
            script,
        ])
        .status()
        .expect("docker run");
    assert!(status.success(), "tampering with {volume}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupted_snapshot_gives_a_clear_error_and_a_fresh_session() {
    let s = Server::start("durable-corrupt", &[]).await;
    s.ok("s", "x = 1\nopen('a.txt', 'w').write('a')").await;
    for name in ["bytes", "missing"] {
        let r = s.call("snapshot_session", json!({"session": "s", "name": name})).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    let vols = snapshot_volumes(&s.instance).await;
    assert_eq!(vols.len(), 2);
    // Same sizes, other bytes in the pickles; and a workspace file gone.
    let pick = |i: usize| vols[i].0.clone();
    let (first, second) = if vols[0].1.get("pyberth.snapshot") < vols[1].1.get("pyberth.snapshot") {
        (pick(0), pick(1))
    } else {
        (pick(1), pick(0))
    };
    tamper(&first, "f=/snap/state/values.pkl; n=$(wc -c < $f); head -c $n /dev/zero > $f").await;
    tamper(&second, "rm /snap/workspace/a.txt").await;
    for (snapshot, session) in [("bytes", "r1"), ("missing", "r2")] {
        let r = s.call("restore_session", json!({"snapshot": snapshot, "session": session})).await;
        assert_eq!(r.is_error, Some(true), "{}", text(&r));
        let t = text(&r);
        assert!(t.contains("corrupted") && t.contains("fresh"), "a clear error that says the session is fresh: {t}");
        let fresh = s.ok(session, "import os; ('x' in globals(), os.listdir('.'))").await;
        assert_eq!(fresh["result"], "(False, [])", "{fresh}");
    }
    s.stop().await;
}

/// Sessions above 16 MiB go volume to volume through the packer container: state and files
/// come back, and damage at rest (other bytes, a link put in a file's place) is found.
#[tokio::test(flavor = "multi_thread")]
async fn a_large_session_goes_through_the_packer_and_damage_is_found() {
    let s = Server::start("durable-packer", &[]).await;
    let setup = "import os\nblob = os.urandom(9 << 20)\nos.makedirs('d/e', exist_ok=True)\n\
                 open('d/e/big.bin', 'wb').write(os.urandom(9 << 20))\nopen('a.txt', 'w').write('a')\n\
                 os.symlink('/etc/passwd', 'link')";
    s.ok("b", setup).await;
    for name in ["ok", "bytes", "link"] {
        let r = s.call("snapshot_session", json!({"session": "b", "name": name})).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        let sc = r.structured_content.clone().unwrap_or_default();
        assert_eq!(sc["skipped_entries"], 1, "the link is not saved: {sc}");
        assert!(sc["state_bytes"].as_u64().unwrap_or(0) > 9 << 20, "{sc}");
    }
    // The private state directory is gone from the workspace again.
    let listed = s.ok("b", "import os; sorted(os.listdir('.'))").await;
    assert_eq!(listed["result"], "['a.txt', 'd', 'link']", "{listed}");
    let r = s.call("restore_session", json!({"snapshot": "ok", "session": "r0"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let back = s
        .ok("r0", "import os, zlib; (len(blob), os.path.getsize('d/e/big.bin'), open('a.txt').read(), sorted(os.listdir('.')))")
        .await;
    assert_eq!(back["result"], "(9437184, 9437184, 'a', ['a.txt', 'd'])", "{back}");
    let vols = snapshot_volumes(&s.instance).await;
    let find = |n: &str| -> String {
        let mut v: Vec<&(String, HashMap<String, String>)> = vols.iter().collect();
        v.sort_by_key(|(_, l)| l.get("pyberth.snapshot").cloned());
        let i = ["ok", "bytes", "link"].iter().position(|x| *x == n).expect("name");
        v[i].0.clone()
    };
    // Written by the packer as the code's uid, not by the engine as root.
    tamper(
        &find("ok"),
        "test $(stat -c %u /snap/state/values.pkl) -ne 0 && test $(stat -c %u /snap/workspace/a.txt) -ne 0",
    )
    .await;
    tamper(&find("bytes"), "f=/snap/state/values.pkl; n=$(wc -c < $f); head -c $n /dev/zero > $f").await;
    tamper(&find("link"), "rm /snap/workspace/a.txt; ln -s /etc/passwd /snap/workspace/a.txt").await;
    for (snapshot, session) in [("bytes", "r1"), ("link", "r2")] {
        let r = s.call("restore_session", json!({"snapshot": snapshot, "session": session})).await;
        assert_eq!(r.is_error, Some(true), "{}", text(&r));
        let t = text(&r);
        assert!(t.contains("corrupted") && t.contains("fresh"), "a clear error that says the session is fresh: {t}");
        let fresh = s.ok(session, "import os; ('blob' in globals(), os.listdir('.'))").await;
        assert_eq!(fresh["result"], "(False, [])", "{fresh}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ended_session_says_why() {
    let s = Server::start("durable-ended", &[("PYBERTH_IDLE_TTL", "2"), ("PYBERTH_HIBERNATE_AFTER_S", "0")]).await;
    s.ok("closed", "1").await;
    let r = s.call("close_session", json!({"session": "closed"})).await;
    assert_eq!(r.is_error, Some(false));
    let r = s.call("list_variables", json!({"session": "closed"})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("closed by close_session"), "{}", text(&r));
    s.ok("idle", "1").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    // Polled through list_sessions, which does not count as using a session.
    loop {
        let l = s.call("list_sessions", json!({})).await;
        if !text(&l).contains("idle:") {
            break;
        }
        assert!(Instant::now() < deadline, "never reaped");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let r = s.call("list_variables", json!({"session": "idle"})).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("expired") && text(&r).contains("--idle-ttl-s"), "{}", text(&r));
    // A new session of that name starts afresh and is found again.
    s.ok("idle", "2").await;
    let r = s.call("list_variables", json!({"session": "idle"})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.stop().await;
}
