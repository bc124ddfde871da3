//! Environments: named sandbox flavours an operator defines (a base image or an offline Debian
//! release, preinstalled packages, limits, read-only host folders), chosen per session.
//!
//! Why this file passes 500 lines: resolving an environment is one flat list of overrides and
//! checks, and its tests (about 120 lines) sit beside it.
//!
//! Each environment resolves to a full [`SandboxConfig`] (the server's settings with the
//! environment's overrides), so the rest of the code builds images and containers from a config
//! as it always has. Callers only pick a name: they cannot add mounts or change limits.

use std::collections::BTreeMap;
use std::path::{Component, Path};
use std::sync::Arc;

use crate::config::SandboxConfig;

pub mod spec;
pub use spec::{EnvironmentSpec, MountSpec};

/// The environment used when a caller names none, unless configured otherwise.
pub const DEFAULT: &str = "default";

/// Paths a mount may not cover or sit in: the system, the agent's own, the workspace.
const RESERVED: &[&str] = &[
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/opt",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/sys",
    "/tmp",
    "/usr",
    "/var",
    "/workspace",
];

/// A resolved environment.
#[derive(Debug)]
pub struct Environment {
    /// Its name.
    pub name: String,
    /// What it is for.
    pub description: String,
    /// The server's settings with this environment's overrides (base, limits, mounts).
    pub cfg: Arc<SandboxConfig>,
    /// Preinstalled requirements, canonical and sorted.
    pub packages: Vec<String>,
    /// Host folders its sandboxes see read-only.
    pub mounts: Vec<MountSpec>,
    /// The egress allow-list its sessions start with; empty: no network (`NetworkMode none`).
    pub egress: Vec<crate::egress::policy::Rule>,
    /// Headers the proxy adds, by host, values resolved (secret: never shown).
    pub egress_headers: crate::egress::policy::SecretHeaders,
    /// The upstream tools its sessions may call (code mode), and their budget.
    pub bridge: crate::bridge::policy::Policy,
}

/// Every environment of a server.
#[derive(Debug)]
pub struct Environments {
    map: BTreeMap<String, Arc<Environment>>,
    default: String,
}

/// The built-in data-science environment.
pub const DATASCIENCE: &str = "datascience";

/// What the `datascience` environment preinstalls: the usual analysis stack and readers of
/// the common formats, pinned so that every server builds the same set (one layer key), with
/// wheels for CPython 3.11 to 3.13 on x86_64 and aarch64 Linux.
pub const DATASCIENCE_PACKAGES: [&str; 8] = [
    "matplotlib==3.11.2",
    "numpy==2.4.6",
    "openpyxl==3.1.5",
    "pandas==3.1.1",
    "pyarrow==26.0.1",
    "scikit-learn==1.9.1",
    "scipy==1.17.1",
    "tabulate==0.10.0",
];

/// The built-in environments: the configured default, two Python versions that also build
/// offline (Debian bookworm has 3.11, trixie 3.13), and `datascience` (the default's Python
/// with [`DATASCIENCE_PACKAGES`] as one dependency layer, built on first use or by
/// `pyberth image build --environment datascience`).
fn builtins(cfg: &SandboxConfig) -> Vec<(&'static str, EnvironmentSpec)> {
    let spec = |description: String, base: &str, debian: &str| EnvironmentSpec {
        description: Some(description),
        base: Some(base.to_owned()),
        debian: Some(debian.to_owned()),
        ..Default::default()
    };
    vec![
        // Described in `resolve`, from the base it ends up with (an operator may set another).
        (DEFAULT, EnvironmentSpec { description: None, ..spec(String::new(), &cfg.base_image, &cfg.fallback_release) }),
        (
            "python3.11",
            spec("Python 3.11 (python:3.11-slim, offline: Debian bookworm)".into(), "python:3.11-slim", "bookworm"),
        ),
        (
            "python3.13",
            spec("Python 3.13 (python:3.13-slim, offline: Debian trixie)".into(), "python:3.13-slim", "trixie"),
        ),
        (
            DATASCIENCE,
            EnvironmentSpec {
                packages: DATASCIENCE_PACKAGES.iter().map(|p| (*p).to_owned()).collect(),
                ..spec(
                    "Data science: the default environment's Python with numpy, pandas, matplotlib (figures come \
                     back as images), scipy, scikit-learn, pyarrow (Parquet, Arrow), openpyxl (Excel) and tabulate \
                     preinstalled. The first session builds it once (about a minute, with progress) unless the \
                     operator ran `pyberth image build --environment datascience`"
                        .into(),
                    &cfg.base_image,
                    &cfg.fallback_release,
                )
            },
        ),
    ]
}

