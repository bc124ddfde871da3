//! Code-mode calls across a dropped exec stream: the code can kill its own relay
//! (`/opt/pyberth/relay` runs as its uid), and the server reattaches (docs/design.md D12). A call in flight then
//! still gets its answer, and the run's call budget is the same one after the reattach.

use serde_json::json;

use super::{Fixture, run};

/// Python that kills the session's relay (as the code's own uid), waits until it is dead
/// (its socket closed: what the keeper then sends stays with the keeper for the next relay,
/// while bytes sent to a relay being killed are lost with it), and says how many it killed.
const KILL_RELAY: &str = "import os, signal, time\n\
def kill_relay():\n\
\x20   pids = []\n\
\x20   for p in os.listdir('/proc'):\n\
\x20       if not p.isdigit():\n\
\x20           continue\n\
\x20       try:\n\
\x20           cmd = open('/proc/%s/cmdline' % p, 'rb').read().split(b'\\0')\n\
\x20       except OSError:\n\
\x20           continue\n\
\x20       if cmd[0] == b'/opt/pyberth/relay':\n\
\x20           os.kill(int(p), signal.SIGKILL)\n\
\x20           pids.append(p)\n\
\x20   for p in pids:\n\
\x20       for _ in range(1000):\n\
\x20           try:\n\
\x20               if open('/proc/%s/stat' % p).read().rsplit(') ', 1)[1][:1] in 'ZX':\n\
\x20                   break\n\
\x20           except OSError:\n\
\x20               break\n\
\x20           time.sleep(0.01)\n\
\x20   time.sleep(0.1)\n\
\x20   return len(pids)\n";

/// The attack: with a budget of 3 calls a run, code that kills its relay after each call
/// (each kill a reattach, 3 at most a run) still makes 3 calls in all; the 4th gets the
/// budget's exception, on the stream of the last reattach.
#[tokio::test(flavor = "multi_thread")]
async fn killing_the_relay_between_calls_does_not_renew_the_call_budget() {
    let f = Fixture::new("rebudget", "[environments.default]\ntools = [\"bad:*\"]\ntool_calls = 3\n");
    let s = f.server("codemode-rebudget").await;
    let code = format!(
        "{KILL_RELAY}import tools\nmade = 0\nfor i in range(10):\n\
         \x20   try:\n        tools.bad.echo(text=str(i))\n\
         \x20   except tools.ToolError as e:\n        print('refused at', i, e)\n        break\n\
         \x20   made += 1\n\
         \x20   if i < 3:\n        print('killed', kill_relay(), flush=True)\n\
         print('made', made)"
    );
    let (err, sc, t) = run(&s, "r", "default", &code).await;
    assert!(!err, "{t}");
    assert_eq!(sc["status"], "ok", "{t} {sc}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert_eq!(out.matches("killed 1").count(), 3, "the relay was killed three times: {out}");
    assert!(out.contains("refused at 3 call budget spent: a run may make 3 tool calls"), "{out}");
    assert!(out.contains("made 3"), "{out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 3, "refused": 1 }), "{t}");
    assert_eq!(sc["state_lost"], false, "{t}");
    // The next run has a budget of its own.
    let (err, sc, t) = run(&s, "r", "default", "import tools\ntools.bad.echo(text='next')").await;
    assert!(!err, "{t}");
    assert_eq!(sc["tool_calls"], json!({ "made": 1, "refused": 0 }), "{t}");
    s.stop().await;
}

/// A call in flight when the stream drops is answered on the next one, uncancelled, and the
/// calls after it go on; the interpreter is kept.
#[tokio::test(flavor = "multi_thread")]
async fn a_call_in_flight_when_the_relay_dies_gets_its_answer_after_the_reattach() {
    let f = Fixture::new("reattach", "[environments.default]\ntools = [\"bad:*\"]\n");
    let s = f.server("codemode-reattach").await;
    assert_eq!(s.ok("k", "x = 41").await["status"], "ok");
    let code = format!(
        "{KILL_RELAY}import threading, time, tools\n\
         def killer():\n    time.sleep(1.0)\n    print('killed', kill_relay(), flush=True)\n\
         t = threading.Thread(target=killer)\nt.start()\n\
         print('answer', tools.bad.slow(seconds=3))\nt.join()\n\
         print('echoed', sum(tools.bad.echo(text=str(i))['result'] == str(i) for i in range(5)))\nx += 1"
    );
    let args = json!({ "session": "k", "environment": "default", "code": code, "timeout_s": 40 });
    let (r, sc) = s.run_with(args).await;
    let t = crate::common::text(&r);
    assert_eq!(r.is_error, Some(false), "{t}");
    assert_eq!(sc["status"], "ok", "{t} {sc}");
    let out = sc["stdout"].as_str().unwrap_or_default();
    assert_eq!(out.matches("killed 1").count(), 1, "the relay was killed: {out}");
    assert!(out.contains("answer {'result': 'slept 3.0'}"), "{out}");
    assert!(out.contains("echoed 5"), "calls go on on the new stream: {out}");
    assert_eq!(sc["tool_calls"], json!({ "made": 6, "refused": 0 }), "{t}");
    assert_eq!(f.marks("slow-started"), 1);
    assert_eq!(f.marks("slow-cancelled"), 0, "the call in flight was not cancelled upstream");
    let sc = s.ok("k", "x").await;
    assert_eq!(sc["result"], "42", "the interpreter is kept: {sc}");
    let log = s.stop().await;
    assert!(log.contains("reattached to the interpreter"), "the server reattached");
}
