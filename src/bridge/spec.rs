//! Upstream MCP servers as the operator writes them in the config file (`[upstreams.NAME]`),
//! and their resolution: every secret-bearing value is read from the server's environment
//! (`env:VAR`) or a file (`file:/path`) when the server starts, never from a caller.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Default time one bridged call may take, seconds.
pub const DEFAULT_CALL_TIMEOUT_S: u64 = 30;
/// Default cap on one bridged call's result (its JSON), KiB.
pub const DEFAULT_MAX_RESULT_KB: u64 = 1024;
/// Longest time an operator may give one call, seconds.
const MAX_CALL_TIMEOUT_S: u64 = 3600;
/// Largest result an operator may allow, KiB: it travels in one agent line (16 MiB).
const MAX_RESULT_KB: u64 = 8 << 10;

/// An upstream MCP server as written in the config file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSpec {
    /// stdio: the program to start (an absolute path, or a name looked up on the server's PATH).
    pub command: Option<String>,
    /// stdio: its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// stdio: its environment (nothing else of the server's is passed but PATH, HOME, LANG):
    /// `"env:VAR"` reads the server's variable, `"file:/path"` a file, anything else is literal.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Streamable HTTP: the endpoint (`http://host:port/mcp`).
    pub url: Option<String>,
    /// Streamable HTTP: headers sent on every request, values as for `env`.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Time one call may take, seconds (default 30).
    pub timeout_s: Option<u64>,
    /// Largest result of one call accepted, KiB (default 1024).
    pub max_result_kb: Option<u64>,
}

/// A principal's own settings (`[principals.NAME]`; `[principals."*"]` for every principal
/// without its own entry): its code-mode list, which narrows the environment's, and its quotas.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalSpec {
    /// Upstream tools this principal's sessions may call, as an environment's `tools`; a call
    /// must be on both lists. Absent: the environment's list alone.
    #[serde(default)]
    pub tools: Option<Vec<String>>,
    /// Quota (issue 32): CPU-seconds its sessions' containers may use per UTC day.
    pub cpu_seconds_per_day: Option<u64>,
    /// Quota: seconds of runs (wall time, jobs included) per UTC day.
    pub run_seconds_per_day: Option<u64>,
    /// Quota: MiB of snapshots kept (hibernated sessions included), beside
    /// `--snapshot-mb-per-caller`.
    pub snapshot_mb: Option<u64>,
    /// Quota: MiB moved through the egress proxy (both ways) per UTC day.
    pub egress_mb_per_day: Option<u64>,
    /// Quota: sessions open at once, beside `--max-sessions`.
    pub sessions: Option<usize>,
}

/// How an upstream is reached, resolved.
#[derive(Clone)]
pub enum Transport {
    /// A child process speaking MCP on its stdin and stdout.
    Stdio {
        /// Program.
        command: String,
        /// Arguments.
        args: Vec<String>,
        /// Its whole environment besides PATH, HOME and LANG (secret: never shown).
        env: Vec<(String, String)>,
    },
    /// Streamable HTTP.
    Http {
        /// Endpoint.
        url: String,
        /// Headers (secret: never shown).
        headers: Vec<(String, String)>,
    },
}

impl std::fmt::Debug for Transport {
    /// Names and the endpoint only: values may be credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stdio { command, args, env } => f
                .debug_struct("Stdio")
                .field("command", command)
                .field("args", &args.len())
                .field("env", &env.iter().map(|(k, _)| k).collect::<Vec<_>>())
                .finish(),
            Self::Http { url, headers } => f
                .debug_struct("Http")
                .field("url", url)
                .field("headers", &headers.iter().map(|(k, _)| k).collect::<Vec<_>>())
                .finish(),
        }
    }
}

/// An upstream, resolved and checked.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Its name: the Python namespace (`tools.NAME`) and the allow-lists' prefix.
    pub name: String,
    /// How it is reached.
    pub transport: Transport,
    /// Time one call may take.
    pub timeout: Duration,
    /// Largest result accepted, bytes of JSON.
    pub max_result: usize,
}

/// A name is a Python identifier of ASCII letters, digits and `_`, 1 to 40 long, not
/// starting with a digit nor `_` (it becomes `tools.NAME`).
pub fn valid_name(name: &str) -> bool {
    (1..=40).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphabetic())
}

/// One value: `env:VAR` from `var`, `file:/path` from `file`, else literal. Errors name the
/// key, never the value.
fn resolve_value(
    at: &str,
    value: &str,
    var: &dyn Fn(&str) -> Option<String>,
    file: &dyn Fn(&str) -> Result<String, String>,
) -> Result<String, String> {
    let v = if let Some(name) = value.strip_prefix("env:") {
        var(name).ok_or_else(|| format!("{at}: the variable {name} is not set in the server's environment"))?
    } else if let Some(path) = value.strip_prefix("file:") {
        file(path).map_err(|e| format!("{at}: cannot read {path}: {e}"))?.trim_end_matches(['\n', '\r']).to_owned()
    } else {
        value.to_owned()
    };
    if v.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
        return Err(format!("{at}: the value holds a line break or NUL"));
    }
    Ok(v)
}

fn token(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b))
}

