//! The configuration file: its keys, and its values under those of flags and variables.

use super::SandboxConfig;

pub fn keys_of<T: serde::Serialize>(value: &T) -> Vec<String> {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

impl SandboxConfig {
    /// The keys [`SandboxConfig`] takes in the config file: its clap ids, which are its fields.
    pub fn keys() -> Vec<String> {
        use clap::Args as _;
        let mut keys: Vec<String> =
            Self::augment_args(clap::Command::new("keys")).get_arguments().map(|a| a.get_id().to_string()).collect();
        keys.push("environments".into());
        keys.push("upstreams".into());
        keys.push("principals".into());
        keys
    }
}

/// Reads a TOML configuration file into a table, with errors that name the file.
pub fn read_file(path: &std::path::Path) -> Result<toml::Table, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read the config file {}: {e}", path.display()))?;
    text.parse::<toml::Table>().map_err(|e| format!("{} is not valid TOML: {e}", path.display()))
}

/// Fills the fields of `target` that clap took from a default with the file's values; keys set
/// by a flag or an environment variable keep those. Returns the keys `target` knows, so the
/// caller can refuse keys nothing knows. Each key is checked alone, so an error names it.
pub fn apply_file<T>(target: &mut T, matches: &clap::ArgMatches, file: &toml::Table) -> Result<Vec<String>, String>
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    use clap::parser::ValueSource;
    let mut current = serde_json::to_value(&*target).map_err(|e| e.to_string())?;
    let Some(fields) = current.as_object_mut() else { return Err("settings are not a table".into()) };
    let mut known = Vec::new();
    for (key, value) in file {
        if !fields.contains_key(key) {
            continue;
        }
        known.push(key.clone());
        let explicit = matches!(
            matches.try_get_raw(key).ok().and_then(|_| matches.value_source(key)),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        );
        if explicit {
            continue;
        }
        fields.insert(key.clone(), serde_json::to_value(value).map_err(|e| format!("config key `{key}`: {e}"))?);
        if let Err(e) = serde_json::from_value::<T>(serde_json::Value::Object(fields.clone())) {
            return Err(format!("config key `{key}`: {e}"));
        }
    }
    *target = serde_json::from_value(current).map_err(|e| e.to_string())?;
    Ok(known)
}

#[cfg(test)]
mod file_tests {
    use super::*;
    use crate::config::WorkspaceSize;
    use clap::{CommandFactory as _, FromArgMatches as _, Parser};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        cfg: SandboxConfig,
    }

    fn load(args: &[&str], file: &str) -> Result<SandboxConfig, String> {
        let matches = Cli::command().try_get_matches_from(args).map_err(|e| e.to_string())?;
        let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
        let table: toml::Table = file.parse().map_err(|e: toml::de::Error| e.to_string())?;
        apply_file(&mut cli.cfg, &matches, &table)?;
        Ok(cli.cfg)
    }

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let cfg = load(&["x", "--memory-mb", "300"], "memory_mb = 1024\npids = 99\n").expect("valid");
        assert_eq!(cfg.memory_mb, 300, "the flag wins");
        assert_eq!(cfg.pids, 99, "the file beats the default");
        assert_eq!(cfg.tmp_mb, 64, "untouched keys keep their default");
    }

    #[test]
    fn bad_values_name_their_key() {
        let e = load(&["x"], "memory_mb = \"lots\"\n").expect_err("a string for a number");
        assert!(e.to_string().contains("memory_mb"), "{e}");
        let cfg = load(&["x"], "memory_mb = 10\n").expect("parses");
        let e = cfg.validate().expect_err("below the minimum");
        assert!(e.to_string().contains("memory_mb"), "{e}");
    }

    #[test]
    fn the_workspace_is_bounded_by_default_and_disk_is_an_explicit_choice() {
        let cfg = load(&["x"], "").expect("defaults");
        assert_eq!(cfg.workspace_mb, WorkspaceSize::Auto);
        assert_eq!(cfg.workspace_bound_mb(), Some(256), "half of the default 512 MiB");
        let cfg = load(&["x", "--memory-mb", "2048"], "").expect("valid");
        assert_eq!(cfg.workspace_bound_mb(), Some(1024), "half of the session's memory");
        for (args, file, want) in [
            (&["x", "--workspace-mb", "disk"][..], "", None),
            (&["x", "--workspace-mb", "0"][..], "", None),
            (&["x"][..], "workspace_mb = \"disk\"\n", None),
            (&["x"][..], "workspace_mb = 0\n", None),
            (&["x"][..], "workspace_mb = 64\n", Some(64)),
            (&["x", "--workspace-mb", "100"][..], "workspace_mb = \"disk\"\n", Some(100)),
        ] {
            let cfg = load(args, file).expect("valid");
            cfg.validate().expect("valid values");
            assert_eq!(cfg.workspace_bound_mb(), want, "{args:?} {file:?}");
        }
        assert!(load(&["x", "--workspace-mb", "lots"], "").is_err());
        let cfg = load(&["x", "--workspace-mb", "512"], "").expect("parses");
        let e = cfg.validate().expect_err("as large as the memory");
        assert!(e.to_string().contains("workspace_mb"), "{e}");
    }

    #[test]
    fn the_uid_range_has_a_free_default_and_is_checked() {
        let cfg = load(&["x"], "").expect("defaults");
        assert_eq!(cfg.uid_range, crate::docker::identity::UidRange::default());
        let cfg = load(&["x"], "uid_range = \"200000-300000\"\n").expect("from the file");
        assert_eq!((cfg.uid_range.first, cfg.uid_range.last), (200_000, 300_000));
        let e = load(&["x"], "uid_range = \"1000-2000\"\n").expect_err("users' uids");
        assert!(e.contains("uid_range"), "{e}");
        assert!(load(&["x", "--uid-range", "1000-1000"], "").is_err());
    }
}
