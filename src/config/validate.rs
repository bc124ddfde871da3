//! Checks of every setting: each one's range, and what it says when it is out of it.

use super::*;

/// A setting out of range.
#[derive(Debug, thiserror::Error)]
#[error("invalid setting {key} (`{}` in the config file): {why}", key.trim_start_matches('-').replace('-', "_"))]
pub struct Invalid {
    key: &'static str,
    why: String,
}

fn check(ok: bool, key: &'static str, why: impl Into<String>) -> Result<(), Invalid> {
    if ok { Ok(()) } else { Err(Invalid { key, why: why.into() }) }
}

impl SandboxConfig {
    /// Checks every value; the error names the flag.
    pub fn validate(&self) -> Result<(), Invalid> {
        self.validate_limits()?;
        self.validate_egress()?;
        self.validate_packages()?;
        if let Some(endpoint) = &self.otlp_endpoint {
            crate::telemetry::traces_url(endpoint).map_err(|why| Invalid { key: "--otlp-endpoint", why })?;
        }
        check(
            self.k8s_namespace.len() <= 63
                && !self.k8s_namespace.is_empty()
                && self.k8s_namespace.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "--k8s-namespace",
            "must be a Kubernetes namespace name: 1 to 63 lowercase letters, digits or dashes",
        )?;
        check(
            (1..=100).contains(&self.k8s_warm_pool),
            "--k8s-warm-pool",
            "must be 1 to 100 (sandboxes kept ready per environment; a claim must name a warm pool)",
        )?;
        if let Some(instance) = &self.instance {
            check(
                !instance.is_empty()
                    && instance.len() <= 40
                    && instance.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'),
                "--instance",
                "must be 1 to 40 letters, digits or dashes",
            )?;
        }
        Ok(())
    }

    /// The limits of a session and of its runs.
    fn validate_limits(&self) -> Result<(), Invalid> {
        check(self.memory_mb >= 64, "--memory-mb", "must be at least 64")?;
        check(self.cpus > 0.0 && self.cpus <= 1024.0, "--cpus", "must be above 0")?;
        check(self.pids >= 16, "--pids", "must be at least 16")?;
        check(self.tmp_mb >= 1 && self.tmp_mb < self.memory_mb, "--tmp-mb", "must be between 1 and --memory-mb")?;
        check(
            match self.workspace_mb {
                WorkspaceSize::Mb(mb) => mb >= 1 && mb < self.memory_mb,
                WorkspaceSize::Auto | WorkspaceSize::Disk => true,
            },
            "--workspace-mb",
            "must be auto, disk (or 0), or between 1 and --memory-mb (its pages count against the session's memory)",
        )?;
        check(self.timeout_s >= 1, "--timeout-s", "must be at least 1")?;
        // Name the flag that is set past the other, with both values: raising a default is the
        // more likely intent than lowering the maximum.
        check(
            self.timeout_s <= self.max_timeout_s,
            "--timeout-s",
            format!(
                "{} is over --max-timeout-s ({}): give a smaller --timeout-s, or raise --max-timeout-s",
                self.timeout_s, self.max_timeout_s
            ),
        )?;
        check(
            self.interrupt_grace_s > 0.0 && self.interrupt_grace_s <= 60.0,
            "--interrupt-grace-s",
            "must be between 0 and 60",
        )?;
        check(self.idle_ttl_s >= 1, "--idle-ttl-s", "must be at least 1")?;
        check(self.leftover_grace_s >= 1, "--leftover-grace-s", "must be at least 1")?;
        check(self.max_sessions >= 1, "--max-sessions", "must be at least 1")?;
        check(self.audit_log_mb >= 1, "--audit-log-mb", "must be at least 1")?;
        check(self.max_sessions_total >= 1, "--max-sessions-total", "must be at least 1")?;
        check(
            self.output_cap >= 1024 && self.output_cap <= 4 << 20,
            "--output-cap",
            "must be between 1024 and 4 MiB (a result must fit one MCP message; write more to a file)",
        )?;
        check(
            self.text_budget >= 2000 && self.text_budget <= 1_000_000,
            "--text-budget",
            "must be between 2000 and 1000000 characters",
        )?;
        check(self.code_cap >= 1 && self.code_cap <= 16 << 20, "--code-cap", "must be between 1 and 16 MiB")?;
        check(
            DEBIAN_SUITES.contains(&self.fallback_release.as_str()),
            "--fallback-release",
            format!(
                "{:?} is not a Debian suite pyberth knows: use one of {}",
                self.fallback_release,
                DEBIAN_SUITES.join(", ")
            ),
        )?;
        check(self.file_cap >= 1024 && self.file_cap <= 8 << 20, "--file-cap", "must be between 1 KiB and 8 MiB")?;
        check(self.install_timeout_s >= 10, "--install-timeout-s", "must be at least 10")?;
        check(self.max_packages >= 1, "--max-packages", "must be at least 1")?;
        Ok(())
    }

    /// The egress settings: budgets, pins, resolvers.
    fn validate_egress(&self) -> Result<(), Invalid> {
        check(self.egress_max_conns >= 1, "--egress-max-conns", "must be at least 1")?;
        for (name, addr) in &self.egress_pin {
            check(
                crate::egress::policy::normalize_host(name).is_some() && addr.parse::<std::net::IpAddr>().is_ok(),
                "egress_pin",
                format!("{name:?} = {addr:?}: give a host name and an IP address"),
            )?;
        }
        check(self.egress_dns.len() <= 3, "--egress-dns", "at most 3 servers (the C library asks no more)")?;
        for ip in &self.egress_dns {
            check(
                ip.parse::<std::net::IpAddr>()
                    .is_ok_and(|a| !a.is_loopback() && !a.is_unspecified() && !a.is_multicast()),
                "--egress-dns",
                format!(
                    "{ip:?} is not an address the proxy can ask: give IP addresses the proxy's container reaches \
                     (a loopback address would be the container's own)"
                ),
            )?;
        }
        Ok(())
    }

    /// The package settings: sdists, the installer, the index, its CA bundle.
    fn validate_packages(&self) -> Result<(), Invalid> {
        for p in &self.allow_sdist {
            check(
                p == ":all:" || crate::deps::parse(p).is_ok_and(|r| r.canonical == r.name),
                "--allow-sdist",
                format!("{p:?} is not a package name (or :all:)"),
            )?;
        }
        check(
            self.installer_uv == "none"
                || crate::deps::parse(&self.installer_uv).is_ok_and(|r| r.name == "uv" && !r.canonical.contains(';')),
            "--installer-uv",
            "must be none, or a requirement on uv such as uv or uv==0.13.9",
        )?;
        for (key, url) in [("--index-url", self.index_url()), ("--extra-index-url", self.extra_index_url())] {
            if let Some(url) = url {
                check(
                    (url.starts_with("https://") || url.starts_with("http://"))
                        && !url.chars().any(|c| c.is_whitespace() || c.is_control()),
                    key,
                    "must be an http(s) URL",
                )?;
            }
        }
        if let Some(ca) = self.ca_bundle() {
            check(ca.is_file(), "--ca-bundle", format!("{} is not a readable file", ca.display()))?;
        }
        Ok(())
    }
}

/// Debian suites debootstrap can make a base of (codenames and their aliases).
const DEBIAN_SUITES: [&str; 10] =
    ["buster", "bullseye", "bookworm", "trixie", "forky", "sid", "oldstable", "stable", "testing", "unstable"];