/// Resolves `[upstreams.NAME]`, reading secrets through `var` and `file`.
pub fn resolve(
    name: &str,
    spec: &UpstreamSpec,
    var: &dyn Fn(&str) -> Option<String>,
    file: &dyn Fn(&str) -> Result<String, String>,
) -> Result<Upstream, String> {
    let at = format!("upstreams.{name}");
    if !valid_name(name) {
        return Err(format!("{at}: a name is 1-40 ASCII letters, digits or '_', starting with a letter"));
    }
    let transport = match (&spec.command, &spec.url) {
        (Some(command), None) => {
            if command.is_empty() || command.bytes().any(|b| b == 0) {
                return Err(format!("{at}.command: not a program"));
            }
            if !spec.headers.is_empty() {
                return Err(format!("{at}.headers: only for an upstream with a url"));
            }
            let mut env = Vec::new();
            for (k, v) in &spec.env {
                if !token(k) || k.contains('-') {
                    return Err(format!("{at}.env: {k:?} is not a variable name"));
                }
                env.push((k.clone(), resolve_value(&format!("{at}.env.{k}"), v, var, file)?));
            }
            Transport::Stdio { command: command.clone(), args: spec.args.clone(), env }
        }
        (None, Some(url)) => {
            // https is verified against the server's CA bundle (`ca_bundle`, else the system's).
            if !url.starts_with("http://") && !url.starts_with("https://") {
                return Err(format!("{at}.url: an http:// or https:// URL"));
            }
            if !spec.args.is_empty() || !spec.env.is_empty() {
                return Err(format!("{at}: args and env are only for an upstream with a command"));
            }
            let mut headers = Vec::new();
            for (k, v) in &spec.headers {
                if !token(k) {
                    return Err(format!("{at}.headers: {k:?} is not a header name"));
                }
                headers.push((k.clone(), resolve_value(&format!("{at}.headers.{k}"), v, var, file)?));
            }
            Transport::Http { url: url.clone(), headers }
        }
        _ => return Err(format!("{at}: give either `command` (stdio) or `url` (streamable HTTP)")),
    };
    let timeout_s = spec.timeout_s.unwrap_or(DEFAULT_CALL_TIMEOUT_S);
    if !(1..=MAX_CALL_TIMEOUT_S).contains(&timeout_s) {
        return Err(format!("{at}.timeout_s: 1 to {MAX_CALL_TIMEOUT_S}"));
    }
    let max_kb = spec.max_result_kb.unwrap_or(DEFAULT_MAX_RESULT_KB);
    if !(1..=MAX_RESULT_KB).contains(&max_kb) {
        return Err(format!("{at}.max_result_kb: 1 to {MAX_RESULT_KB}"));
    }
    Ok(Upstream {
        name: name.to_owned(),
        transport,
        timeout: Duration::from_secs(timeout_s),
        max_result: usize::try_from(max_kb << 10).unwrap_or(usize::MAX),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(toml: &str) -> UpstreamSpec {
        toml::from_str(toml).unwrap_or_else(|e| panic!("{toml}: {e}"))
    }

    fn var(k: &str) -> Option<String> {
        (k == "TOKEN").then(|| "s3cret".to_owned())
    }

    fn file(p: &str) -> Result<String, String> {
        if p == "/k" { Ok("from-file\n".into()) } else { Err("no such file".into()) }
    }

    #[test]
    fn secrets_come_from_the_environment_or_a_file_and_errors_never_show_them() {
        let u = resolve(
            "git",
            &spec("command = \"x\"\nenv = { A = \"env:TOKEN\", B = \"file:/k\", C = \"lit\" }"),
            &var,
            &file,
        )
        .expect("valid");
        let Transport::Stdio { env, .. } = &u.transport else { panic!("stdio") };
        assert_eq!(env, &[("A".into(), "s3cret".into()), ("B".into(), "from-file".into()), ("C".into(), "lit".into())]);
        assert!(!format!("{u:?}").contains("s3cret"), "Debug shows no value");
        let e = resolve("git", &spec("command = \"x\"\nenv = { A = \"env:NOPE\" }"), &var, &file).expect_err("unset");
        assert!(e.contains("upstreams.git.env.A") && e.contains("NOPE"), "{e}");
        let h =
            resolve("api", &spec("url = \"http://h/mcp\"\nheaders = { Authorization = \"env:TOKEN\" }"), &var, &file)
                .expect("http");
        assert!(!format!("{h:?}").contains("s3cret"));
    }

    #[test]
    fn bad_entries_are_refused_naming_them() {
        for (name, toml, want) in [
            ("1x", "command = \"x\"", "a name is"),
            ("a-b", "command = \"x\"", "a name is"),
            ("x", "", "either"),
            ("x", "command = \"x\"\nurl = \"http://h\"", "either"),
            ("x", "url = \"ftp://h/mcp\"", "an http:// or https:// URL"),
            ("x", "url = \"ftp://h\"", "upstreams.x.url"),
            ("x", "command = \"x\"\ntimeout_s = 0", "timeout_s"),
            ("x", "command = \"x\"\nmax_result_kb = 999999", "max_result_kb"),
            ("x", "command = \"x\"\nheaders = { A = \"b\" }", "upstreams.x.headers"),
            ("x", "url = \"http://h\"\nheaders = { \"A B\" = \"b\" }", "header name"),
        ] {
            let e = resolve(name, &spec(toml), &var, &file).expect_err(toml);
            assert!(e.contains(want), "{toml}: {e}");
        }
        assert!(toml::from_str::<UpstreamSpec>("command = \"x\"\nbogus = 1").is_err(), "unknown keys refused");
    }
}