/// The Python a Debian release ships.
fn debian_python(release: &str) -> Option<&'static str> {
    match release {
        "bullseye" => Some("3.9"),
        "bookworm" => Some("3.11"),
        "trixie" => Some("3.13"),
        _ => None,
    }
}

/// "Debian bookworm's Python 3.11": what the offline base of `release` runs.
fn offline_python(release: &str) -> String {
    match debian_python(release) {
        Some(v) => format!("Debian {release}'s Python {v}"),
        None => format!("Debian {release}'s Python 3"),
    }
}

/// "Python 3.12 from python:3.12-slim" for an official Python image, else the reference.
fn image_python(image: &str) -> String {
    let tag = image.strip_prefix("python:").or_else(|| image.strip_prefix("docker.io/library/python:"));
    match tag.and_then(|t| t.split('-').next()).filter(|v| v.starts_with(|c: char| c.is_ascii_digit())) {
        Some(v) => format!("Python {v} from {image}"),
        None => image.to_owned(),
    }
}

/// The default environment's description: what it runs, both where a registry answers and
/// where it does not (which one a server got shows in the image it built; get_environment
/// tells a session's exact Python).
fn default_description(cfg: &SandboxConfig) -> String {
    const TAIL: &str = "no packages preinstalled";
    if let Some(image) = &cfg.image {
        return format!("General purpose: the image {image} (--image); {TAIL}");
    }
    let offline = offline_python(&cfg.fallback_release);
    // The offline base named as the base itself (compose did so): there is no other case.
    if cfg.base_image.starts_with(&format!("{}:", crate::docker::image::BASE_REPO)) {
        return format!("General purpose: {offline} ({}); {TAIL}", cfg.base_image);
    }
    format!(
        "General purpose: {} where a registry answers, otherwise {offline}, built offline; {TAIL}",
        image_python(&cfg.base_image)
    )
}

/// The default environment's description once its image exists: the base it was built on,
/// read from the engine (the tagged images in its history), in place of both cases. An
/// operator's own description, and every other environment's (the same Python either way),
/// are returned as they are; so is the default's while its image is not built.
pub async fn description_as_built(docker: &dyn crate::docker::Engine, env: &Environment) -> String {
    let generated = env.name == DEFAULT && env.description == default_description(&env.cfg);
    if !generated || env.cfg.image.is_some() {
        return env.description.clone();
    }
    let tag = crate::docker::image::tag_for(&env.cfg);
    let Ok(history) = docker.image_history(&tag).await else { return env.description.clone() };
    let tags: Vec<&str> = history.iter().skip(1).flat_map(|step| step.tags.iter().map(String::as_str)).collect();
    match built_on(&env.cfg, &tags) {
        Some(runs) => format!("General purpose: {runs}; no packages preinstalled"),
        None => env.description.clone(),
    }
}

/// What an image whose ancestors carry `tags` runs: the configured base, or the offline one.
fn built_on(cfg: &SandboxConfig, tags: &[&str]) -> Option<String> {
    let offline = format!("{}:{}", crate::docker::image::BASE_REPO, cfg.fallback_release);
    if tags.contains(&offline.as_str()) {
        return Some(format!(
            "{} (the offline base {offline}: {} could not be pulled when the image was built)",
            offline_python(&cfg.fallback_release),
            cfg.base_image
        ));
    }
    let base = cfg.base_image.as_str();
    let library = format!("docker.io/library/{base}");
    tags.iter().any(|t| *t == base || *t == library).then(|| image_python(base))
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 40
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
}

