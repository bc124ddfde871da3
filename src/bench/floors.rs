//! The Docker floors every figure is read against: containers, execs and an attached stream,
//! measured through the engine's API alone; and both runtimes side by side.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::bail;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{CreateContainerOptionsBuilder, RemoveContainerOptionsBuilder};
use futures::StreamExt;
use pyberth::docker::Engine;
use tokio::io::AsyncWriteExt;

use pyberth::config::SandboxConfig;
use pyberth::docker::LABEL_MANAGED;

use super::Plan;
use super::drive::{Server, containers_memory, fresh_samples, mib, raw_warm};
use super::table::{Table, percentiles};

pub(super) fn bench_labels() -> HashMap<String, String> {
    HashMap::from([(LABEL_MANAGED.to_owned(), "1".to_owned()), ("pyberth.bench".to_owned(), "floor".to_owned())])
}

pub(super) async fn floor_container(docker: &dyn Engine, img: &str, runtime: Option<&str>) -> anyhow::Result<String> {
    let host_config = HostConfig {
        network_mode: Some("none".into()),
        init: Some(true),
        runtime: runtime.map(str::to_owned),
        ..Default::default()
    };
    let body = ContainerCreateBody {
        image: Some(img.into()),
        cmd: Some(vec!["sleep".into(), "infinity".into()]),
        labels: Some(bench_labels()),
        host_config: Some(host_config),
        ..Default::default()
    };
    static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let serial = SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = format!("pyberth-bench-{}-{serial}", std::process::id());
    let c = docker.create_container(Some(CreateContainerOptionsBuilder::default().name(&name).build()), body).await?;
    docker.start_container(&c.id, None).await?;
    Ok(c.id)
}

pub(super) async fn remove(docker: &dyn Engine, id: &str) {
    let opts = RemoveContainerOptionsBuilder::default().force(true).build();
    let _ = docker.remove_container(id, Some(opts)).await;
}

/// The engine's floors the rows read against, p50 ms.
#[derive(Debug, Clone, Copy)]
pub(super) struct Floors {
    /// A container created and started.
    pub(super) create: f64,
    /// And a first Python interpreter run in it to its end: what any new container's first
    /// result costs at least (a new container's first processes start slower than later ones).
    pub(super) first_python: f64,
    /// A round trip on an attached exec stream.
    pub(super) stream: f64,
}

/// Measures the engine floors.
pub(super) async fn floors(
    docker: &dyn Engine,
    img: &str,
    container: &str,
    plan: &Plan,
    table: &mut Table,
) -> anyhow::Result<Floors> {
    let runtime = docker.inspect_container(container, None).await?.host_config.and_then(|h| h.runtime);
    let mut create = Vec::new();
    let mut create_rm = Vec::new();
    for _ in 0..plan.containers {
        let t = Instant::now();
        let id = floor_container(docker, img, runtime.as_deref()).await?;
        create.push(t.elapsed());
        remove(docker, &id).await;
        create_rm.push(t.elapsed());
    }
    let (create_p50, _) = table.add("floor: container create + start", &mut create, "raw Docker API".into());
    table.add("floor: container create + start + remove", &mut create_rm, "raw Docker API".into());
    let mut first_python = Vec::new();
    for _ in 0..plan.containers {
        let t = Instant::now();
        let id = floor_container(docker, img, runtime.as_deref()).await?;
        let ran = exec_to_end(docker, &id, vec!["python3", "-c", "print(1)"]).await;
        first_python.push(t.elapsed());
        remove(docker, &id).await;
        ran?;
    }
    let what = "floor: container create + start + a first python3 -c 'print(1)'";
    let (first_python_p50, _) = table.add(what, &mut first_python, "a new container's first result".into());

    let mut execs = Vec::new();
    for _ in 0..plan.execs {
        let t = Instant::now();
        exec_to_end(docker, container, vec!["true"]).await?;
        execs.push(t.elapsed());
    }
    table.add("floor: a new exec running `true`", &mut execs, "one exec per run costs at least this".into());

    let mut py = Vec::new();
    for _ in 0..plan.execs.div_ceil(2) {
        let t = Instant::now();
        exec_to_end(docker, container, vec!["python3", "-c", "print(1)"]).await?;
        py.push(t.elapsed());
    }
    table.add("floor: a new exec running python3 -c 'print(1)'", &mut py, String::new());

    let mut rt = round_trips(docker, container, plan.runs).await?;
    let (stream_p50, _) =
        table.add("floor: round trip on an attached exec stream", &mut rt, "the floor for a warm run".into());
    Ok(Floors { create: create_p50, first_python: first_python_p50, stream: stream_p50 })
}

