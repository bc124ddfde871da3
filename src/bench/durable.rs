//! Durable sessions (issue 18): snapshot, restore, fork, hibernate and wake, and the reattach
//! after a server restart, each beside its floor.

use std::time::{Duration, Instant};

use anyhow::bail;
use futures::StreamExt;
use pyberth::docker::Engine;
use serde_json::json;

use pyberth::config::SandboxConfig;

use super::drive::Server;
use super::floors::{floor_container, remove};
use super::table::Table;

/// Durable sessions (issue 18): a snapshot and a restore of a session holding 200 MiB of
/// variables and 100 MiB of workspace files, beside the floor of a plain `docker cp` of the
/// same files out of and into a container; a fork of a small session; hibernate and wake.
/// numpy is not in the sandbox image (built offline from Debian packages), so the variables
/// are 200 bytes objects of 1 MiB each: pickle copies both the same way (one buffer each).
pub(super) async fn durable(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    img: &str,
    instance: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let env = [
        ("PYBERTH_POOL_SIZE", "2".to_owned()),
        ("PYBERTH_MEMORY_MB", "3072".to_owned()),
        ("PYBERTH_SNAPSHOT_CACHE_MB", "4096".to_owned()),
        ("PYBERTH_HIBERNATE_AFTER_S", "1".to_owned()),
    ];
    let server = Server::start(cfg, &format!("{instance}-durable"), &env).await?;
    let big = "import os\nblobs = [os.urandom(1 << 20) for _ in range(200)]\nos.makedirs('files', exist_ok=True)\n\
               for i in range(100):\n    open('files/f%03d' % i, 'wb').write(os.urandom(1 << 20))";
    // Runs keep the session awake meanwhile: hibernation waits for 1 s of idleness.
    server.run("big", big, &[]).await?;
    let measured = async {
        snapshot_rows(&server, cfg, instance, big, table).await?;
        copy_floors(docker, cfg, img, table).await?;
        server.tool("close_session", json!({"session": "big"})).await?;
        fork_and_wake(&server, table).await
    }
    .await;
    server.stop().await;
    measured
}

/// Three rounds of snapshot and restore of the big session, and one snapshot of the same
/// through the agent's stream.
async fn snapshot_rows(
    server: &Server,
    cfg: &SandboxConfig,
    instance: &str,
    big: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let mut snaps = Vec::new();
    let mut restores = Vec::new();
    let (mut copies, mut globals) = (Vec::new(), Vec::new());
    let (mut saves, mut packs) = (Vec::new(), Vec::new());
    let mut state_mib = 0.0;
    for i in 0..3 {
        let t = Instant::now();
        let (_, sc) = server.tool("snapshot_session", json!({"session": "big", "name": format!("big{i}")})).await?;
        snaps.push(t.elapsed());
        saves.push(Duration::from_millis(sc["state_ms"].as_u64().unwrap_or(0)));
        packs.push(Duration::from_millis(sc["copy_ms"].as_u64().unwrap_or(0)));
        state_mib = sc["state_bytes"].as_f64().unwrap_or(0.0) / f64::from(1u32 << 20);
        let t = Instant::now();
        let (_, rc) = server
            .tool("restore_session", json!({"snapshot": format!("big{i}"), "session": format!("copy{i}")}))
            .await?;
        restores.push(t.elapsed());
        copies.push(Duration::from_millis(rc["copy_ms"].as_u64().unwrap_or(0)));
        globals.push(Duration::from_millis(rc["globals_ms"].as_u64().unwrap_or(0)));
        server.tool("close_session", json!({"session": format!("copy{i}")})).await?;
        server.tool("delete_snapshot", json!({"snapshot": format!("big{i}")})).await?;
        server.run("big", "len(blobs)", &[]).await?;
    }
    // The way the state went before the packer, still taken when it does not fit in the
    // workspace: through the agent's stream, re-packed by the server (one round; a restore
    // would not fit either).
    let streamed_env = [
        ("PYBERTH_POOL_SIZE", "1".to_owned()),
        ("PYBERTH_MEMORY_MB", "3072".to_owned()),
        ("PYBERTH_WORKSPACE_MB", "256".to_owned()),
        ("PYBERTH_SNAPSHOT_CACHE_MB", "4096".to_owned()),
        ("PYBERTH_HIBERNATE_AFTER_S", "0".to_owned()),
    ];
    let streamed = Server::start(cfg, &format!("{instance}-streamed"), &streamed_env).await?;
    streamed.run("big", big, &[]).await?;
    let t = Instant::now();
    streamed.tool("snapshot_session", json!({"session": "big", "name": "s"})).await?;
    let mut stream_snaps = vec![t.elapsed()];
    // Not restored: the state does not fit in such a workspace either way.
    streamed.stop().await;
    let total_mib = state_mib + 100.0;
    let (snap_p50, _) =
        table.add("snapshot_session: 200 MiB of variables + 100 MiB of files", &mut snaps, String::new());
    table.note(format!(
        "{:.0} MiB/s ({state_mib:.0} MiB of state; bytes objects, numpy is not in the image); target 1000 ms",
        total_mib / (snap_p50 / 1e3)
    ));
    table.add("  of which the interpreter pickling its state into the workspace", &mut saves, String::new());
    let (pack_p50, _) =
        table.add("  of which the packer copying state and files into the volume", &mut packs, String::new());
    table.note(format!("{:.0} MiB/s, with the packer's container", total_mib / (pack_p50 / 1e3)));
    table.add("restore_session of it, whole call", &mut restores, "new session from the warm pool".into());
    let (copy_p50, _) = table.add("  of which copying state and files into the workspace", &mut copies, String::new());
    table.note(format!("{:.0} MiB/s", total_mib / (copy_p50 / 1e3)));
    table.add("  of which loading the globals", &mut globals, "target 300 ms".into());
    table.add(
        "snapshot_session, the same, state through the agent's stream",
        &mut stream_snaps,
        "a workspace too small for the pickles (--workspace-mb 256); 1 round".into(),
    );

    Ok(())
}

