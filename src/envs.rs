//! `pyberth envs`: the environments `pyberth run --environment` and new sessions can use, as
//! the `list_environments` tool shows them to a model, for a person at a terminal.

use pyberth::config::SandboxConfig;
use pyberth::environment::{Environment, Environments};

/// The listing: one block per environment, the default one marked.
pub(crate) fn listing(cfg: &SandboxConfig) -> anyhow::Result<String> {
    let envs = Environments::from_config(cfg).map_err(anyhow::Error::msg)?;
    let mut all: Vec<_> = envs.all().collect();
    all.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = String::new();
    for env in all {
        out.push_str(&block(env, env.name == envs.default_name()));
    }
    Ok(out)
}

fn block(env: &Environment, default: bool) -> String {
    let cfg = &env.cfg;
    let base =
        cfg.image.clone().unwrap_or_else(|| format!("{} (offline: Debian {})", cfg.base_image, cfg.fallback_release));
    let mut out = format!("{}{}\n", env.name, if default { " (the default)" } else { "" });
    if !env.description.is_empty() {
        out.push_str(&format!("  {}\n", env.description));
    }
    out.push_str(&format!("  base: {base}\n"));
    out.push_str(&format!(
        "  limits: {} MiB memory, {} CPU, {} processes, runs up to {} s by default\n",
        cfg.memory_mb, cfg.cpus, cfg.pids, cfg.timeout_s
    ));
    if !env.packages.is_empty() {
        out.push_str(&format!("  packages: {}\n", env.packages.join(" ")));
    }
    for m in &env.mounts {
        out.push_str(&format!("  read-only folder: {} (from {})\n", m.path, m.host.display()));
    }
    let egress: Vec<&str> = env.egress.iter().map(|r| r.text()).collect();
    out.push_str(&format!("  network: {}\n", if egress.is_empty() { "none".into() } else { egress.join(" ") }));
    out
}

/// An unknown environment's error, with where the choices are described.
pub(crate) fn hint(e: String) -> anyhow::Error {
    anyhow::anyhow!("{e} (pyberth envs describes them)")
}
