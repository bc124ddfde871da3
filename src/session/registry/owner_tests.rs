//! The registry as an owner, through the in-process fake engine (`docker::fake`): no Docker.
//! Each test checks what the owner says against what the engine holds, and against the
//! records the ledger wrote in the state dir.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Error, Registry};
use crate::docker::container::Sandboxing;
use crate::docker::fake::FakeEngine;
use crate::docker::{LABEL_INSTANCE, LABEL_OWNER, LABEL_SESSION};
use crate::instance::Instance;
use crate::protocol::Request;
use crate::session::{RunSpec, Session};

/// A registry on a fake engine that holds the sandbox image, with its own state dir (removed
/// on drop). Records are kept (`--keep-sessions`), so the ledger's writes can be checked.
pub(super) struct Bench {
    pub(super) fake: FakeEngine,
    pub(super) reg: Arc<Registry>,
    dir: std::path::PathBuf,
}

impl Bench {
    pub(super) fn new(flags: &[&str]) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "pyberth-owner-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let dir_arg = dir.to_string_lossy().into_owned();
        let mut args = vec!["--state-dir", dir_arg.as_str(), "--keep-sessions", "--adopt-grace-s", "600"];
        args.extend_from_slice(flags);
        let cfg = crate::config::from_flags(&args);
        // Every environment's image, so sessions of any of them start.
        let envs = crate::environment::Environments::from_config(&cfg).expect("the built-in environments");
        let tags: Vec<String> = envs.all().map(|e| crate::docker::image::tag_for(&e.cfg)).collect();
        let fake = FakeEngine::with_images(&tags);
        let instance = Instance::acquire(&dir, None).expect("an instance lock");
        let reg =
            Registry::new(Arc::new(fake.clone()), Arc::new(cfg), instance, Sandboxing::default()).expect("a registry");
        Self { fake, reg: Arc::new(reg), dir }
    }

    pub(super) async fn open(&self, principal: &str, name: &str) -> Result<(Arc<Session>, bool), Error> {
        self.open_in(principal, name, None).await
    }

    /// Opens a session of environment `env` (the default's when `None`).
    pub(super) async fn open_in(
        &self,
        principal: &str,
        name: &str,
        env: Option<&str>,
    ) -> Result<(Arc<Session>, bool), Error> {
        let opened = self.reg.open(principal, name, env, &[], None, &|_| {}).await?;
        Ok((opened.session, opened.created))
    }

    /// The containers of session `name` of `principal` on the engine.
    pub(super) fn containers_of(&self, principal: &str, name: &str) -> Vec<String> {
        let w = self.fake.world();
        w.containers
            .iter()
            .filter(|(_, c)| {
                c.labels.get(LABEL_SESSION).is_some_and(|s| s == name)
                    && c.labels.get(LABEL_OWNER).is_some_and(|p| p == principal)
            })
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Names of the volumes and containers of this instance on the engine.
    pub(super) fn ours(&self) -> Vec<String> {
        let own = &self.reg.instance.owner.instance;
        let w = self.fake.world();
        let mine = |l: &std::collections::HashMap<String, String>| l.get(LABEL_INSTANCE) == Some(own);
        let containers = w.containers.iter().filter(|(_, c)| mine(&c.labels)).map(|(n, _)| n.clone());
        let volumes = w.volumes.iter().filter(|(_, v)| mine(&v.labels)).map(|(n, _)| n.clone());
        containers.chain(volumes).collect()
    }

    /// The records on disk agree with the engine: every running record names a running
    /// container of ours with its workspace volume, every sleeper a snapshot volume, and every
    /// session container of ours is recorded.
    fn records_agree(&self) {
        let running = self.reg.ledger.running();
        let sleepers = self.reg.ledger.sleepers();
        let own = &self.reg.instance.owner.instance;
        let w = self.fake.world();
        for r in &running {
            let c =
                w.containers.get(&r.about.container).unwrap_or_else(|| panic!("{} recorded, not there", r.about.name));
            assert!(c.running && c.mounts.iter().any(|(_, v)| *v == r.about.volume), "{}", r.about.name);
            assert_eq!(c.labels.get(LABEL_INSTANCE), Some(own));
        }
        for s in &sleepers {
            assert!(w.volumes.contains_key(&s.saved.volume), "{}: its snapshot volume", s.about.name);
        }
        let recorded: Vec<&String> = running.iter().map(|r| &r.about.container).collect();
        for (name, c) in &w.containers {
            let sandbox = c.labels.get(LABEL_INSTANCE) == Some(own)
                && c.mounts.iter().any(|(t, _)| t == crate::docker::WORKSPACE);
            let pooled = c.labels.get(LABEL_SESSION).is_some_and(|s| s.starts_with("pool-"));
            assert!(!sandbox || pooled || recorded.contains(&name), "{name} runs unrecorded");
        }
    }
}