/// The floor: the engine's archive API moving the same files into a container and out.
async fn copy_floors(docker: &dyn Engine, cfg: &SandboxConfig, img: &str, table: &mut Table) -> anyhow::Result<()> {
    // The floor: the engine's archive API moving the same amount of files (100 of 1 MiB) into
    // a container and out of it again, as `docker cp` does both ways.
    let mut files = tar::Builder::new(Vec::new());
    for i in 0..100u32 {
        let data: Vec<u8> =
            (0..1u32 << 20).map(|b| (b.wrapping_mul(2_654_435_761).wrapping_add(i) >> 13).to_le_bytes()[0]).collect();
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        files.append_data(&mut h, format!("files/f{i:03}"), &data[..])?;
    }
    let files = bytes::Bytes::from(files.into_inner()?);
    let floor = floor_container(docker, img, cfg.runtime.as_deref()).await?;
    let (mut outs, mut ins) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        let opts = bollard::query_parameters::UploadToContainerOptionsBuilder::default().path("/tmp").build();
        docker.upload_to_container(&floor, Some(opts), pyberth::docker::body_full(files.clone())).await?;
        ins.push(t.elapsed());
        let t = Instant::now();
        let opts = bollard::query_parameters::DownloadFromContainerOptionsBuilder::default().path("/tmp/files").build();
        let mut got = 0usize;
        let mut stream = docker.download_from_container(&floor, Some(opts));
        while let Some(chunk) = stream.next().await {
            got += chunk?.len();
        }
        outs.push(t.elapsed());
        if got < 100 << 20 {
            bail!("the floor's download held {got} bytes");
        }
    }
    remove(docker, &floor).await;
    // The fixed cost of the packer: a container of the image made, run and removed.
    let mut runs = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let c = floor_container(docker, img, cfg.runtime.as_deref()).await?;
        remove(docker, &c).await;
        runs.push(t.elapsed());
    }
    table.add("floor: a container made, started and removed", &mut runs, "what a packer costs before it copies".into());
    let (in_p50, _) = table.add("floor: docker cp of 100 MiB of files into a container", &mut ins, String::new());
    table.note(format!("{:.0} MiB/s", 100.0 / (in_p50 / 1e3)));
    let (out_p50, _) = table.add("floor: docker cp of them out of it", &mut outs, String::new());
    table.note(format!("{:.0} MiB/s", 100.0 / (out_p50 / 1e3)));
    Ok(())
}

