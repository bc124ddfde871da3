//! Execs: the one long-lived attached exec that reaches the agent, and the short one that kills
//! runaway code (Docker has no API to kill an exec: moby#9098).
//!
//! The attached exec is a relay (`images/python/relay.rs`, `relay attach`, which starts the
//! agent when no keeper listens yet; `keeper.py attach` in an image without it): the agent runs
//! detached under a keeper inside the container and outlives the exec's stream, so a dropped stream (a server restart, a network blip to a remote engine)
//! loses no state; the next attach reaches the same interpreter (docs/design.md D12).

use std::pin::Pin;

use crate::docker::Engine;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use futures::{Stream, StreamExt};
use tokio::io::AsyncWrite;

use super::Error;
use super::identity;
use super::{ENV, WORKSPACE};

/// Frames coming out of an attached exec.
pub type Output = Pin<Box<dyn Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>>;
/// The attached exec's stdin.
pub type Input = Pin<Box<dyn AsyncWrite + Send>>;

/// Command line of the relay, then of the agent its keeper runs: `relay attach`, which
/// relays to a keeper already listening at once (a reattach starts no Python interpreter)
/// and otherwise starts our agent as its own keeper; `sh` runs `keeper.py attach` itself in
/// an image without it (one pinned with `--image` built on an older sandbox image). A fixed script: its arguments are constants. `-I` keeps
/// PYTHON* variables and the script's directory off the path, `-u` unbuffers, `-B` keeps
/// `__pycache__` out of the workspace; the keeper needs no `site` (`-S`). Its socket lives in
/// a 0700 directory of the code's uid on the container's own /tmp tmpfs.
pub(crate) const AGENT_CMD: [&str; 11] = [
    "sh",
    "-c",
    "test -x /opt/pyberth/relay && exec /opt/pyberth/relay attach \"$@\"; \
     exec python3 -I -S -B /opt/pyberth/keeper.py attach \"$@\"",
    "pyberth-attach",
    KEEPER_DIR,
    "--",
    "python3",
    "-I",
    "-u",
    "-B",
    "/opt/pyberth/agent.py",
];

/// Where the keeper listens, inside the container.
pub const KEEPER_DIR: &str = "/tmp/.pyberth-keeper";

/// An attached exec.
pub struct Attached {
    /// Exec id, for inspecting its exit code.
    pub id: String,
    /// Its stdin.
    pub input: Input,
    /// Its stdout and stderr frames.
    pub output: Output,
}

/// Reaches the agent in a running container as the code's uid (the container's own), through
/// a relay to its keeper; the keeper and a fresh agent are started first when none runs.
pub async fn attach_agent(docker: &dyn Engine, container: &str, uid: u32) -> Result<Attached, Error> {
    attach(docker, container, uid, &AGENT_CMD, true).await
}

async fn attach(docker: &dyn Engine, container: &str, uid: u32, cmd: &[&str], stdin: bool) -> Result<Attached, Error> {
    let user = identity::user(uid);
    let opts = CreateExecOptions {
        cmd: Some(cmd.to_vec()),
        attach_stdin: Some(stdin),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        // Constant working directory and user, never from input (CVE-2024-21626 class).
        working_dir: Some(WORKSPACE),
        user: Some(user.as_str()),
        privileged: Some(false),
        env: Some(ENV.to_vec()),
        ..Default::default()
    };
    let created = docker.create_exec(container, opts.into()).await?;
    let start = StartExecOptions { detach: false, tty: false, output_capacity: Some(256 << 10) };
    match docker.start_exec(&created.id, Some(start)).await? {
        StartExecResults::Attached { output, input } => Ok(Attached { id: created.id, input, output }),
        StartExecResults::Detached => Err(Error::NotAttached),
    }
}

/// Kills every process of the code's uid in the container: the agent, its children, and any
/// grandchildren that left the agent's process group. PID 1 runs under another uid and is
/// untouched; `kill(-1)` spares the caller itself. The uid is the container's own, so nothing
/// outside the container shares it.
pub async fn kill_code_processes(docker: &dyn Engine, container: &str, uid: u32) -> Result<(), Error> {
    // Waited for, so the caller knows the old agent is gone.
    run_as_code(docker, container, uid, "kill -KILL -1").await
}

/// Runs a fixed `sh` script (never input) as the code's uid, to its end.
pub async fn run_as_code(docker: &dyn Engine, container: &str, uid: u32, script: &str) -> Result<(), Error> {
    let mut exec = attach(docker, container, uid, &["sh", "-c", script], false).await?;
    while let Some(frame) = exec.output.next().await {
        frame?;
    }
    Ok(())
}

/// Runs `cmd` in the container as `uid` and waits for it: its exit code and the start of its
/// stderr. Its processes are the container's, and so is what they allocate.
pub async fn run_as(docker: &dyn Engine, container: &str, uid: u32, cmd: &[&str]) -> Result<(i64, String), Error> {
    let mut exec = attach(docker, container, uid, cmd, false).await?;
    let mut err = Vec::new();
    while let Some(frame) = exec.output.next().await {
        if let LogOutput::StdErr { message } = frame?
            && err.len() < 4096
        {
            err.extend_from_slice(&message);
        }
    }
    let code = exit_code(docker, &exec.id).await.unwrap_or(-1);
    Ok((code, String::from_utf8_lossy(&err).chars().take(600).collect()))
}

/// Exit code of a finished exec, if Docker knows it.
pub async fn exit_code(docker: &dyn Engine, exec_id: &str) -> Option<i64> {
    docker.inspect_exec(exec_id).await.ok().and_then(|e| e.exit_code)
}

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attached").finish_non_exhaustive()
    }
}

#[cfg(test)]
#[path = "relay_tests.rs"]
mod relay_tests;
