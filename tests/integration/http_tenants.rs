//! Two principals racing for the per-principal caps (issue 27, "Also"): many session creates
//! and jobs at once over HTTP. Each cap must hold exactly, for each principal, whatever the
//! interleaving: the count is taken and the place reserved under one lock (sessions) or one
//! semaphore per principal (runs and jobs).

use futures::future::join_all;
use serde_json::{Value, json};

use crate::common::text;
use crate::http::{ALICE, BOB, HttpServer, call};

/// Tool calls of one client, all in flight at once; the results in order.
async fn at_once(
    client: &rmcp::service::RunningService<rmcp::RoleClient, crate::common::Recorder>,
    calls: Vec<Value>,
) -> Vec<(bool, String, Value)> {
    let pending = calls.into_iter().map(|args| async move {
        let (r, sc) = call(client, "run_python", args).await;
        (r.is_error == Some(false), text(&r), sc)
    });
    join_all(pending).await
}

#[tokio::test(flavor = "multi_thread")]
async fn per_principal_caps_hold_exactly_under_concurrent_creates_and_jobs() {
    let env =
        [("PYBERTH_MAX_SESSIONS", "3"), ("PYBERTH_MAX_SESSIONS_TOTAL", "5"), ("PYBERTH_MAX_RUNS_PER_CALLER", "2")];
    let s = HttpServer::start_with("http-caps", &env, None).await;
    let alice = s.client(ALICE).await;
    let bob = s.client(BOB).await;

    // 8 creates from each principal, all 16 in flight together.
    let creates =
        |who: &str| (0..8).map(|i| json!({ "session": format!("{who}{i}"), "code": "1" })).collect::<Vec<_>>();
    let (a, b) = tokio::join!(at_once(&alice, creates("a")), at_once(&bob, creates("b")));
    let ok = |rs: &[(bool, String, Value)]| rs.iter().filter(|r| r.0).count();
    let (a_ok, b_ok) = (ok(&a), ok(&b));
    assert!(a_ok <= 3 && b_ok <= 3, "a principal got past --max-sessions 3: alice {a_ok}, bob {b_ok}");
    assert_eq!(a_ok + b_ok, 5, "the server-wide ceiling is met exactly: alice {a_ok}, bob {b_ok}");
    for (_, why, _) in a.iter().chain(&b).filter(|r| !r.0) {
        assert!(why.contains("sessions open") || why.contains("no room for another session"), "{why}");
    }
    // What each lists is what each was given; nothing half made is left over.
    for (client, want) in [(&alice, a_ok), (&bob, b_ok)] {
        let (r, sc) = call(client, "list_sessions", json!({})).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
        assert_eq!(sc["sessions"].as_array().map(Vec::len), Some(want), "{sc}");
    }

    // 6 background jobs from each principal at once, over the sessions each has.
    let names = |rs: &[(bool, String, Value)], who: &str| -> Vec<String> {
        (0..8).filter(|&i| rs[i].0).map(|i| format!("{who}{i}")).collect()
    };
    let (a_names, b_names) = (names(&a, "a"), names(&b, "b"));
    let jobs = |names: &[String]| {
        (0..6)
            .map(|i| {
                let session = &names[i % names.len()];
                json!({ "session": session, "code": "import time; time.sleep(6)", "background": true })
            })
            .collect::<Vec<_>>()
    };
    let (aj, bj) = tokio::join!(at_once(&alice, jobs(&a_names)), at_once(&bob, jobs(&b_names)));
    for (who, rs) in [("alice", &aj), ("bob", &bj)] {
        assert_eq!(ok(rs), 2, "{who}: exactly --max-runs-per-caller 2 jobs start: {rs:?}");
        for (_, why, _) in rs.iter().filter(|r| !r.0) {
            assert!(why.contains("you have 2 runs going"), "{who}: {why}");
        }
    }
    // The places come back when the jobs end: a new job starts within the jobs' time and a bit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(40);
    loop {
        let (r, _) = call(&alice, "run_python", json!({ "session": a_names[0], "code": "1" })).await;
        if r.is_error == Some(false) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "run places never came back: {}", text(&r));
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    let _ = alice.cancel().await;
    let _ = bob.cancel().await;
    s.stop().await;
}

/// The layer store between two principals (issue 27, "Also"): sets are shared by content, so
/// alice and bob asking for the same requirements get the same directory. Alice's code tries
/// to poison it for bob: write into the set, plant a `.pth` beside it, and install under a
/// name that looks the same but is another set. Bob's `six` is the one from the index.
#[tokio::test(flavor = "multi_thread")]
async fn one_principal_cannot_poison_the_dependency_set_of_another() {
    let store = crate::common::PrivateStore::new("tenants");
    let s = HttpServer::start_with("http-layers", &[store.env()], None).await;
    let alice = s.client(ALICE).await;
    let bob = s.client(BOB).await;
    let fingerprint = "import six, hashlib, os\nd = os.path.dirname(six.__file__)\n\
                       (d, hashlib.sha256(open(six.__file__, 'rb').read()).hexdigest())";
    let (r, sc) = call(&alice, "run_python", json!({ "session": "a", "code": fingerprint, "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let before = sc["result"].as_str().expect("result").to_owned();
    assert!(before.contains("/opt/pyberth/layers/"), "{before}");
    let attack = r#"
import six, os
site = os.path.dirname(six.__file__)
out = {}
for what, path in [("module", six.__file__), ("pth", site + "/zz-evil.pth"), ("sibling", site + "/../evil")]:
    try:
        open(path, "a").write("\nimport os; os.environ['POISONED'] = '1'\n")
        out[what] = "written"
    except OSError as e:
        out[what] = type(e).__name__
out
"#;
    let (r, sc) = call(&alice, "run_python", json!({ "session": "a", "code": attack })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let result = sc["result"].as_str().expect("result");
    assert!(!result.contains("written"), "alice wrote into the shared set: {result}");
    // Requirement strings that would change what is installed under the same set are refused.
    for bad in ["six @ https://example.invalid/six.whl", "six --index-url=http://example.invalid", "./six"] {
        let (r, _) = call(&alice, "install_packages", json!({ "session": "a", "packages": [bad] })).await;
        assert_eq!(r.is_error, Some(true), "{bad}: {}", text(&r));
    }
    // Bob asks for the same set: the same directory, the index's bytes, nothing of alice's.
    let probe = "import six, hashlib, os\nd = os.path.dirname(six.__file__)\n\
                 (d, hashlib.sha256(open(six.__file__, 'rb').read()).hexdigest(), os.environ.get('POISONED'))";
    let (r, sc) = call(&bob, "run_python", json!({ "session": "b", "code": probe, "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let seen = sc["result"].as_str().expect("result");
    assert_eq!(seen, format!("{}, None)", before.trim_end_matches(')')), "bob's six is alice's first, untouched");
    let _ = alice.cancel().await;
    let _ = bob.cancel().await;
    s.stop().await;
}