fn check_mount(env: &str, m: &MountSpec) -> Result<MountSpec, String> {
    let at = format!("environments.{env}.mounts ({} -> {})", m.host.display(), m.path);
    let host = m.host.canonicalize().map_err(|e| format!("{at}: the host path cannot be used: {e}"))?;
    let path = Path::new(&m.path);
    let clean = path.is_absolute()
        && path.components().skip(1).all(|c| matches!(c, Component::Normal(_)))
        && path.components().count() >= 2
        && !m.path.contains(['\0', ':', ',', '\n']);
    if !clean {
        return Err(format!("{at}: the sandbox path must be absolute and plain, such as /data"));
    }
    if let Some(r) = RESERVED.iter().find(|r| path.starts_with(r) || Path::new(r).starts_with(path)) {
        return Err(format!("{at}: the sandbox path may not be in or above {r}; use a path such as /data"));
    }
    Ok(MountSpec { host, path: m.path.clone() })
}

impl Environments {
    /// The built-ins plus the operator's, each checked; errors name the entry.
    pub fn from_config(cfg: &SandboxConfig) -> Result<Self, String> {
        let mut specs: BTreeMap<String, EnvironmentSpec> =
            builtins(cfg).into_iter().map(|(n, s)| (n.to_owned(), s)).collect();
        for (name, spec) in &cfg.environments {
            if !valid_name(name) {
                return Err(format!("environments.{name}: a name is 1-40 letters, digits, '.', '_' or '-'"));
            }
            // An operator's entry replaces a built-in of the same name, filling what it omits.
            let merged = match specs.remove(name) {
                Some(builtin) => EnvironmentSpec {
                    description: spec.description.clone().or(builtin.description),
                    base: spec.base.clone().or(builtin.base),
                    debian: spec.debian.clone().or(builtin.debian),
                    // A built-in's packages stay unless the operator names others.
                    packages: if spec.packages.is_empty() { builtin.packages } else { spec.packages.clone() },
                    ..spec.clone()
                },
                None => spec.clone(),
            };
            specs.insert(name.clone(), merged);
        }
        let mut map = BTreeMap::new();
        for (name, spec) in specs {
            let env = resolve(cfg, &name, &spec)?;
            map.insert(name, Arc::new(env));
        }
        let default = cfg.default_environment.clone();
        if !map.contains_key(&default) {
            return Err(format!(
                "default_environment {default:?} is not an environment (known: {})",
                map.keys().cloned().collect::<Vec<_>>().join(", ")
            ));
        }
        Ok(Self { map, default })
    }

    /// The named environment, or the default one. The error lists the choices; each front end
    /// adds where they are described (the `list_environments` tool, `pyberth envs`).
    pub fn get(&self, name: Option<&str>) -> Result<Arc<Environment>, String> {
        let name = name.unwrap_or(&self.default);
        self.map.get(name).cloned().ok_or_else(|| format!("no environment {name:?}: choose one of {}", self.names()))
    }

    /// The default environment's name.
    pub fn default_name(&self) -> &str {
        &self.default
    }

