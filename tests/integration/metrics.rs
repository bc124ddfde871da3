//! Prometheus metrics (issue 32): a real Prometheus (Debian's `prometheus`), started here on
//! loopback with its own config and storage, scrapes the server every second through both
//! doors (`/metrics` on the MCP port with a bearer token, and `--metrics-addr`) while a small
//! core suite runs; its HTTP API must then show the series. And what a scrape must never
//! show: session names, hosts, code.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::common::text;
use crate::http::{ALICE, BOB, HttpServer, call};

/// A session name no series may carry (labels are bounded: no session names).
const SECRET_SESSION: &str = "metrics-secret-session-7c3e";
/// A host the sandbox asks for and is refused: it must not become a label either.
const REFUSED_HOST: &str = "refused-host-9d2a.example";

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// The Prometheus binary. Required: CI installs Debian's package (.ci/run), so a missing one
/// fails the test rather than skipping it.
fn prometheus_bin() -> PathBuf {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("prometheus")).find(|f| f.is_file()))
        .unwrap_or_default();
    found.expect("the metrics test needs Prometheus: apt-get install -y prometheus (Debian's package)")
}

/// A Prometheus of the test's own: its config, storage and port; killed on drop.
struct Prometheus {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    /// Scrapes `main` (the MCP port, with alice's token) and `side` (`--metrics-addr`) every second.
    async fn start(tag: &str, main: u16, side: u16) -> Prometheus {
        let dir = std::env::temp_dir().join(format!("pyberth-prometheus-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("data")).expect("prometheus dir");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n\
             - job_name: main\n  authorization:\n    type: Bearer\n    credentials: {ALICE}\n  \
             static_configs:\n  - targets: ['127.0.0.1:{main}']\n\
             - job_name: side\n  static_configs:\n  - targets: ['127.0.0.1:{side}']\n"
        );
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config).expect("prometheus config");
        let port = free_port();
        let child = Command::new(prometheus_bin())
            .arg(format!("--config.file={}", file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !crate::common::web().get(p.url("/-/ready")).send().await.is_ok_and(|r| r.status().is_success()) {
            assert!(Instant::now() < deadline, "Prometheus did not become ready");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        p
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The result vector of an instant query.
    async fn query(&self, q: &str) -> Vec<Value> {
        let url = reqwest::Url::parse_with_params(&self.url("/api/v1/query"), &[("query", q)]).expect("url");
        let body: Value = crate::common::web().get(url).send().await.expect("query").json().await.expect("json");
        assert_eq!(body["status"], "success", "{q}: {body}");
        body["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until `q` has a sample whose value passes `ok` (scrapes come each second).
    async fn until(&self, q: &str, ok: impl Fn(f64) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let found = self.query(q).await;
            if found.iter().any(|s| value(s).is_some_and(&ok)) {
                return found;
            }
            assert!(Instant::now() < deadline, "Prometheus has no passing sample of {q}: {found:?}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

fn value(sample: &Value) -> Option<f64> {
    sample["value"][1].as_str()?.parse().ok()
}

/// An environment with egress to one name, so a refusal can be provoked.
fn config(dir: &Path) -> PathBuf {
    let file = dir.join("pyberth.toml");
    std::fs::write(&file, "[environments.net]\negress = [\"allowed.test:8000\"]\n").expect("config");
    file
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_scrapes_the_series_of_a_core_suite() {
    let tag = crate::common::instance_name("metrics");
    let dir = std::env::temp_dir().join(format!("pyberth-metrics-{tag}"));
    std::fs::create_dir_all(&dir).expect("dir");
    let side = free_port();
    let side_addr = format!("127.0.0.1:{side}");
    let cfg = config(&dir);
    let env = [
        ("PYBERTH_METRICS_ADDR", side_addr.as_str()),
        ("PYBERTH_METRICS_PRINCIPAL", "true"),
        ("PYBERTH_POOL_SIZE", "1"),
        ("PYBERTH_CONFIG", cfg.to_str().expect("utf-8")),
    ];
    let s = HttpServer::start_with("metrics", &env, None).await;

    // The MCP port's /metrics wants a token (any principal's); the side door does not.
    let http = crate::common::web();
    let none = http.get(s.url("/metrics")).send().await.expect("get");
    assert_eq!(none.status().as_u16(), 401, "/metrics without a token");
    let bob = http.get(s.url("/metrics")).bearer_auth(BOB).send().await.expect("get");
    assert_eq!(bob.status().as_u16(), 200);
    assert!(bob.text().await.expect("body").contains("# TYPE pyberth_pool_containers gauge"));

    let prom = Prometheus::start(&tag, s.port, side).await;
    let alice = s.client(ALICE).await;

    // The core suite: runs (ok, error), an install, files, a job, a refused egress, a snapshot.
    let (r, _) = call(&alice, "run_python", json!({ "session": SECRET_SESSION, "code": "x = 6 * 7\nprint(x)" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, _) = call(&alice, "run_python", json!({ "session": SECRET_SESSION, "code": "1 / 0" })).await;
    assert!(text(&r).contains("ZeroDivisionError"), "{}", text(&r));
    let (r, _) = call(&alice, "install_packages", json!({ "session": SECRET_SESSION, "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, _) =
        call(&alice, "write_file", json!({ "session": SECRET_SESSION, "path": "notes.txt", "content": "hi" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, _) = call(&alice, "read_file", json!({ "session": SECRET_SESSION, "path": "notes.txt" })).await;
    assert!(text(&r).contains("hi"), "{}", text(&r));
    let (_, sc) = call(
        &alice,
        "run_python",
        json!({ "session": SECRET_SESSION, "code": "import time\ntime.sleep(1)\nprint('job done')", "background": true }),
    )
    .await;
    let job = sc["job"].as_str().expect("a job handle").to_owned();
    let (r, _) = call(&alice, "job_status", json!({ "job": job, "wait_s": 30 })).await;
    assert!(text(&r).contains("job done"), "{}", text(&r));
    let refused = format!(
        "import urllib.request\ntry:\n    urllib.request.urlopen('http://{REFUSED_HOST}/', timeout=20)\n\
         except Exception as e:\n    print('refused', e)"
    );
    let (r, _) = call(&alice, "run_python", json!({ "session": "net", "environment": "net", "code": refused })).await;
    assert!(text(&r).contains("refused"), "{}", text(&r));
    let (r, _) = call(&alice, "snapshot_session", json!({ "session": SECRET_SESSION, "name": "snap" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));

    // Both doors are scraped.
    prom.until("up{job=\"main\"}", |v| v == 1.0).await;
    prom.until("up{job=\"side\"}", |v| v == 1.0).await;
    // Runs by status, with alice's principal (turned on), and their durations.
    prom.until("pyberth_runs_total{job=\"side\",status=\"ok\",principal=\"alice\",environment=\"default\"}", |v| {
        v >= 2.0
    })
    .await;
    prom.until("pyberth_runs_total{job=\"main\",status=\"error\"}", |v| v >= 1.0).await;
    prom.until("sum(pyberth_run_duration_seconds_count{job=\"side\"})", |v| v >= 4.0).await;
    // Sessions by state and environment; new ones by source with their start times.
    prom.until("pyberth_sessions{job=\"side\",state=\"running\",environment=\"default\"}", |v| v >= 1.0).await;
    prom.until("pyberth_sessions{job=\"side\",state=\"running\",environment=\"net\"}", |v| v >= 1.0).await;
    prom.until("sum(pyberth_sessions_created_total{job=\"side\",source=~\"pool|cold\"})", |v| v >= 2.0).await;
    prom.until("sum(pyberth_session_start_seconds_count{job=\"side\"})", |v| v >= 2.0).await;
    // The pool: its size, and the hit ratio of the one ask of the default environment.
    prom.until("pyberth_pool_containers{job=\"side\"}", |v| v >= 0.0).await;
    prom.until("pyberth_pool_target{job=\"side\"}", |v| v >= 1.0).await;
    prom.until("sum(pyberth_pool_takes_total{job=\"side\"})", |v| v >= 1.0).await;
    prom.until("pyberth_pool_hit_ratio{job=\"side\"}", |v| (0.0..=1.0).contains(&v)).await;
    // Installs and their durations.
    prom.until("sum(pyberth_installs_total{job=\"side\",result=~\"hit|miss\"})", |v| v >= 1.0).await;
    prom.until("sum(pyberth_install_duration_seconds_count{job=\"side\"})", |v| v >= 1.0).await;
    // Egress: the refusal, and the bytes series.
    prom.until("pyberth_egress_connections_total{job=\"side\",verdict=\"refused\"}", |v| v >= 1.0).await;
    prom.until("pyberth_egress_bytes_total{job=\"side\",direction=\"out\"}", |v| v >= 0.0).await;
    // Snapshots: kept now, their bytes, taken.
    prom.until("pyberth_snapshots{job=\"side\"}", |v| v >= 1.0).await;
    prom.until("pyberth_snapshot_bytes{job=\"side\"}", |v| v > 0.0).await;
    prom.until("pyberth_snapshots_taken_total{job=\"side\",kind=\"save\"}", |v| v >= 1.0).await;
    prom.until("pyberth_snapshot_taken_bytes_total{job=\"side\"}", |v| v > 0.0).await;
    // HTTP: connections accepted, the token refusal above, connections open now.
    prom.until("pyberth_http_connections_total{job=\"side\",result=\"accepted\"}", |v| v >= 3.0).await;
    prom.until("pyberth_http_refusals_total{job=\"side\",reason=\"token\"}", |v| v >= 1.0).await;
    prom.until("pyberth_http_open_connections{job=\"side\"}", |v| v >= 1.0).await;

    // Bounded labels: no series names the session, the refused host, or carries a label
    // beyond the documented ones.
    let all = prom.query("{__name__=~\"pyberth_.+\",job=\"side\"}").await;
    assert!(all.len() > 20, "{all:?}");
    let allowed = ["__name__", "job", "instance", "state", "environment", "source", "principal", "status", "result"];
    let allowed =
        [&allowed[..], &["le", "direction", "verdict", "kind", "upstream", "outcome", "reason", "op"]].concat();
    for series in &all {
        let labels = series["metric"].as_object().expect("labels");
        for (k, v) in labels {
            assert!(allowed.contains(&k.as_str()), "unexpected label {k} in {series}");
            let v = v.as_str().unwrap_or_default();
            assert!(!v.contains(SECRET_SESSION) && !v.contains(REFUSED_HOST), "{series}");
        }
    }
    let raw = http.get(format!("http://{side_addr}/metrics")).send().await.expect("get").text().await.expect("body");
    assert!(!raw.contains(SECRET_SESSION) && !raw.contains(REFUSED_HOST) && !raw.contains("6 * 7"));

    drop(alice);
    drop(prom);
    s.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stdio_server_serves_metrics_on_its_metrics_addr() {
    let addr = format!("127.0.0.1:{}", free_port());
    let s = crate::common::Server::start("metrics-stdio", &[("PYBERTH_METRICS_ADDR", addr.as_str())]).await;
    s.ok("counted", "print(1)").await;
    let body = crate::common::scrape(&format!("http://{addr}/metrics"), None).await;
    let line = |l: &str| body.lines().any(|t| t == l);
    // Without --metrics-principal, no principal label.
    assert!(line(r#"pyberth_runs_total{status="ok",environment="default"} 1"#), "{body}");
    assert!(line(r#"pyberth_sessions{state="running",environment="default"} 1"#), "{body}");
    assert!(body.ends_with("# EOF\n") && !body.contains("counted"), "{body}");
    // Only /metrics is there: no MCP, no other path, on the tokenless listener.
    let other = crate::common::web().get(format!("http://{addr}/mcp")).send().await.expect("get");
    assert_eq!(other.status().as_u16(), 404);
    let instance = s.instance.clone();
    s.stop().await;
    crate::common::assert_cleaned_up(&instance).await;
}
