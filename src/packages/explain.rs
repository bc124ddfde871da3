//! A failed install said in the caller's terms: which requirement, and what to do.

use super::{Error, IndexSettings};

/// The text of `all` between `start` and the first `end` after it.
pub(super) fn between<'a>(all: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let from = all.find(start)? + start.len();
    let len = all[from..].find(end)?;
    Some(&all[from..from + len]).filter(|s| !s.is_empty() && s.len() <= 120)
}

/// The package a uv "no usable wheels" resolution names (`docopt`, from `docopt==0.6.2`).
pub(super) fn no_wheel_package(all: &str) -> Option<String> {
    let named = between(all, "Wheels are required for `", "`")
        .or_else(|| between(all, "all versions of ", " have no usable wheels"))
        .or_else(|| {
            let at = all.find(" has no usable wheels")?;
            all[..at].rsplit(|c: char| c.is_whitespace()).next()
        })?;
    let name = named.split(|c: char| "=<>!~;[ ".contains(c)).next()?;
    Some(crate::deps::normalize_name(name)).filter(|n| !n.is_empty())
}

/// How to allow building `package` from source, in the words of each place it can be said.
pub(super) fn opt_in(package: &str) -> String {
    format!(
        "building from source is off by default because it runs the package's own code in the installer. \
         If you trust {package}, ask the operator to allow it: `--allow-sdist {package}` \
         (PYBERTH_ALLOW_SDIST={package}), or `allow_sdist = [\"{package}\"]` at the top of the config file or in \
         an `[environments.NAME]` table. Otherwise pick a version of {package} that ships a wheel for this \
         Python, or a package that does"
    )
}

/// Turns pip's or uv's last lines into a short message a model can act on, naming the
/// requirement at fault where the installer does.
/// `refused`: what the installer's proxy refused or could not reach, in its words: an
/// installer that reaches the index only through the proxy never sees a connection error of
/// its own, pip least of all (an HTTP error on the index page reads to it as "no versions").
pub(super) fn explain(tail: &[String], index: &IndexSettings, wheels_only: bool, refused: &[String]) -> Error {
    // Our own notices (the pip fallback's reason quotes pip's words about uv) are not the
    // installer's verdict on the requirements.
    let all = tail.iter().filter(|l| !l.starts_with("pyberth:")).cloned().collect::<Vec<_>>().join("\n");
    let index_name = index.index_url.as_deref().unwrap_or("https://pypi.org/simple");
    let unreachable = || {
        format!(
            "the package index {index_name} could not be reached (network, proxy or CA bundle: \
             see --index-url and --ca-bundle)"
        )
    };
    let network = [
        // pip
        "Failed to establish a new connection",
        "Network is unreachable",
        "Temporary failure in name resolution",
        "CERTIFICATE_VERIFY_FAILED",
        "SSLError",
        "ProxyError",
        // uv
        "tcp connect error",
        "dns error",
        "invalid peer certificate",
        "Request failed after",
        "error sending request for url",
    ];
    let what = if !refused.is_empty() {
        let shown: Vec<&str> = refused.iter().take(3).map(String::as_str).collect();
        format!(
            "the package index {index_name} could not be reached through the installer's proxy ({}): check \
             --index-url, and pin an index on a private address with egress_pin",
            shown.join("; ")
        )
    } else if network.iter().any(|n| all.contains(n)) {
        unreachable()
    } else if let Some(p) = no_wheel_package(&all) {
        format!("{p} ships no wheel for this Python and platform, only source; {}", opt_in(&p))
    } else if let Some(p) = between(&all, "Because ", " was not found in the package registry") {
        format!("no such package on the index {index_name}: {p} (check the name)")
    } else if let Some(r) = between(&all, "there is no version of ", " and ") {
        format!("no version of {r} on the index {index_name}: relax the version constraint")
    } else if let Some(r) = between(&all, "satisfies the requirement ", " (from versions: none)") {
        // pip says the same of a package that is not there and of one with no usable file.
        if wheels_only {
            let name = r.split(|c: char| "=<>!~;[ ".contains(c)).next().unwrap_or(r);
            let name = crate::deps::normalize_name(name);
            format!(
                "no such package on the index {index_name}: {name} (check the name), or none of its versions \
                 ships a wheel for this Python and platform. If it ships only source, {}",
                opt_in(&name)
            )
        } else {
            format!("no such package on the index {index_name}: {r} (check the name)")
        }
    } else if let Some(r) = between(&all, "satisfies the requirement ", " (from versions:") {
        format!("no version of {r} on the index {index_name}: relax the version constraint")
    } else if all.contains("No solution found when resolving")
        || all.contains("ResolutionImpossible")
        || all.contains("conflicting dependencies")
    {
        "the requested packages have conflicting dependencies (see the installer's output below)".to_owned()
    } else if all.contains("No matching distribution found") || all.contains("Could not find a version") {
        "no such package, or no version matching the constraint, on the index".to_owned()
    } else if all.contains("Failed building wheel")
        || all.contains("subprocess-exited-with-error")
        || all.contains("Failed to build")
    {
        "a package failed to build (it may need a compiler or system libraries the sandbox lacks; \
         try a version that ships a wheel)"
            .to_owned()
    } else {
        "the installer failed".to_owned()
    };
    let last: Vec<&String> = tail.iter().rev().take(8).collect::<Vec<_>>().into_iter().rev().collect();
    let tail = last.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n");
    Error::Installer { what, tail }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real output of uv 0.13.9 and pip 23.0.1 (Debian bookworm's), captured from the
    /// installer's command against PyPI through this machine's proxy.
    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_owned).collect()
    }

    fn what(tail: &str, wheels_only: bool) -> String {
        match explain(&lines(tail), &IndexSettings::default(), wheels_only, &[]) {
            Error::Installer { what, .. } => what,
            e => panic!("not an installer error: {e}"),
        }
    }

    const UV_NO_WHEEL: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because all versions of docopt have no usable wheels and you require docopt, we can conclude that your requirements are unsatisfiable.

