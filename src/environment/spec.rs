//! Environments as the operator writes them in the config file: plain data, read by the
//! settings (`[environments.NAME]`) and resolved by the parent module.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// A host folder (or file) mounted read-only into every session of an environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MountSpec {
    /// Path on the host; must exist when the server starts.
    pub host: PathBuf,
    /// Absolute path inside the sandbox, e.g. /data.
    pub path: String,
}

/// An environment as written in the config file, `[environments.NAME]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvironmentSpec {
    /// What it is for, shown to models by list_environments.
    pub description: Option<String>,
    /// Base image with Python (e.g. python:3.11-slim), pulled if a registry answers.
    pub base: Option<String>,
    /// Debian release bootstrapped offline when the base cannot be pulled (bookworm: 3.11,
    /// trixie: 3.13).
    pub debian: Option<String>,
    /// Packages preinstalled as a dependency layer, built once.
    #[serde(default)]
    pub packages: Vec<String>,
    /// Memory per session, MiB.
    pub memory_mb: Option<u64>,
    /// CPU share per session.
    pub cpus: Option<f64>,
    /// Processes and threads per session.
    pub pids: Option<i64>,
    /// Size of /tmp, MiB.
    pub tmp_mb: Option<u64>,
    /// Default time limit of a run, seconds.
    pub timeout_s: Option<u64>,
    /// Characters of output a run's text shows a model (`text_budget`).
    pub text_budget: Option<usize>,
    /// Host folders mounted read-only.
    #[serde(default)]
    pub mounts: Vec<MountSpec>,
    /// Hosts its sessions may reach through the egress proxy (`pypi.org`, `*.example.com`,
    /// `api.example.com:8443`, `*`); absent or empty: no network.
    pub egress: Option<Vec<String>>,
    /// Headers the egress proxy adds to plain HTTP requests to a host (replacing the code's
    /// own), by host: `"api.example.com" = { Authorization = "Bearer ${EXAMPLE_TOKEN}" }`.
    /// `${VAR}` is read from the server's environment: the code never sees the value.
    pub egress_headers: Option<BTreeMap<String, BTreeMap<String, String>>>,
    /// Packages its installs may build from source, beside the server's `allow_sdist`.
    #[serde(default)]
    pub allow_sdist: Vec<String>,
    /// Upstream tools its sessions may call from Python (code mode): `server:tool` with `*`
    /// or a prefix ending in `*` for the tool (`time:*`, `git:git_log`); empty: none.
    #[serde(default)]
    pub tools: Vec<String>,
    /// Tools not marked read-only by their server that may be called all the same, each by
    /// its full name (`git:git_commit`).
    #[serde(default)]
    pub write_tools: Vec<String>,
    /// Tool calls one run may make (default 100).
    pub tool_calls: Option<u32>,
    /// Time one run's tool calls may take together, seconds (default 300).
    pub tool_time_s: Option<u64>,
}
