//! `pyberth bench --burst N`: N new sessions asked for at once (N concurrent `run_python`
//! calls on distinct session names through one server), p50, p95 and p99 of the time from
//! the burst to each session's first result. First from cold (the pool at its floor), then,
//! after that burst taught the pool (docs/design.md D1), again; with what the pool held.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use bollard::query_parameters::ListContainersOptionsBuilder;
use pyberth::config::SandboxConfig;
use pyberth::docker::{Engine, LABEL_INSTANCE};
use serde_json::json;

use super::drive::{Server, containers_memory};
use super::table::Table;

/// Most sessions one burst asks for: each is a container, and all run at once.
pub(super) const MOST: i64 = 200;
/// How long the pool may take to settle between the bursts.
const SETTLE: Duration = Duration::from_secs(180);

/// The burst rows through a server of their own.
pub(super) async fn burst(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    instance: &str,
    n: usize,
    table: &mut Table,
) -> anyhow::Result<()> {
    if n == 0 || i64::try_from(n).map_or(true, |n| n > MOST) {
        bail!("--burst takes 1 to {MOST} sessions, not {n}");
    }
    let room = n + 8;
    let env = [
        ("PYBERTH_POOL_SIZE", cfg.pool_size.to_string()),
        ("PYBERTH_POOL_MAX", cfg.pool_max.to_string()),
        ("PYBERTH_POOL_MEMORY_MB", cfg.pool_memory_mb.to_string()),
        ("PYBERTH_MAX_SESSIONS", room.to_string()),
        ("PYBERTH_MAX_SESSIONS_TOTAL", room.max(cfg.max_sessions_total).to_string()),
        ("PYBERTH_MAX_RUNS_PER_CALLER", n.to_string()),
    ];
    let server = Server::start(cfg, instance, &env).await?;
    let r = bursts(docker, cfg, instance, n, &server, table).await;
    server.stop().await;
    r
}

async fn bursts(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    instance: &str,
    n: usize,
    server: &Server,
    table: &mut Table,
) -> anyhow::Result<()> {
    let floor = settle(docker, instance, cfg.pool_size).await?;
    table.step(&format!("{n} new sessions at once, from cold"));
    let mut cold = one_burst(server, "cold", n).await?;
    percentile_row(table, &format!("{n} new sessions at once, cold (pool {floor})"), &mut cold);
    close_all(server, "cold", n).await?;
    table.step("the pool learns from that burst");
    let learnt = if cfg.pool_size == 0 { 0 } else { cfg.pool_size.max(n.min(cfg.pool_max)) };
    let held = settle(docker, instance, learnt).await?;
    let (_, bytes) = containers_memory(docker, instance).await?;
    let mib = bytes as f64 / (1024.0 * 1024.0);
    table.text(
        "warm pool after a burst (containers, memory)",
        format!("{held}, {mib:.0} MiB"),
        format!(
            "floor --pool-size {}, --pool-max {}, --pool-memory-mb {}",
            cfg.pool_size, cfg.pool_max, cfg.pool_memory_mb
        ),
    );
    table.step(&format!("{n} new sessions at once, warm"));
    let mut warm = one_burst(server, "warm", n).await?;
    percentile_row(table, &format!("{n} new sessions at once, warm (pool {held})"), &mut warm);
    close_all(server, "warm", n).await
}

/// `n` first calls in new sessions, all asked for at once: each one's time from the start.
async fn one_burst(server: &Server, prefix: &str, n: usize) -> anyhow::Result<Vec<Duration>> {
    let t0 = Instant::now();
    let calls = (0..n).map(|i| async move {
        server.run(&format!("{prefix}{i}"), "1", &[]).await?;
        anyhow::Ok(t0.elapsed())
    });
    futures::future::join_all(calls).await.into_iter().collect()
}

async fn close_all(server: &Server, prefix: &str, n: usize) -> anyhow::Result<()> {
    let closes = (0..n).map(|i| server.tool("close_session", json!({ "session": format!("{prefix}{i}") })));
    for r in futures::future::join_all(closes).await {
        r?;
    }
    Ok(())
}

/// Waits (bounded) until the instance's containers are `want` and stay so for a few seconds,
/// or stop changing; returns how many there are.
async fn settle(docker: &dyn Engine, instance: &str, want: usize) -> anyhow::Result<usize> {
    let deadline = Instant::now() + SETTLE;
    let (mut last, mut same_since) = (usize::MAX, Instant::now());
    loop {
        let count = containers(docker, instance).await?;
        if count != last {
            (last, same_since) = (count, Instant::now());
        }
        let steady = same_since.elapsed() >= Duration::from_secs(if count == want { 2 } else { 20 });
        if steady || Instant::now() >= deadline {
            return Ok(count);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How many containers the instance has.
async fn containers(docker: &dyn Engine, instance: &str) -> anyhow::Result<usize> {
    let label = format!("{LABEL_INSTANCE}={instance}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().filters(&filters).build();
    Ok(docker.list_containers(Some(opts)).await?.len())
}

/// A row with p50, p95 and p99 of the samples, in milliseconds.
fn percentile_row(table: &mut Table, what: &str, samples: &mut [Duration]) {
    samples.sort();
    let at = |q: f64| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= q <= 1: an index in range
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(i).map_or(f64::NAN, |d| d.as_secs_f64() * 1e3)
    };
    let (p50, p95, p99) = (at(0.50), at(0.95), at(0.99));
    table.text(what, format!("{p50:.0} / {p95:.0} / {p99:.0}"), "p50 / p95 / p99 ms to first result".into());
}
