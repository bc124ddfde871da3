//! pyberth's own figures through one server: dependency layers, cached sets, concurrency and
//! idle memory, output volume.

use std::time::{Duration, Instant};

use futures::StreamExt;
use pyberth::docker::Engine;
use rmcp::model::CallToolRequestParams;
use serde_json::json;

use pyberth::config::SandboxConfig;

use super::Plan;
use super::drive::{Server, containers_memory, containers_of, mib};
use super::table::Table;

/// A cold install, then the same set from the cache.
pub(super) async fn layers_rows(server: &Server, table: &mut Table) -> anyhow::Result<()> {
    let t = Instant::now();
    server.run("deps-cold", "import tomli", &["tomli"]).await?;
    let mut cold = [t.elapsed()];
    table.add(
        "new session with packages=[tomli], first install",
        &mut cold,
        "installer container + store write".into(),
    );
    let mut hits = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        server.run(&format!("deps-hit{i}"), "import tomli", &["tomli"]).await?;
        hits.push(t.elapsed());
    }
    table.add("new session with packages=[tomli], cached layer", &mut hits, String::new());
    Ok(())
}

/// A cached set attached (docs/design.md D6), each beside its floor from the same server: a new
/// session asking for it beside a new session asking for nothing (both from the pool when
/// there is one), and a running session adding it beside a warm run in that session.
pub(super) async fn cached_set_rows(server: &Server, pool: usize, table: &mut Table) -> anyhow::Result<()> {
    let close = |name: String| async move {
        let args = json!({ "session": name });
        let params =
            CallToolRequestParams::new("close_session").with_arguments(args.as_object().cloned().unwrap_or_default());
        let _ = server.client.call_tool(params).await;
    };
    server.run("set-warmup", "import tomli", &["tomli"]).await?;
    close("set-warmup".into()).await;
    let (mut floor, mut fresh, mut live_floor, mut live) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..8 {
        for (name, packages) in [(format!("set-floor{i}"), &[][..]), (format!("set-new{i}"), &["tomli"][..])] {
            if pool > 0 {
                tokio::time::sleep(Duration::from_millis(1500)).await; // the pool has refilled
            }
            let t = Instant::now();
            server.run(&name, "import sys", packages).await?;
            if packages.is_empty() {
                floor.push(t.elapsed())
            } else {
                fresh.push(t.elapsed())
            }
            close(name).await;
        }
        let name = format!("set-live{i}");
        server.run(&name, "x = 1", &[]).await?;
        let t = Instant::now();
        server.run(&name, "x", &[]).await?;
        live_floor.push(t.elapsed());
        let t = Instant::now();
        server.run(&name, "import tomli\nx", &["tomli"]).await?;
        live.push(t.elapsed());
        close(name).await;
    }
    let (floor_p50, _) = table.add(&format!("new session, no packages (pool {pool})"), &mut floor, "floor".into());
    let (p50, _) = table.add("new session asking for a cached set", &mut fresh, String::new());
    table.note(format!("target <= 50 ms; floor + {:.1} ms", p50 - floor_p50));
    let (floor_p50, _) = table.add("warm run in a running session", &mut live_floor, "floor".into());
    let (p50, _) = table.add("running session adding a cached set", &mut live, String::new());
    table.note(format!("target <= 100 ms; floor + {:.1} ms", p50 - floor_p50));
    Ok(())
}

