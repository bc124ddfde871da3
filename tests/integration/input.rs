use serde_json::json;

use crate::common::{Server, containers_of, text};

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_is_a_clear_tool_error_and_creates_nothing() {
    let s = Server::start("input", &[("PYBERTH_CODE_CAP", "1000"), ("PYBERTH_MAX_TIMEOUT", "100")]).await;
    let cases = [
        (json!({ "code": "" }), "code is empty"),
        (json!({ "code": "   \n\t" }), "code is empty"),
        (json!({ "code": "x = 1\u{0}" }), "NUL byte"),
        (json!({ "code": "x".repeat(1001) }), "over the limit of 1000 bytes"),
        (json!({ "code": "1", "session": "../etc" }), "invalid session name"),
        (json!({ "code": "1", "session": "" }), "invalid session name"),
        (json!({ "code": "1", "timeout_s": 0 }), "out of range"),
        (json!({ "code": "1", "timeout_s": 101 }), "out of range"),
        (json!({ "code": "1", "timeout_s": -3 }), "out of range"),
        (json!({ "code": 5 }), "deserialize"),
        (json!({ "code": "1", "sesion": "typo" }), "unknown field"),
        (json!({ "code": "1", "packages": ["-r reqs.txt"] }), "installer options"),
    ];
    for (args, want) in cases {
        let r = s.call("run_python", args.clone()).await;
        assert_eq!(r.is_error, Some(true), "{args}");
        let t = text(&r);
        assert!(t.contains(want), "{args}: {t}");
    }
    for tool in ["reset_session", "list_variables", "close_session"] {
        let r = s.call(tool, json!({ "session": "nope" })).await;
        assert_eq!(r.is_error, Some(true), "{tool}");
        assert!(text(&r).contains("no session named \"nope\""), "{tool}: {}", text(&r));
    }
    assert!(containers_of(&s.instance).await.is_empty(), "no container was created for bad input");
    // A good session stays usable around bad calls.
    s.ok("good", "v = 1").await;
    let r = s.call("run_python", json!({ "code": "", "session": "good" })).await;
    assert_eq!(r.is_error, Some(true));
    assert_eq!(s.ok("good", "v").await["result"], "1");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_session_cap_gives_a_clear_error() {
    let s = Server::start("cap-sessions", &[("PYBERTH_MAX_SESSIONS", "2")]).await;
    s.ok("a", "1").await;
    s.ok("b", "1").await;
    let (r, _) = s.run("c", "1").await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("you have 2 sessions open (the limit per caller)"), "{}", text(&r));
    assert_eq!(containers_of(&s.instance).await.len(), 2);
    let r = s.call("close_session", json!({ "session": "a" })).await;
    assert_eq!(r.is_error, Some(false));
    s.ok("c", "1").await;
    s.stop().await;

    let s = Server::start("cap-total", &[("PYBERTH_MAX_SESSIONS", "5"), ("PYBERTH_MAX_SESSIONS_TOTAL", "1")]).await;
    s.ok("a", "1").await;
    let (r, _) = s.run("b", "1").await;
    assert_eq!(r.is_error, Some(true));
    let t = text(&r);
    assert!(t.contains("no room for another session") && !t.contains('1'), "reveals no count: {t}");
    s.stop().await;
}