impl Drop for Bench {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Hibernates `s`. A session busy for a moment (its watchdog looking at the lease) is not
/// hibernated at once: the reaper tries again on its next tick, and so does this.
pub(super) async fn hibernate(b: &Bench, s: &Session) {
    for _ in 0..100 {
        if b.reg.hibernate_within_caps(s).await.expect("no cap in the way") {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("{} was not hibernated", s.name);
}

pub(super) async fn run(s: &Session, code: &str) -> crate::session::RunOutcome {
    let spec = RunSpec { code: code.into(), ..RunSpec::default() };
    s.run(spec, Duration::from_secs(10), &CancellationToken::new(), &|_, _| {}).await.expect("a run")
}

fn names(vars: &[crate::protocol::Variable]) -> BTreeMap<String, String> {
    vars.iter().map(|v| (v.name.clone(), v.repr.clone())).collect()
}

#[tokio::test]
async fn a_session_is_opened_once_recorded_and_closed_with_its_container_volume_and_record() {
    let b = Bench::new(&[]);
    let (s, created) = b.open("alice", "s1").await.expect("opened");
    assert!(created);
    let out = run(&s, "x = 40\nprint('hi')\nx + 2").await;
    assert_eq!(out.result.as_deref(), Some("42"));
    assert_eq!(out.stdout.render().0, "hi\n");
    // The same (principal, name) is the same session; another principal's is its own.
    let (again, created) = b.open("alice", "s1").await.expect("found");
    assert!(!created && Arc::ptr_eq(&s, &again));
    let (bobs, _) = b.open("bob", "s1").await.expect("bob's");
    assert!(!Arc::ptr_eq(&s, &bobs));
    let [container] = b.containers_of("alice", "s1").try_into().expect("one container of alice's s1");
    {
        let w = b.fake.world();
        let c = &w.containers[&container];
        assert!(c.running);
        let workspace = &c.mounts.iter().find(|(t, _)| t == crate::docker::WORKSPACE).expect("a workspace").1;
        assert!(w.volumes.contains_key(workspace));
    }
    // The ledger wrote the running session through: its record names that container.
    let recorded: Vec<(String, String)> =
        b.reg.ledger.running().into_iter().map(|r| (r.about.name, r.about.container)).collect();
    assert!(recorded.contains(&("s1".into(), container.clone())), "{recorded:?}");
    assert_eq!(recorded.len(), 2);
    b.records_agree();

    b.reg.close("alice", "s1").await.expect("closed");
    assert!(b.containers_of("alice", "s1").is_empty());
    assert!(!b.fake.world().volumes.keys().any(|v| v.starts_with(&container)), "its volumes went too");
    let left: Vec<String> = b.reg.ledger.running().into_iter().map(|r| r.about.container).collect();
    assert!(!left.contains(&container), "its record went: {left:?}");
    assert!(matches!(b.reg.get("alice", "s1"), Err(Error::Ended { .. })));
    assert!(b.reg.find("bob", "s1").is_some(), "bob's is untouched");
    b.records_agree();
    assert!(matches!(b.reg.close("alice", "nope").await, Err(Error::NotFound(_))));
}

#[tokio::test]
async fn caps_per_caller_and_per_server_refuse_before_anything_is_made() {
    let b = Bench::new(&["--max-sessions", "2", "--max-sessions-total", "3"]);
    b.open("alice", "a").await.expect("a");
    b.open("alice", "b").await.expect("b");
    assert!(matches!(b.open("alice", "c").await, Err(Error::Capacity(2))));
    b.open("bob", "a").await.expect("bob's a");
    assert!(matches!(b.open("bob", "b").await, Err(Error::ServerFull)));
    assert!(b.containers_of("alice", "c").is_empty() && b.containers_of("bob", "b").is_empty());
    // A closed session frees its place.
    b.reg.close("alice", "a").await.expect("closed");
    b.open("bob", "b").await.expect("room again");
    assert_eq!(b.reg.ledger.running().len(), 3);
    b.records_agree();
}

#[tokio::test]
async fn an_idle_session_is_reaped_with_its_container_and_record_and_says_why() {
    let b = Bench::new(&["--idle-ttl-s", "60"]);
    let (s, _) = b.open("alice", "idle").await.expect("opened");
    let (busy, _) = b.open("alice", "busy").await.expect("opened");
    assert_eq!(b.reg.reap_idle().await, 0, "nothing idle for a minute yet");
    // Its last use an hour ago, as the clock of an idle server would have it.
    let long_ago = std::time::Instant::now().checked_sub(Duration::from_secs(3600)).expect("an hour of uptime");
    *s.last_used.lock().expect("last use") = long_ago;
    *busy.last_used.lock().expect("last use") = long_ago;
    // Held as a run holds it.
    let held = busy.inner.lock().await;
    assert_eq!(b.containers_of("alice", "idle").len(), 1);
    drop(s);
    assert_eq!(b.reg.reap_idle().await, 1);
    assert!(b.containers_of("alice", "idle").is_empty());
    let running: Vec<String> = b.reg.ledger.running().into_iter().map(|r| r.about.name).collect();
    assert_eq!(running, ["busy"], "a busy session is never reaped, however idle");
    assert_eq!(b.containers_of("alice", "busy").len(), 1);
    drop(held);
    let why = b.reg.ended_why("alice", "idle").expect("a reason");
    assert!(why.starts_with("expired"), "{why}");
}

#[tokio::test]
async fn a_hibernated_session_keeps_only_its_snapshot_and_wakes_with_its_variables_and_files() {
    let b = Bench::new(&[]);
    let (s, _) = b.open("alice", "sleepy").await.expect("opened");
    run(&s, "x = 7\nname = 'berth'").await;
    let written =
        s.file(|id| Request::Write { id, path: "notes/a.txt", b: "aGk=", append: false }).await.expect("written");
    assert_eq!(written.size, Some(2));
    let [before] = b.containers_of("alice", "sleepy").try_into().expect("one container");

    // What the state dir holds as its container is removed: a server killed at that moment
    // must find the session recorded asleep, or it is lost.
    // A record written meanwhile (set_env does not wait for the session) is the sleeper's too.
    let seen: Arc<Mutex<Vec<(String, usize)>>> = Arc::default();
    let (dir, log, meanwhile) = (b.dir.join("sleepers"), seen.clone(), s.clone());
    b.fake.world().on_remove.0 = Some(Arc::new(move |name: &str| {
        meanwhile.write_through();
        let n = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or_default();
        log.lock().expect("the log").push((name.to_owned(), n));
    }));
    hibernate(&b, &s).await;
    b.fake.world().on_remove.0 = None;
    let seen: Vec<_> = seen.lock().expect("the log").iter().filter(|(n, _)| *n == before).cloned().collect();
    assert_eq!(seen, [(before.clone(), 1)], "its sleeper record was written before its container went");
    assert!(s.is_asleep());
    assert!(b.containers_of("alice", "sleepy").is_empty(), "its container went");
    b.records_agree();
    let sleepers = b.reg.ledger.sleepers();
    let [sleeper] = sleepers.as_slice() else { panic!("one sleeper record: {sleepers:?}") };
    assert!(b.reg.ledger.running().is_empty(), "the running record went");
    {
        let w = b.fake.world();
        let snap = w.volumes.get(&sleeper.saved.volume).expect("the recorded snapshot volume exists");
        assert_eq!(snap.files.files.get("workspace/notes/a.txt").map(Vec::as_slice), Some(&b"hi"[..]));
        assert!(snap.files.files.contains_key("state/values.pkl"));
        assert!(!w.volumes.keys().any(|v| v.starts_with(&before)), "the workspace volume went");
    }

    // The next call wakes it: a new container, variables and files back, the snapshot gone.
    let out = run(&s, "x + 1").await;
    assert_eq!(out.result.as_deref(), Some("8"));
    assert!(out.notices.iter().any(|n| n.contains("was woken")), "{:?}", out.notices);
    assert!(!out.state_lost, "{:?}", out.notices);
    let (vars, _) = s.variables().await.expect("variables");
    assert_eq!(names(&vars), BTreeMap::from([("name".into(), "'berth'".into()), ("x".into(), "7".into())]));
    let read = s.file(|id| Request::Read { id, path: "notes/a.txt", offset: 0, length: 100 }).await.expect("read");
    assert_eq!(read.data, b"hi");
    let [after] = b.containers_of("alice", "sleepy").try_into().expect("one new container");
    assert_ne!(after, before);
    assert!(!b.fake.world().volumes.contains_key(&sleeper.saved.volume), "the snapshot was removed");
    assert!(b.reg.ledger.sleepers().is_empty());
    let running: Vec<String> = b.reg.ledger.running().into_iter().map(|r| r.about.container).collect();
    assert_eq!(running, [after]);
    b.records_agree();
}

/// A close that comes while the session hibernates (it does not wait for the session) finds
/// no snapshot yet to remove: the hibernation removes its own, and nothing of it stays.
#[tokio::test]
async fn a_close_during_a_hibernation_leaves_no_snapshot() {
    let b = Bench::new(&[]);
    let (s, _) = b.open("alice", "shut").await.expect("opened");
    run(&s, "x = 1").await;
    let [container] = b.containers_of("alice", "shut").try_into().expect("one container");
    let closer = s.clone();
    let found: Arc<Mutex<Option<bool>>> = Arc::default();
    let saw = found.clone();
    b.fake.world().on_remove.0 = Some(Arc::new(move |name: &str| {
        if name == container {
            // What close does before it waits: marks the session closed, then reads its snapshot.
            closer.closed.store(true, std::sync::atomic::Ordering::SeqCst);
            *saw.lock().expect("seen") = Some(closer.asleep_store().is_some());
        }
    }));
    // Tried again while busy for a moment (hibernate's comment), until the removal was met.
    for _ in 0..100 {
        let slept = b.reg.hibernate_within_caps(&s).await.expect("no cap in the way");
        if found.lock().expect("seen").is_some() {
            assert!(!slept, "a hibernation that met a close says it did not put the session to sleep");
            break;
        }
        tokio::task::yield_now().await;
    }
    b.fake.world().on_remove.0 = None;
    assert_eq!(*found.lock().expect("seen"), Some(false), "the close found no snapshot to remove");
    // The close's own removals (its container, gone already) are all it does: nothing else may stay.
    assert!(b.ours().is_empty(), "nothing of the session stays: {:?}", b.ours());
    assert!(b.reg.ledger.sleepers().is_empty() && b.reg.ledger.running().is_empty());
}

#[tokio::test]
async fn a_killed_interpreter_is_replaced_and_the_run_says_its_state_went() {
    let b = Bench::new(&[]);
    let (s, _) = b.open("alice", "k").await.expect("opened");
    run(&s, "x = 1").await;
    let [c] = b.containers_of("alice", "k").try_into().expect("one container");
    // Behind the registry's back, as `docker rm -f` would.
    b.fake.vanish(&c);
    let out = run(&s, "y = 2\ny").await;
    assert_eq!(out.result.as_deref(), Some("2"));
    assert!(out.state_lost, "{:?}", out.notices);
    let [replaced] = b.containers_of("alice", "k").try_into().expect("a new container");
    assert_ne!(replaced, c);
    let running: Vec<String> = b.reg.ledger.running().into_iter().map(|r| r.about.container).collect();
    assert_eq!(running, [replaced], "the record follows the new container");
    b.records_agree();
}

#[tokio::test]
async fn new_sessions_the_pool_cannot_serve_make_their_containers_a_few_at_a_time() {
    let b = Bench::new(&["--pool-size", "0"]);
    b.fake.world().start_takes = Some(Duration::from_millis(50));
    let names: Vec<String> = (0..12).map(|i| format!("cold{i}")).collect();
    let opened = futures::future::join_all(names.iter().map(|n| b.open("alice", n))).await;
    assert!(opened.iter().all(Result::is_ok), "every session opened");
    let most = b.fake.world().most_starting;
    assert_eq!(most, super::make::COLD_PER_PRINCIPAL, "one caller's containers made a few at once, in turns");
    b.reg.shutdown(false).await;
    assert_eq!(b.ours(), Vec::<String>::new(), "a clean stop removes every container and volume of ours");
}

#[tokio::test]
async fn one_callers_burst_past_the_pool_leaves_a_turn_to_another() {
    let b = Bench::new(&["--pool-size", "0"]);
    b.fake.world().start_takes = Some(Duration::from_millis(60));
    let done = Mutex::new(Vec::new());
    let open = |principal: &'static str, name: String| {
        let (b, done) = (&b, &done);
        async move {
            let r = b.open(principal, &name).await;
            done.lock().unwrap_or_else(|e| e.into_inner()).push(principal);
            r
        }
    };
    // Alice's nine ask first, then Bob's one.
    let asks = (0..9).map(|i| open("alice", format!("a{i}"))).chain([open("bob", "b".to_owned())]);
    let opened = futures::future::join_all(asks).await;
    assert!(opened.iter().all(Result::is_ok), "every session opened");
    let order = done.into_inner().unwrap_or_else(|e| e.into_inner());
    let bob = order.iter().position(|p| *p == "bob").expect("bob's session");
    assert!(bob < super::make::COLD_AT_ONCE, "Bob's session is among the first made, not behind Alice's: {order:?}");
    assert_eq!(b.fake.world().most_starting, super::make::COLD_AT_ONCE, "the server's turns all used");
    b.reg.shutdown(false).await;
}

#[tokio::test]
async fn a_caller_that_goes_while_its_session_is_made_leaves_no_slot() {
    let b = Bench::new(&["--pool-size", "0"]);
    b.fake.world().start_takes = Some(Duration::from_millis(300));
    let gone = tokio::time::timeout(Duration::from_millis(50), b.open("alice", "left")).await;
    assert!(gone.is_err(), "the call went before its session was made");
    assert!(b.reg.slots().is_empty(), "its slot went with it: the caps count only live sessions");
    b.fake.world().start_takes = None;
    let (s, created) = b.open("alice", "left").await.expect("a retry makes it");
    assert!(created && s.name == "left");
    b.reg.shutdown(false).await;
}

#[tokio::test]
async fn an_idle_session_whose_code_is_quiet_stops_costing_engine_calls() {
    let b = Bench::new(&[]);
    let (s, _) = b.open("alice", "idle").await.expect("opened");
    // A run with a 200 ms limit: its lease passes 200 ms after it started. Under test the
    // watchdog's steps are far shorter (`watch.rs`): quiet for 0.5 s, it ends.
    let short = |code: &str| {
        let spec = RunSpec { code: code.into(), ..RunSpec::default() };
        let s = s.clone();
        async move { s.run(spec, Duration::from_millis(200), &CancellationToken::new(), &|_, _| {}).await.expect("a run") }
    };
    assert_eq!(short("1").await.result.as_deref(), Some("1"));
    let calls = || b.fake.world().stats_calls;
    let before = calls();
    // Past the lease and the quiet window (bounded wait): the watchdog sampled, then stopped.
    let stopped = async {
        let mut last = calls();
        loop {
            // Longer than the watchdog's longest pause (0.1 s): a step with no call is an end.
            tokio::time::sleep(Duration::from_millis(250)).await;
            let now = calls();
            if now > before && now == last {
                return now;
            }
            last = now;
        }
    };
    let sampled = tokio::time::timeout(Duration::from_secs(30), stopped).await.expect("the watchdog stopped");
    // Its longest pause is 0.1 s: six of them with no call is a watchdog that ended.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(calls(), sampled, "an idle, quiet session costs the engine nothing");
    // The next run's lease is watched again.
    short("2").await;
    // Its lease passes 200 ms after it started; the first sample follows within 10 ms.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(calls() > sampled, "a new lease starts a new watchdog");
}

#[tokio::test]
async fn the_owners_count_sessions_and_runs_and_a_scrape_names_no_session() {
    let b = Bench::new(&["--metrics-principal"]);
    let (s, _) = b.open("alice", "secret-name").await.expect("a session");
    assert_eq!(run(&s, "x = 1").await.status, crate::output::RunStatus::Ok);
    assert_eq!(run(&s, "1 / 0").await.status, crate::output::RunStatus::Error);
    let text = b.reg.metrics_text();
    let line = |l: &str| text.lines().any(|t| t == l);
    assert!(line(r#"pyberth_runs_total{status="ok",environment="default",principal="alice"} 1"#), "{text}");
    assert!(line(r#"pyberth_runs_total{status="error",environment="default",principal="alice"} 1"#), "{text}");
    assert!(line(r#"pyberth_sessions{state="running",environment="default"} 1"#), "{text}");
    // The pool keeper is not running: the ask missed and the container was made for it.
    assert!(line(r#"pyberth_sessions_created_total{source="cold",principal="alice"} 1"#), "{text}");
    assert!(line(r#"pyberth_pool_takes_total{result="miss"} 1"#), "{text}");
    assert!(line("pyberth_run_duration_seconds_count{status=\"ok\"} 1"), "{text}");
    assert!(!text.contains("secret-name") && !text.contains("1 / 0"), "{text}");
    b.reg.close("alice", "secret-name").await.expect("closed");
    let text = b.reg.metrics_text();
    assert!(!text.contains("pyberth_sessions{"), "a closed session leaves the gauge: {text}");
}
