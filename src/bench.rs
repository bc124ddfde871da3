//! `pyberth bench`: figures measured against the Docker floors of the same run.

use crate::config::SandboxConfig;

/// Runs the benchmark and prints its figures.
pub async fn run(_cfg: SandboxConfig, _runs: usize) -> anyhow::Result<()> {
    anyhow::bail!("bench is not built yet")
}
