//! `pyberth bench`: pyberth's figures beside the raw Docker floors measured in the same run,
//! so every figure also reads as a ratio. It drives the real binary over MCP stdio, as a
//! desktop agent does. It fails only when something breaks, never on a missed target.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{CreateContainerOptionsBuilder, RemoveContainerOptionsBuilder};
use futures::StreamExt;
use rmcp::ServiceExt as _;
use rmcp::model::CallToolRequestParams;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use crate::config::SandboxConfig;
use crate::docker::{self, LABEL_MANAGED, image};

/// p50 and p95 of a set of durations, in milliseconds.
fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(i).map(|d| d.as_secs_f64() * 1e3).unwrap_or(f64::NAN)
    };
    (at(0.50), at(0.95))
}

struct Table(Vec<(String, f64, f64, String)>);

impl Table {
    fn add(&mut self, what: &str, samples: &mut [Duration], note: String) -> (f64, f64) {
        let (p50, p95) = percentiles(samples);
        self.0.push((what.to_owned(), p50, p95, note));
        (p50, p95)
    }

    fn print(&self) {
        let mut out = String::new();
        out.push_str(&format!("{:<58} {:>10} {:>10}  {}\n", "measurement", "p50 ms", "p95 ms", "note"));
        for (what, p50, p95, note) in &self.0 {
            out.push_str(&format!("{what:<58} {p50:>10.3} {p95:>10.3}  {note}\n"));
        }
        #[allow(clippy::print_stdout)] // the table is the command's output
        {
            print!("{out}");
        }
    }
}

/// Runs the benchmark and prints its figures.
pub async fn run(cfg: SandboxConfig, runs: usize) -> anyhow::Result<()> {
    cfg.validate()?;
    let docker = docker::connect(cfg.docker_host.as_deref()).await.context("cannot reach the Docker engine")?;
    let progress = |line: &str| tracing::info!(target: "pyberth::image", "{line}");
    let img = image::ensure(&docker, &cfg, &progress).await?;
    let mut table = Table(Vec::new());
    let runs = runs.max(10);

    // Floors: the engine alone.
    let container = floor_container(&docker, &img).await?;
    let floors = floors(&docker, &img, &container, runs, &mut table).await;
    remove(&docker, &container).await;
    let (create_p50, exec_p50, stream_p50) = floors?;

    // pyberth over MCP stdio.
    let exe = std::env::current_exe().context("cannot find the pyberth binary")?;
    let instance = format!("bench-{}", std::process::id());
    let t0 = Instant::now();
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("serve")
        .env("PYBERTH_INSTANCE", &instance)
        .env("RUST_LOG", "warn")
        .env("PYBERTH_POOL_SIZE", cfg.pool_size.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    if let Some(h) = &cfg.docker_host {
        cmd.env("DOCKER_HOST", h);
    }
    let mut child = cmd.spawn().context("cannot start pyberth serve")?;
    let (Some(stdout), Some(stdin)) = (child.stdout.take(), child.stdin.take()) else {
        bail!("no pipes to the server");
    };
    let client = ().serve((stdout, stdin)).await.context("MCP initialise")?;
    let call_with = |session: String, code: &'static str, packages: &[&str]| {
        let args = json!({ "session": session, "code": code, "packages": packages });
        let params =
            CallToolRequestParams::new("run_python").with_arguments(args.as_object().cloned().unwrap_or_default());
        let client = &client;
        async move {
            let r = client.call_tool(params).await.context("run_python failed at the protocol level")?;
            if r.is_error != Some(false) {
                bail!("run_python returned an error: {:?}", r.content);
            }
            anyhow::Ok(())
        }
    };
    let call = |session: String, code: &'static str| call_with(session, code, &[]);
    call("bench".into(), "1").await?;
    let mut startup = [t0.elapsed()];
    table.add(
        "server start to first result (existing image)",
        &mut startup,
        "process spawn, MCP init, new session, run".into(),
    );

    let mut warm = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        call("bench".into(), "x = 1\nx + 1").await?;
        warm.push(t.elapsed());
    }
    let (warm_p50, _) =
        table.add(&format!("warm run_python through MCP stdio ({runs} calls)"), &mut warm, String::new());
    if let Some(row) = table.0.last_mut() {
        row.3 = format!("{:.1}x the attached-stream floor", warm_p50 / stream_p50);
    }

    let fresh_n = 8;
    let mut fresh = Vec::with_capacity(fresh_n);
    for i in 0..fresh_n {
        if cfg.pool_size > 0 {
            // New sessions arriving now and then, not in a burst: the pool has refilled.
            tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
        }
        let t = Instant::now();
        call(format!("fresh{i}"), "1").await?;
        fresh.push(t.elapsed());
    }
    let (fresh_p50, _) = table.add(
        &format!("first call in a new session ({fresh_n} sessions, pool {})", cfg.pool_size),
        &mut fresh,
        String::new(),
    );
    if let Some(row) = table.0.last_mut() {
        row.3 = format!("{:.1}x container create+start", fresh_p50 / create_p50);
    }
    let _ = exec_p50;

    // Dependency layers: a cold install, then the same set from the cache.
    forget_layers(&docker, "tomli").await;
    let t = Instant::now();
    call_with("deps-cold".into(), "import tomli", &["tomli"]).await?;
    let mut cold = [t.elapsed()];
    table.add(
        "new session with packages=[tomli], first install",
        &mut cold,
        "installer container + layer build".into(),
    );
    let mut hits = Vec::new();
    for i in 0..5 {
        let t = Instant::now();
        call_with(format!("deps-hit{i}"), "import tomli", &["tomli"]).await?;
        hits.push(t.elapsed());
    }
    let (hit_p50, _) = table.add("new session with packages=[tomli], cached layer", &mut hits, String::new());
    if let Some(row) = table.0.last_mut() {
        row.3 = format!("{:+.0} ms vs a plain new session", hit_p50 - fresh_p50);
    }

    let _ = client.cancel().await;
    let _ = tokio::time::timeout(Duration::from_secs(30), child.wait()).await;
    table.print();
    Ok(())
}