hint: Wheels are required for `docopt` because building from source is disabled for all packages (i.e., with `--no-build`)";

    const UV_NOT_FOUND: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because no-such-package-pyberth-xyz was not found in the package registry and you require no-such-package-pyberth-xyz, we can conclude that your requirements are unsatisfiable.";

    const UV_NO_VERSION: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because there is no version of idna==999.0 and you require idna==999.0, we can conclude that your requirements are unsatisfiable.";

    const UV_CONFLICT: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: No solution found when resolving dependencies
  cause: Because requests==2.31.0 depends on urllib3>=1.21.1,<3 and you require requests==2.31.0, we can conclude that you require urllib3>=1.21.1,<3.
         And because you require urllib3==1.0, we can conclude that your requirements are unsatisfiable.";

    const UV_REFUSED: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: Request failed after 3 retries in 6.5s
  cause: Failed to fetch: https://127.0.0.1:9/simple/idna/
  cause: error sending request for url (https://127.0.0.1:9/simple/idna/)
  cause: client error (Connect)
  cause: tcp connect error
  cause: Connection refused (os error 111)";

    const UV_BAD_CA: &str = "Using CPython 3.11.2 interpreter at: /usr/bin/python3
error: Failed to fetch: https://pypi.org/simple/idna/
  cause: error sending request for url (https://pypi.org/simple/idna/)
  cause: client error (Connect)
  cause: invalid peer certificate: UnknownIssuer

hint: Consider enabling use of system TLS certificates with the `--system-certs` command-line flag";

    const PIP_NO_WHEEL: &str =
        "ERROR: Could not find a version that satisfies the requirement docopt (from versions: none)
ERROR: No matching distribution found for docopt";

    const PIP_NO_VERSION: &str = "ERROR: Could not find a version that satisfies the requirement idna==999.0 (from versions: 2.0, 2.1, 3.19, 3.20)
ERROR: No matching distribution found for idna==999.0";

    #[test]
    fn uv_failures_name_the_requirement_and_what_to_do() {
        let w = what(UV_NO_WHEEL, true);
        assert!(w.starts_with("docopt ships no wheel"), "{w}");
        assert!(w.contains("--allow-sdist docopt") && w.contains("allow_sdist = [\"docopt\"]"), "{w}");
        let w = what(UV_NOT_FOUND, true);
        assert!(w.contains("no such package on the index https://pypi.org/simple: no-such-package-pyberth-xyz"), "{w}");
        let w = what(UV_NO_VERSION, true);
        assert!(w.contains("no version of idna==999.0"), "{w}");
        let w = what(UV_CONFLICT, true);
        assert!(w.contains("conflicting dependencies"), "{w}");
        for unreachable in [UV_REFUSED, UV_BAD_CA] {
            let w = what(unreachable, true);
            assert!(w.contains("could not be reached") && w.contains("--ca-bundle"), "{w}");
        }
    }

    #[test]
    fn pip_failures_name_the_requirement_and_the_opt_in_when_wheels_only() {
        let w = what(PIP_NO_WHEEL, true);
        assert!(w.contains("no such package on the index https://pypi.org/simple: docopt"), "{w}");
        assert!(w.contains("--allow-sdist docopt"), "{w}");
        let w = what(PIP_NO_WHEEL, false);
        assert!(w.contains("no such package on the index https://pypi.org/simple: docopt"), "{w}");
        assert!(!w.contains("allow-sdist"), "{w}");
        let w = what(PIP_NO_VERSION, true);
        assert!(w.contains("no version of idna==999.0"), "{w}");
        assert_eq!(no_wheel_package("Because docopt==0.6.2 has no usable wheels and"), Some("docopt".into()));
    }
}