    /// All environments, by name.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Environment>> {
        self.map.values()
    }

    fn names(&self) -> String {
        self.map.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// Whether sandboxes of `cfg` can have a network at all: gVisor is registered here with
/// `--network=none`, so its sandboxes never get an interface.
pub fn runtime_refusal(cfg: &SandboxConfig) -> Option<String> {
    cfg.runtime.as_deref().filter(|r| r.contains("runsc")).map(|r| {
        format!(
            "this environment allows egress, but sandboxes run under {r} (gVisor), which this engine registers with \
             --network=none: a session there can have no network. Ask the operator to run such sessions under runc, \
             or use a session without egress"
        )
    })
}

/// The server's settings with the environment's own over them.
fn settings(base: &SandboxConfig, name: &str, spec: &EnvironmentSpec) -> Result<SandboxConfig, String> {
    let mut cfg = base.clone();
    cfg.environments.clear();
    // --image pins the default environment's image only; the others build their own.
    if name != DEFAULT {
        cfg.image = None;
    }
    if let Some(b) = &spec.base {
        if b.is_empty() || b.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!("environments.{name}.base: {b:?} is not an image reference"));
        }
        cfg.base_image = b.clone();
    }
    if let Some(d) = &spec.debian {
        cfg.fallback_release = d.clone();
    }
    if let Some(v) = spec.memory_mb {
        cfg.memory_mb = v;
    }
    if let Some(v) = spec.cpus {
        cfg.cpus = v;
    }
    if let Some(v) = spec.pids {
        cfg.pids = v;
    }
    if let Some(v) = spec.tmp_mb {
        cfg.tmp_mb = v;
    }
    if let Some(v) = spec.timeout_s {
        cfg.timeout_s = v;
    }
    if let Some(v) = spec.text_budget {
        cfg.text_budget = v;
    }
    // The environment's allowances add to the server's.
    for p in &spec.allow_sdist {
        if !cfg.allow_sdist.contains(p) {
            cfg.allow_sdist.push(p.clone());
        }
    }
    Ok(cfg)
}

fn resolve(base: &SandboxConfig, name: &str, spec: &EnvironmentSpec) -> Result<Environment, String> {
    let mut cfg = settings(base, name, spec)?;
    cfg.max_timeout_s = cfg.max_timeout_s.max(cfg.timeout_s);
    let mounts: Vec<MountSpec> = spec.mounts.iter().map(|m| check_mount(name, m)).collect::<Result<_, _>>()?;
    let mut paths: Vec<&str> = mounts.iter().map(|m| m.path.as_str()).collect();
    paths.sort_unstable();
    if paths.windows(2).any(|w| Path::new(w[1]).starts_with(w[0])) {
        return Err(format!("environments.{name}.mounts: two mounts overlap"));
    }
    cfg.validate().map_err(|e| format!("environments.{name}: {e}"))?;
    let packages = crate::deps::parse_set(&spec.packages, base.max_packages)
        .map_err(|e| format!("environments.{name}.packages: {e}"))?;
    let description = match &spec.description {
        Some(d) => d.clone(),
        None if name == DEFAULT => default_description(&cfg),
        None => format!("operator-defined environment {name}"),
    };
    let egress = crate::egress::policy::parse_list(spec.egress.as_deref().unwrap_or_default())
        .map_err(|e| format!("environments.{name}.egress: {e}"))?;
    if !egress.is_empty()
        && let Some(why) = runtime_refusal(&cfg)
    {
        tracing::warn!(environment = %name, "{why}");
    }
    let egress_headers =
        crate::egress::policy::SecretHeaders(resolve_headers(name, spec.egress_headers.as_ref(), &|v| {
            std::env::var(v).ok()
        })?);
    let bridge = crate::bridge::policy::Policy::new(
        &format!("environments.{name}"),
        &spec.tools,
        &spec.write_tools,
        spec.tool_calls,
        spec.tool_time_s,
        &|server| base.upstreams.contains_key(server),
    )?;
    Ok(Environment {
        name: name.to_owned(),
        description,
        cfg: Arc::new(cfg),
        packages,
        mounts,
        egress,
        egress_headers,
        bridge,
    })
}

