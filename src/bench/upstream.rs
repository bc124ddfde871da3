//! `--upstream-bench SERVER.TOOL`: a code-mode call's round trip beside a direct MCP call to
//! the same upstream, both measured in the same run. The upstream is one the config file
//! names (`[upstreams.SERVER]`); the bridged calls come from Python in a session of
//! `--upstream-bench-environment`, which must allow the tool.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use super::drive::Server;
use super::table::Table;
use pyberth::config::SandboxConfig;

/// Calls timed per side: within the default per-run call budget (100) in one run.
const MAX_CALLS: usize = 90;

/// The two rows: the floor (the upstream over stdio, one MCP client, no pyberth in between
/// but the client's own caps), then the same call from Python in a session.
pub(super) async fn rows(
    cfg: &SandboxConfig,
    config_file: Option<&std::path::Path>,
    instance: &str,
    bench: &super::BenchArgs,
    runs: usize,
    table: &mut Table,
) -> anyhow::Result<()> {
    let target = bench.upstream_bench.as_deref().unwrap_or_default();
    let environment = &bench.upstream_bench_environment;
    let args: serde_json::Value = serde_json::from_str(&bench.upstream_bench_args).context("--upstream-bench-args")?;
    let (server, tool) = target.split_once('.').context("--upstream-bench: write SERVER.TOOL")?;
    let spec = cfg.upstreams.get(server).with_context(|| format!("--upstream-bench: no [upstreams.{server}]"))?;
    let serde_json::Value::Object(map) = args.clone() else { bail!("--upstream-bench-args: a JSON object") };
    let var = |k: &str| std::env::var(k).ok();
    let file = |p: &str| std::fs::read_to_string(p).map_err(|e| e.to_string());
    let spec = pyberth::bridge::spec::resolve(server, spec, &var, &file).map_err(anyhow::Error::msg)?;
    let client = match spec.transport {
        pyberth::bridge::spec::Transport::Http { .. } => {
            Some(pyberth::bridge::upstream::http_client(cfg.ca_bundle().as_deref()).map_err(anyhow::Error::msg)?)
        }
        pyberth::bridge::spec::Transport::Stdio { .. } => None,
    };
    let link = pyberth::bridge::upstream::Link::new(spec, client);
    let n = runs.clamp(5, MAX_CALLS);
    let mut direct = Vec::with_capacity(n);
    for i in 0..=n {
        let t = Instant::now();
        let answer = link.call(tool, map.clone()).await.map_err(anyhow::Error::msg)?;
        if answer.is_error {
            bail!("{target} answered an error: {}", answer.value);
        }
        // The first call starts the upstream: not timed.
        if i > 0 {
            direct.push(t.elapsed());
        }
    }
    let (floor, _) = table.add(&format!("{target} direct, MCP stdio ({n} calls)"), &mut direct, String::new());
    table.note("the floor: one MCP client, the upstream's own process".into());

    let mut env = vec![("PYBERTH_POOL_SIZE", "0".to_owned())];
    if let Some(path) = config_file {
        env.push(("PYBERTH_CONFIG", path.display().to_string()));
    }
    let server = Server::start(cfg, &format!("{instance}-upstream"), &env).await?;
    let code = format!(
        "import json, time, tools\nargs = json.loads({args:?})\ntools.call({target:?}, **args)\nout = []\n\
         for _ in range({n}):\n    t = time.perf_counter()\n    tools.call({target:?}, **args)\n    \
         out.append(time.perf_counter() - t)\nprint(json.dumps(out))",
        args = serde_json::to_string(&args)?,
    );
    let params = serde_json::json!({ "session": "upstream", "environment": environment, "code": code });
    let text = server.tool("run_python", params).await.map(|(t, _)| t);
    server.stop().await;
    let text = text?;
    let json = text.lines().find(|l| l.starts_with('[')).with_context(|| format!("no timings in {text:.300}"))?;
    let secs: Vec<f64> = serde_json::from_str(json).context("the timings")?;
    let mut bridged: Vec<Duration> = secs.iter().filter_map(|s| Duration::try_from_secs_f64(*s).ok()).collect();
    let what = format!("{target} from Python, code mode ({n} calls)");
    let (p50, _) = table.add(&what, &mut bridged, String::new());
    table.note(format!("+{:.2} ms over the floor: agent channel, server checks, audit", p50 - floor));
    Ok(())
}