/// A small session: fork, then hibernate and wake.
async fn fork_and_wake(server: &Server, table: &mut Table) -> anyhow::Result<()> {
    // A small session: fork, then hibernate and wake.
    server
        .run("small", "import json\nclass P:\n    pass\np = P()\nd = {'a': 1}\nopen('x.txt', 'w').write('x')", &[])
        .await?;
    let mut forks = Vec::new();
    let mut fork_snap = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        let (_, fc) =
            server.tool("fork_session", json!({"session": "small", "new_session": format!("fork{i}")})).await?;
        forks.push(t.elapsed());
        fork_snap.push(Duration::from_millis(fc["snapshot_ms"].as_u64().unwrap_or(0)));
        server.tool("close_session", json!({"session": format!("fork{i}")})).await?;
        server.run("small", "1", &[]).await?;
    }
    table.add(
        "fork_session of a small session",
        &mut forks,
        "snapshot + restore into a pooled container; target 500 ms".into(),
    );
    table.add("  of which the snapshot", &mut fork_snap, String::new());
    let mut wakes = Vec::new();
    let mut server_wakes = Vec::new();
    for _ in 0..5 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (text, _) = server.tool("list_sessions", json!({})).await?;
            if text.contains("small: hibernated") {
                break;
            }
            if Instant::now() > deadline {
                bail!("the small session did not hibernate");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let t = Instant::now();
        let text = server.run("small", "d['a']", &[]).await?;
        wakes.push(t.elapsed());
        let woken = text.split("woken in ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok());
        server_wakes.push(Duration::from_millis(woken.unwrap_or(0)));
    }
    table.add("wake of a hibernated small session: first run_python", &mut wakes, "target 300 ms".into());
    table.add("  of which the wake (container from the pool, restore)", &mut server_wakes, String::new());
    Ok(())
}

/// Reattach of a running session after a server restart (issue 18): a server that leaves its
/// sessions stops, the next one of the same state dir and instance adopts them, and its first
/// call reaches the same interpreter through a new relay. The second call after the restart
/// is the floor: the same run with the relay in place, so the difference is the reattach.
/// Beside it the engine's own floor for it: one exec of `true`, created, started and attached
/// to its end (no relay, no interpreter), in a container of the same image.
pub(super) async fn durable_reattach(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    img: &str,
    instance: &str,
    table: &mut Table,
) -> anyhow::Result<()> {
    let state = std::env::temp_dir().join(format!("pyberth-bench-reattach-{}", std::process::id()));
    std::fs::create_dir_all(&state)?;
    let env = [
        ("PYBERTH_POOL_SIZE", "0".to_owned()),
        ("PYBERTH_KEEP_SESSIONS", "true".to_owned()),
        ("PYBERTH_STATE_DIR", state.display().to_string()),
    ];
    let name = format!("{instance}-reattach");
    let measured = async {
        let mut server = Server::start(cfg, &name, &env).await?;
        server.run("kept", "x = 42\nimport threading", &[]).await?;
        let (mut firsts, mut seconds, mut reattach) = (Vec::new(), Vec::new(), Vec::new());
        let mut later = Vec::new();
        for round in 0..8 {
            server.stop().await;
            server = Server::start(cfg, &name, &env).await?;
            // The last three: a client that calls a second after the restart, by which time
            // the server has attached in the background.
            if round >= 5 {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let t = Instant::now();
                server.run("kept", "x", &[]).await?;
                later.push(t.elapsed());
                continue;
            }
            let t = Instant::now();
            let text = server.run("kept", "x", &[]).await?;
            let first = t.elapsed();
            if !text.contains("42") {
                bail!("the session was not reattached: {text}");
            }
            let t = Instant::now();
            server.run("kept", "x", &[]).await?;
            let second = t.elapsed();
            firsts.push(first);
            seconds.push(second);
            reattach.push(first.saturating_sub(second));
        }
        table.add("first run_python after a server restart (reattach)", &mut firsts, String::new());
        table.add("  floor: the next run_python, relay in place", &mut seconds, String::new());
        table.add("  reattach itself (first minus next)", &mut reattach, "target 50 ms".into());
        table.add("first run_python 1 s after a server restart", &mut later, String::new());
        let mut execs = exec_floor(docker, cfg, img).await?;
        table.add("  floor: one docker exec (create, start, attach, end)", &mut execs, String::new());
        // The last server stops for good: no next one adopts.
        server.tool("close_session", json!({"session": "kept"})).await?;
        server.stop().await;
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&state);
    measured
}

/// Five execs of `true` in a fresh container of the sandbox image, each timed to its end.
async fn exec_floor(docker: &dyn Engine, cfg: &SandboxConfig, img: &str) -> anyhow::Result<Vec<Duration>> {
    let id = floor_container(docker, img, cfg.runtime.as_deref()).await?;
    let mut times = Vec::new();
    let timed = async {
        for _ in 0..5 {
            let t = Instant::now();
            super::floors::exec_to_end(docker, &id, vec!["true"]).await?;
            times.push(t.elapsed());
        }
        anyhow::Ok(())
    }
    .await;
    remove(docker, &id).await;
    timed.map(|()| times)
}