async fn forget_layers(docker: &Docker, requirements: &str) {
    let label = format!("pyberth.requirements={requirements}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = bollard::query_parameters::ListImagesOptionsBuilder::default().filters(&filters).build();
    for image in docker.list_images(Some(opts)).await.unwrap_or_default() {
        let opts = bollard::query_parameters::RemoveImageOptionsBuilder::default().force(true).build();
        let _ = docker.remove_image(&image.id, Some(opts), None).await;
    }
}

fn bench_labels() -> HashMap<String, String> {
    HashMap::from([(LABEL_MANAGED.to_owned(), "1".to_owned()), ("pyberth.bench".to_owned(), "floor".to_owned())])
}

async fn floor_container(docker: &Docker, img: &str) -> anyhow::Result<String> {
    let body = ContainerCreateBody {
        image: Some(img.into()),
        cmd: Some(vec!["sleep".into(), "infinity".into()]),
        labels: Some(bench_labels()),
        host_config: Some(HostConfig { network_mode: Some("none".into()), init: Some(true), ..Default::default() }),
        ..Default::default()
    };
    let name = format!("pyberth-bench-{}-{}", std::process::id(), Instant::now().elapsed().as_nanos());
    let c = docker.create_container(Some(CreateContainerOptionsBuilder::default().name(&name).build()), body).await?;
    docker.start_container(&c.id, None).await?;
    Ok(c.id)
}

async fn remove(docker: &Docker, id: &str) {
    let opts = RemoveContainerOptionsBuilder::default().force(true).build();
    let _ = docker.remove_container(id, Some(opts)).await;
}

/// Measures the engine floors; returns p50 of create+start, of a new exec, and of a round
/// trip on an attached stream.
async fn floors(
    docker: &Docker,
    img: &str,
    container: &str,
    runs: usize,
    table: &mut Table,
) -> anyhow::Result<(f64, f64, f64)> {
    let mut create = Vec::new();
    let mut create_rm = Vec::new();
    for _ in 0..8 {
        let t = Instant::now();
        let id = floor_container(docker, img).await?;
        create.push(t.elapsed());
        remove(docker, &id).await;
        create_rm.push(t.elapsed());
    }
    let (create_p50, _) = table.add("floor: container create + start", &mut create, "raw Docker API".into());
    table.add("floor: container create + start + remove", &mut create_rm, "raw Docker API".into());

    let mut execs = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        exec_to_end(docker, container, vec!["true"]).await?;
        execs.push(t.elapsed());
    }
    let (exec_p50, _) =
        table.add("floor: a new exec running `true`", &mut execs, "one exec per run costs at least this".into());

    let mut py = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        exec_to_end(docker, container, vec!["python3", "-c", "print(1)"]).await?;
        py.push(t.elapsed());
    }
    table.add("floor: a new exec running python3 -c 'print(1)'", &mut py, String::new());

    // A round trip over an already-attached stream: write a line, read it echoed.
    let echo = "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n    sys.stdout.flush()";
    let opts = CreateExecOptions {
        cmd: Some(vec!["python3", "-u", "-c", echo]),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        ..Default::default()
    };
    let ex = docker.create_exec(container, opts).await?;
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
    let (stream_p50, _) =
        table.add("floor: round trip on an attached exec stream", &mut rt, "the floor for a warm run".into());
    Ok((create_p50, exec_p50, stream_p50))
}

async fn exec_to_end(docker: &Docker, container: &str, cmd: Vec<&str>) -> anyhow::Result<()> {
    let opts = CreateExecOptions {
        cmd: Some(cmd),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        ..Default::default()
    };
    let ex = docker.create_exec(container, opts).await?;
    if let StartExecResults::Attached { mut output, .. } = docker.start_exec(&ex.id, None).await? {
        while let Some(frame) = output.next().await {
            frame?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_right_samples() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let (p50, p95) = percentiles(&mut v);
        assert!((p50 - 50.0).abs() <= 1.0, "{p50}");
        assert!((p95 - 95.0).abs() <= 1.0, "{p95}");
    }
}