/// Round trips over an already-attached stream: write a line, read it echoed (after 20 to warm up).
pub(super) async fn round_trips(docker: &dyn Engine, container: &str, runs: usize) -> anyhow::Result<Vec<Duration>> {
    let echo = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()";
    let opts = CreateExecOptions {
        cmd: Some(vec!["python3", "-u", "-c", echo]),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        ..Default::default()
    };
    let ex = docker.create_exec(container, opts.into()).await?;
    let StartExecResults::Attached { mut output, mut input } = docker.start_exec(&ex.id, None).await? else {
        bail!("exec not attached");
    };
    let mut rt = Vec::with_capacity(runs);
    for i in 0..runs + 20 {
        let t = Instant::now();
        input.write_all(b"print(1)\n").await?;
        input.flush().await?;
        let mut got = 0;
        while got < 9 {
            match output.next().await {
                Some(Ok(LogOutput::StdOut { message })) => got += message.len(),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => bail!("echo exec ended"),
            }
        }
        if i >= 20 {
            rt.push(t.elapsed()); // the first rounds warm the path up
        }
    }
    Ok(rt)
}

pub(super) async fn exec_to_end(docker: &dyn Engine, container: &str, cmd: Vec<&str>) -> anyhow::Result<()> {
    let opts = CreateExecOptions {
        cmd: Some(cmd),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        ..Default::default()
    };
    let ex = docker.create_exec(container, opts.into()).await?;
    if let StartExecResults::Attached { mut output, .. } = docker.start_exec(&ex.id, None).await? {
        while let Some(frame) = output.next().await {
            frame?;
        }
    }
    Ok(())
}

/// The figures a runtime changes, under the engine's default runtime and under gVisor: a
/// container's start, the attached stream, a warm run, a new session without the pool, and an
/// idle session container's memory. Bounded: 8 containers, `runs` round trips and warm runs, and
/// 8 sessions per runtime.
pub(super) async fn side_by_side(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    img: &str,
    instance: &str,
    runs: usize,
    runtimes: [&str; 2],
    table: &mut Table,
) -> anyhow::Result<()> {
    let mut rows: Vec<(String, [String; 2], Option<f64>)> = Vec::new();
    let mut put = |row: usize, what: String, col: usize, figure: String, value: f64| {
        if rows.len() <= row {
            rows.push((what, [String::new(), String::new()], None));
        }
        rows[row].1[col] = figure;
        // The ratio gVisor / default, once both are in.
        rows[row].2 = if col == 0 { Some(value) } else { rows[row].2.map(|d| value / d) };
    };
    for (col, runtime) in runtimes.iter().enumerate() {
        let ms = |p50: f64| format!("{p50:.2}");
        let mut create = Vec::new();
        for _ in 0..8 {
            let t = Instant::now();
            let id = floor_container(docker, img, Some(runtime)).await?;
            create.push(t.elapsed());
            remove(docker, &id).await;
        }
        let (p50, _) = percentiles(&mut create);
        put(0, "floor: container create + start, p50 ms".into(), col, ms(p50), p50);
        let container = floor_container(docker, img, Some(runtime)).await?;
        let trips = round_trips(docker, &container, runs).await;
        remove(docker, &container).await;
        let (p50, _) = percentiles(&mut trips?);
        put(1, "floor: round trip on an attached exec stream, p50 ms".into(), col, ms(p50), p50);
        let under = [("PYBERTH_RUNTIME", (*runtime).to_owned())];
        let mut raw = raw_warm(cfg, &format!("{instance}-rt{col}-raw"), runs, &under).await?;
        let (p50, _) = percentiles(&mut raw);
        put(2, format!("warm run_python, raw JSON-RPC ({runs} calls), p50 ms"), col, ms(p50), p50);
        let name = format!("{instance}-rt{col}");
        let env = [("PYBERTH_POOL_SIZE", "0".to_owned()), under[0].clone()];
        let server = Server::start(cfg, &name, &env).await?;
        server.run("first", "1", &[]).await?;
        let mut fresh = fresh_samples(&server, "fresh", 0, 8).await?;
        let (p50, _) = percentiles(&mut fresh);
        put(3, "first call in a new session (pool 0), p50 ms".into(), col, ms(p50), p50);
        let (count, bytes) = containers_memory(docker, &name).await?;
        let kb = (count > 0).then(|| bytes / 1024 / count as u64);
        put(4, format!("memory of an idle session container ({count})"), col, mib(kb), kb.unwrap_or(0) as f64);
        server.stop().await;
    }
    let mut out = format!(
        "\nruntimes side by side\n{:<58} {:>12} {:>12} {:>8}\n",
        "measurement", runtimes[0], runtimes[1], "ratio"
    );
    for (what, [a, b], ratio) in rows {
        let ratio = ratio.filter(|r| r.is_finite()).map(|r| format!("{r:.1}x")).unwrap_or_default();
        out.push_str(&format!("{what:<58} {a:>12} {b:>12} {ratio:>8}\n"));
    }
    table.raw(&out);
    Ok(())
}