/// Many sessions at once, each making its calls one after another; then the memory per idle
/// session they leave.
pub(super) async fn concurrency_and_memory(
    docker: &dyn Engine,
    server: &Server,
    instance: &str,
    plan: &Plan,
    local: bool,
    table: &mut Table,
) -> anyhow::Result<()> {
    let (rss_before, _) = server.memory_kb();
    let mut made = 0;
    for &n in &plan.concurrency {
        let names: Vec<String> = (0..n).map(|i| format!("c{n}-{i}")).collect();
        // Sessions exist before the clock starts: this measures calls, not container creation.
        let created: Vec<anyhow::Result<String>> =
            futures::stream::iter(names.iter()).map(|s| server.run(s, "0", &[])).buffer_unordered(8).collect().await;
        created.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
        made += n;
        // The pool makes up for the sessions it gave: that is container creation, not calls.
        settle(docker, instance).await;
        let calls = plan.calls_per_session.max(1);
        // Where the CPU goes (two cores bound this row), read outside the timed window.
        let ids = if local { containers_of(docker, instance).await? } else { Vec::new() };
        let watched = if local { Some(super::cpu::Watched::find(docker, server.pid(), &ids).await) } else { None };
        let cpu_before = watched.as_ref().map(super::cpu::Watched::sample);
        let t = Instant::now();
        let per_session = futures::future::join_all(names.iter().map(|s| {
            let server = &server;
            async move {
                let mut lat = Vec::with_capacity(calls);
                for k in 0..calls {
                    let t = Instant::now();
                    server.run(s, &format!("{k} * 2"), &[]).await?;
                    lat.push(t.elapsed());
                }
                anyhow::Ok(lat)
            }
        }))
        .await;
        let elapsed = t.elapsed();
        let mut lat: Vec<Duration> = Vec::new();
        for l in per_session {
            lat.extend(l?);
        }
        let total = lat.len();
        table.add(&format!("{n} sessions x {calls} calls at once"), &mut lat, String::new());
        table.note(format!("{:.0} calls/s", total as f64 / elapsed.as_secs_f64()));
        if let (Some(w), Some(before)) = (&watched, cpu_before) {
            w.sample().rows_since(&before, total, elapsed, table);
        }
    }

    // Memory per idle session: the server's growth over the sessions just made, plus what
    // each of its containers holds (pool containers included: they are idle sessions too).
    let (rss_after, _) = server.memory_kb();
    if made > 0 {
        let server_kb = match (rss_before, rss_after) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) / made as u64),
            _ => None,
        };
        let (count, bytes) = containers_memory(docker, instance).await?;
        let container_kb = (count > 0).then(|| bytes / 1024 / count as u64);
        let total = server_kb.zip(container_kb).map(|(a, b)| a + b);
        table.text(
            &format!("memory per idle session ({count} containers)"),
            mib(total),
            format!("server {} + container {}", mib(server_kb), mib(container_kb)),
        );
        // Where a container's share goes, part by part (a few containers suffice: idle
        // sessions are alike).
        let ids = containers_of(docker, instance).await?;
        super::parts::memory_parts(docker, &ids, local, 8, table).await;
    }
    Ok(())
}

/// Waits (up to 30 s) until the server's containers have stopped coming and going for 2 s:
/// its pool is full again.
async fn settle(docker: &dyn Engine, instance: &str) {
    let mut last = None;
    let mut same = 0;
    for _ in 0..60 {
        let now = containers_of(docker, instance).await.ok().map(|c| c.len());
        same = if now.is_some() && now == last { same + 1 } else { 0 };
        if same >= 4 {
            return;
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Output volume: the cap raised to its 4 MiB ceiling, then more than that printed.
pub(super) async fn output_volume(
    cfg: &SandboxConfig,
    instance: &str,
    plan: &Plan,
    table: &mut Table,
) -> anyhow::Result<()> {
    let cap = 4usize << 20;
    let loud = Server::start(
        cfg,
        &format!("{instance}-out"),
        &[("PYBERTH_POOL_SIZE", "0".into()), ("PYBERTH_OUTPUT_CAP", cap.to_string())],
    )
    .await?;
    loud.run("out", "1", &[]).await?;
    let (idle_rss, _) = loud.memory_kb();
    for &m in &plan.stdout_mib {
        loud.reset_peak();
        let code =
            format!("import sys\nline = 'x' * 1023 + '\\n'\nfor _ in range({}):\n    sys.stdout.write(line)", m * 1024);
        let t = Instant::now();
        let text = loud.run("out", &code, &[]).await?;
        let mut took = [t.elapsed()];
        let (_, peak) = loud.memory_kb();
        table.add(&format!("{m} MiB of stdout in one run (cap 4 MiB)"), &mut took, String::new());
        table.note(format!(
            "{:.0} MiB/s, server peak {} (idle {}), result {:.1} MiB",
            m as f64 / took[0].as_secs_f64(),
            mib(peak),
            mib(idle_rss),
            text.len() as f64 / (1 << 20) as f64
        ));
    }
    loud.stop().await;
    Ok(())
}
