//! The core suite driven by the official MCP Python SDK (`sdk_suite.py`), which speaks
//! 2026-07-28 (`server/discover`, per-request `_meta`, `Mcp-Param-*` headers), over streamable
//! HTTP and over stdio.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::common::{assert_cleaned_up, instance_name, state_dir, with_test_runtime};
use crate::http::{ALICE, HttpServer};

/// The SDK release the suite is written against (the first to speak 2026-07-28 is 2.x).
const SDK: &str = "mcp>=2.3,<3";

/// A venv with the SDK (`common::venv_with`).
fn venv() -> PathBuf {
    static VENV: OnceLock<PathBuf> = OnceLock::new();
    let probe = "import mcp, httpx2; from mcp import Client";
    VENV.get_or_init(|| crate::common::venv_with("protocol-venv", &[SDK], probe)).clone()
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/integration/protocol/sdk_suite.py")
}

/// Runs the script to its end (a blocking child, off the runtime's threads) and checks it
/// reached its last line.
async fn run_suite(mut cmd: tokio::process::Command) {
    let out = cmd.output().await.expect("run sdk_suite.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: String =
        stderr.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n");
    assert!(out.status.success() && stdout.contains("SDK-SUITE-OK 2026-07-28"), "{stdout}\n{tail}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_python_sdk_runs_the_core_suite_on_2026_07_28_over_http() {
    let python = tokio::task::spawn_blocking(venv).await.expect("venv").join("bin/python");
    let s = HttpServer::start(&instance_name("proto-sdk-http")).await;
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(script()).args(["http", &s.url("/mcp"), ALICE, "sdk-http"]).kill_on_drop(true);
    run_suite(cmd).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_python_sdk_runs_the_core_suite_on_2026_07_28_over_stdio() {
    let python = tokio::task::spawn_blocking(venv).await.expect("venv").join("bin/python");
    let instance = instance_name("proto-sdk-stdio");
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg(script())
        .args(["stdio", env!("CARGO_BIN_EXE_pyberth"), "sdk-stdio"])
        .env("PYBERTH_INSTANCE", &instance)
        .env("PYBERTH_STATE_DIR", state_dir())
        .env("PYBERTH_POOL_SIZE", "0")
        .env("PYBERTH_ADOPT_GRACE_S", "0")
        .env("RUST_LOG", "info")
        .kill_on_drop(true);
    with_test_runtime(&mut cmd);
    run_suite(cmd).await;
    assert_cleaned_up(&instance).await;
}