/// `${VAR}` in header values replaced from `var`; names and values checked. Errors name the
/// entry, never the value.
fn resolve_headers(
    env: &str,
    spec: Option<&BTreeMap<String, BTreeMap<String, String>>>,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<crate::egress::policy::Headers, String> {
    let mut out = crate::egress::policy::Headers::new();
    for (host, headers) in spec.into_iter().flatten() {
        let at = format!("environments.{env}.egress_headers.{host:?}");
        let h = crate::egress::policy::normalize_host(host).ok_or_else(|| format!("{at}: not a host name"))?;
        for (name, template) in headers {
            let token = !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
            if !token {
                return Err(format!("{at}: {name:?} is not a header name"));
            }
            let mut value = String::new();
            let mut rest = template.as_str();
            while let Some(i) = rest.find("${") {
                value.push_str(&rest[..i]);
                let after = &rest[i + 2..];
                let end = after.find('}').ok_or_else(|| format!("{at}.{name}: unclosed ${{"))?;
                let key = &after[..end];
                value.push_str(
                    &var(key)
                        .ok_or_else(|| format!("{at}.{name}: ${{{key}}} is not set in the server's environment"))?,
                );
                rest = &after[end + 1..];
            }
            value.push_str(rest);
            if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
                return Err(format!("{at}.{name}: the value holds a line break or NUL"));
            }
            out.entry(h.clone()).or_default().push((name.clone(), value));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory as _, FromArgMatches as _, Parser};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        cfg: SandboxConfig,
    }

    fn cfg_with(file: &str) -> SandboxConfig {
        let m = Cli::command().try_get_matches_from(["x"]).expect("defaults");
        let mut cli = Cli::from_arg_matches(&m).expect("defaults");
        let table: toml::Table = file.parse().expect("toml");
        crate::config::file::apply_file(&mut cli.cfg, &m, &table).expect("applies");
        cli.cfg
    }

    #[test]
    fn builtins_exist_and_operators_add_and_override() {
        let dir = std::env::temp_dir().join(format!("pyberth-envdata-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = format!(
            "[environments.science]\npackages = [\"numpy\"]\nmemory_mb = 1024\ntext_budget = 4000\n\
             mounts = [{{ host = \"{}\", path = \"/data\" }}]\n\
             [environments.\"python3.13\"]\ndescription = \"mine\"\n",
            dir.display()
        );
        let envs = Environments::from_config(&cfg_with(&file)).expect("valid");
        let science = envs.get(Some("science")).expect("science");
        assert_eq!(science.packages, vec!["numpy".to_owned()]);
        assert_eq!(science.cfg.memory_mb, 1024);
        assert_eq!(science.cfg.text_budget, 4000, "the text budget is set per environment");
        assert_eq!(envs.get(None).expect("default").cfg.text_budget, 20_000);
        assert_eq!(science.mounts[0].path, "/data");
        let py313 = envs.get(Some("python3.13")).expect("python3.13");
        assert_eq!(py313.description, "mine");
        assert_eq!(py313.cfg.fallback_release, "trixie", "unset fields keep the built-in's");
        assert_eq!(envs.get(None).expect("default").name, "default");
        let e = envs.get(Some("nope")).expect_err("unknown");
        assert!(e.contains("python3.11") && e.contains("datascience"), "{e}");
        assert!(!e.contains("list_environments"), "no MCP tool named to a CLI user: {e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_default_description_says_what_runs_with_and_without_a_registry() {
        let envs = Environments::from_config(&cfg_with("")).expect("valid");
        let default = envs.get(None).expect("default").description.clone();
        assert_eq!(
            default,
            "General purpose: Python 3.12 from python:3.12-slim where a registry answers, otherwise \
             Debian bookworm's Python 3.11, built offline; no packages preinstalled"
        );
        let cfg = cfg_with("base_image = \"pyberth-base:bookworm\"\n");
        let envs = Environments::from_config(&cfg).expect("valid");
        let offline = &envs.get(None).expect("default").description;
        assert!(
            offline.starts_with("General purpose: Debian bookworm's Python 3.11 (pyberth-base:bookworm)"),
            "{offline}"
        );
        let cfg = cfg_with("image = \"my/python:1\"\nfallback_release = \"trixie\"\n");
        let pinned = &Environments::from_config(&cfg).expect("valid").get(None).expect("default").description;
        assert!(pinned.contains("the image my/python:1 (--image)") && !pinned.contains("3.12"), "{pinned}");

        let cfg = cfg_with("");
        let offline = built_on(&cfg, &["pyberth-base:bookworm"]).expect("the offline base");
        assert!(offline.starts_with("Debian bookworm's Python 3.11 (the offline base"), "{offline}");
        assert_eq!(built_on(&cfg, &["python:3.12-slim"]).as_deref(), Some("Python 3.12 from python:3.12-slim"));
        assert_eq!(built_on(&cfg, &["something:else"]), None, "an unknown base is not guessed");
    }

    #[test]
    fn datascience_is_built_in_pinned_and_allowances_add_to_the_servers() {
        let envs = Environments::from_config(&cfg_with("allow_sdist = [\"a\"]\n")).expect("valid");
        let ds = envs.get(Some(DATASCIENCE)).expect("built in");
        assert_eq!(ds.packages.len(), DATASCIENCE_PACKAGES.len());
        assert!(ds.packages.iter().all(|p| p.contains("==")), "pinned: {:?}", ds.packages);
        assert_eq!(ds.cfg.base_image, envs.get(None).expect("default").cfg.base_image, "the default's Python");
        let file = "allow_sdist = [\"a\"]\n[environments.datascience]\nallow_sdist = [\"b\"]\nmemory_mb = 2048\n";
        let envs = Environments::from_config(&cfg_with(file)).expect("valid");
        let ds = envs.get(Some(DATASCIENCE)).expect("overridden");
        assert_eq!(ds.packages.len(), DATASCIENCE_PACKAGES.len(), "its packages stay when none are named");
        assert_eq!(ds.cfg.allow_sdist, ["a", "b"]);
        assert_eq!(envs.get(None).expect("default").cfg.allow_sdist, ["a"]);
        let e = Environments::from_config(&cfg_with("[environments.x]\nallow_sdist = [\"-e .\"]\n"))
            .expect_err("not a name");
        assert!(e.contains("environments.x") && e.contains("allow_sdist"), "{e}");
    }

    #[test]
    fn bad_entries_are_refused_naming_them() {
        for (file, why) in [
            ("[environments.x]\nmounts = [{ host = \"/no/such/dir\", path = \"/data\" }]\n", "environments.x.mounts"),
            ("[environments.x]\nmounts = [{ host = \"/tmp\", path = \"/etc/x\" }]\n", "/etc"),
            ("[environments.x]\nmounts = [{ host = \"/tmp\", path = \"/\" }]\n", "environments.x.mounts"),
            ("[environments.x]\nmounts = [{ host = \"/tmp\", path = \"/data/../etc\" }]\n", "plain"),
            ("[environments.x]\npackages = [\"-e .\"]\n", "environments.x.packages"),
            ("[environments.x]\nmemory_mb = 1\n", "environments.x"),
            ("[environments.\"bad name\"]\n", "a name is"),
            ("default_environment = \"missing\"\n", "default_environment"),
        ] {
            let e = Environments::from_config(&cfg_with(file)).expect_err(file);
            assert!(e.contains(why), "{file}: {e}");
        }
    }

    #[test]
    fn egress_headers_take_values_from_the_server_environment_and_never_show_them() {
        let spec: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::from([(
            "API.example.com".to_owned(),
            BTreeMap::from([("Authorization".to_owned(), "Bearer ${TOKEN}".to_owned())]),
        )]);
        let var = |k: &str| (k == "TOKEN").then(|| "t0k3n".to_owned());
        let h = resolve_headers("e", Some(&spec), &var).expect("resolves");
        assert_eq!(h["api.example.com"], [("Authorization".to_owned(), "Bearer t0k3n".to_owned())]);
        assert!(!format!("{:?}", crate::egress::policy::SecretHeaders(h)).contains("t0k3n"));
        let none = |_: &str| None;
        let e = resolve_headers("e", Some(&spec), &none).expect_err("unset");
        assert!(e.contains("${TOKEN} is not set") && e.contains("egress_headers"), "{e}");
        let crlf = |_: &str| Some("a\r\nX-Evil: 1".to_owned());
        assert!(resolve_headers("e", Some(&spec), &crlf).is_err());
    }
}
