//! Checks on caller input, done before any Docker call, shared by both front ends (the MCP
//! tools in [`crate::server`] and `pyberth run` in [`crate::runner`]): session names, code,
//! time limits, requirements, workspace paths, environment variables, resource URIs.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::SandboxConfig;
use crate::deps;

/// The session used when a call names none.
pub(crate) const DEFAULT_SESSION: &str = "default";

/// Validates a session name, defaulting to [`DEFAULT_SESSION`].
pub(crate) fn session_name(arg: Option<&str>) -> Result<String, String> {
    let name = arg.unwrap_or(DEFAULT_SESSION);
    let ok = !name.is_empty()
        && name.len() <= 40
        && name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(name.to_owned())
    } else {
        let shown: String = name.chars().take(60).collect();
        Err(format!(
            "invalid session name {shown:?}: use 1-40 letters, digits, '.', '_' or '-', starting with a letter or digit"
        ))
    }
}

/// Checks code before any container is touched.
pub(crate) fn check_code(code: &str, cap: usize) -> Result<(), String> {
    if code.trim().is_empty() {
        return Err("code is empty: pass the Python source to run".into());
    }
    if code.len() > cap {
        return Err(format!("code is {} bytes, over the limit of {cap} bytes: split it into several runs", code.len()));
    }
    if let Some(pos) = code.find('\0') {
        return Err(format!("code contains a NUL byte at offset {pos}: remove it"));
    }
    Ok(())
}

/// Resolves a requested time limit against `cfg` (the server's, or a session's environment's
/// settings): its default when none is asked for, an error past its maximum.
pub(crate) fn check_timeout(timeout_s: Option<f64>, cfg: &SandboxConfig) -> Result<Duration, String> {
    match timeout_s {
        None => Ok(cfg.timeout()),
        Some(t) if t.is_finite() && t > 0.0 && t <= cfg.max_timeout_s as f64 => Ok(Duration::from_secs_f64(t)),
        Some(t) => Err(format!(
            "timeout_s {t} is out of range: give a number of seconds above 0 and at most {}",
            cfg.max_timeout_s
        )),
    }
}

/// How a run call waits: `None` to the end, or up to a limit before answering with a job handle.
pub(crate) fn check_wait(
    wait_s: Option<f64>,
    background: bool,
    cfg: &SandboxConfig,
) -> Result<Option<Duration>, String> {
    match (wait_s, background) {
        (Some(_), true) => Err("give wait_s or background, not both (background is wait_s 0)".into()),
        (None, true) => Ok(Some(Duration::ZERO)),
        (None, false) => Ok(None),
        (Some(w), false) if w.is_finite() && (0.0..=cfg.max_timeout_s as f64).contains(&w) => {
            Ok(Some(Duration::from_secs_f64(w)))
        }
        (Some(w), false) => Err(format!("wait_s {w} is out of range: give seconds from 0 to {}", cfg.max_timeout_s)),
    }
}

/// Validates requested packages plus those declared inline (PEP 723) in `code`.
pub(crate) fn wanted_packages(
    packages: Option<&[String]>,
    code: Option<&str>,
    max: usize,
) -> Result<Vec<String>, String> {
    let mut wanted: Vec<String> = packages.map(|p| p.to_vec()).unwrap_or_default();
    if let Some(code) = code {
        wanted.extend(deps::inline_dependencies(code)?);
    }
    deps::parse_set(&wanted, max).map_err(|e| e.to_string())
}

/// Longest workspace path accepted.
const MAX_PATH: usize = 1024;
/// Longest path component (the usual file system limit).
const MAX_NAME: usize = 255;

/// Normalises a workspace-relative path: no absolute paths, no `..`, no NUL, backslashes or
/// control characters, no overlong names. `.` and empty components are dropped. An empty
/// result means the workspace itself, allowed only with `allow_root`.
pub(crate) fn check_path(path: &str, allow_root: bool) -> Result<String, String> {
    let shown: String = path.chars().take(80).collect();
    if path.len() > MAX_PATH {
        return Err(format!("path {shown:?}... is longer than {MAX_PATH} bytes"));
    }
    // Any other byte is a legal name the code may have made: every file it lists must be
    // readable and deletable through the tools. Names are escaped where they are shown.
    if path.contains('\0') {
        return Err(format!("path {shown:?} contains a NUL byte"));
    }
    if path.starts_with('/') {
        return Err(format!(
            "path {shown:?} is absolute: give a path relative to the workspace (/workspace), e.g. data/out.csv"
        ));
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(format!("path {shown:?} uses '..': paths must stay inside the workspace")),
            p if p.len() > MAX_NAME => return Err(format!("path {shown:?} has a name longer than {MAX_NAME} bytes")),
            p => parts.push(p),
        }
    }
    if parts.is_empty() && !allow_root {
        if path.trim().is_empty() {
            return Err("path is empty: name a file in the workspace, e.g. main.py".into());
        }
        return Err(format!(
            "path {shown:?} is the workspace itself, not a file in it: name a file, e.g. main.py (list_files shows \
             what is there)"
        ));
    }
    Ok(if parts.is_empty() { ".".into() } else { parts.join("/") })
}

/// Variables that would let a caller hijack the dynamic loader, the interpreter or a shell.
const DENIED: [&str; 18] = [
    "PATH",
    "HOME",
    "PYTHONSTARTUP",
    "PYTHONHOME",
    "PYTHONPATH",
    "PYTHONINSPECT",
    "PYTHONEXECUTABLE",
    "PYTHONUSERBASE",
    "PYTHONPLATLIBDIR",
    "PYTHONSAFEPATH",
    "BASH_ENV",
    "ENV",
    "GLIBC_TUNABLES",
    "NODE_OPTIONS",
    "PERL5OPT",
    "RUBYOPT",
    "IFS",
    "SHELLOPTS",
];

/// Checks environment variables from a caller.
pub(crate) fn check_env(vars: &BTreeMap<String, String>) -> Result<(), String> {
    if vars.len() > 100 {
        return Err(format!("{} environment variables given; at most 100", vars.len()));
    }
    let mut total = 0;
    for (name, value) in vars {
        let valid = !name.is_empty()
            && name.len() <= 128
            && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            let shown: String = name.chars().take(60).collect();
            return Err(format!("environment variable name {shown:?} is invalid: use letters, digits and '_'"));
        }
        if name.starts_with("LD_") || name.starts_with("DYLD_") || DENIED.contains(&name.as_str()) {
            return Err(format!("environment variable {name} is refused: it can hijack the loader or the interpreter"));
        }
        if crate::docker::container::ENV.iter().any(|fixed| fixed.split('=').next() == Some(name.as_str())) {
            return Err(format!("environment variable {name} is fixed by the sandbox and cannot be set"));
        }
        if value.contains('\0') {
            return Err(format!("environment variable {name} contains a NUL byte"));
        }
        total += name.len() + value.len();
    }
    if total > 64 << 10 {
        return Err("environment variables total more than 64 KiB".into());
    }
    Ok(())
}

/// Parses `.env` text: `KEY=VALUE` lines, optional `export `, `#` comments and blank lines.
/// A value in double quotes may span lines and takes the escapes `\n`, `\t`, `\"` and `\\`;
/// one in single quotes may span lines and is taken literally; an unquoted one ends at the
/// line's end (or at ` #`, a comment).
pub(crate) fn parse_dotenv(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut vars = BTreeMap::new();
    let mut lines = text.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").unwrap_or(line);
        let Some((key, rest)) = line.split_once('=') else {
            return Err(format!("env_file line {}: expected KEY=VALUE", n + 1));
        };
        let rest = rest.trim_start();
        let value = match rest.chars().next() {
            Some(q @ ('"' | '\'')) => {
                // Read to the closing quote, across lines if need be.
                let mut value = String::new();
                let mut chars: Vec<char> = rest[1..].chars().collect();
                let mut i = 0;
                loop {
                    if i == chars.len() {
                        let Some((_, next)) = lines.next() else {
                            return Err(format!("env_file line {}: the {q} quote is never closed", n + 1));
                        };
                        value.push('\n');
                        chars = next.chars().collect();
                        i = 0;
                        continue;
                    }
                    let c = chars[i];
                    i += 1;
                    if c == q {
                        break;
                    }
                    if q == '"' && c == '\\' && i < chars.len() {
                        let e = chars[i];
                        i += 1;
                        value.push(match e {
                            'n' => '\n',
                            't' => '\t',
                            'r' => '\r',
                            other => other,
                        });
                        continue;
                    }
                    value.push(c);
                }
                value
            }
            _ => rest.split(" #").next().unwrap_or_default().trim_end().to_owned(),
        };
        vars.insert(key.trim().to_owned(), value);
    }
    Ok(vars)
}

/// URI of a workspace file as an MCP resource; the path percent-encoded but for its `/`.
pub(crate) fn resource_uri(session: &str, path: &str) -> String {
    let mut uri = format!("pyberth://sessions/{session}/files/");
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            uri.push(char::from(b));
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri
}

/// Splits a resource URI into (session, path).
pub(crate) fn parse_resource_uri(uri: &str) -> Option<(String, String)> {
    let rest = uri.strip_prefix("pyberth://sessions/")?;
    let (session, path) = rest.split_once("/files/")?;
    Some((session.to_owned(), percent_decode(path)?))
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_names() {
        assert_eq!(session_name(None).as_deref(), Ok("default"));
        assert_eq!(session_name(Some("a.b_c-1")).as_deref(), Ok("a.b_c-1"));
        for bad in ["", "-x", "a b", "a/b", "é", &"x".repeat(41), "a\nb"] {
            let e = session_name(Some(bad)).expect_err(bad);
            assert!(e.contains("invalid session name"), "{e}");
        }
    }

    #[test]
    fn code_checks() {
        assert!(check_code("print(1)", 100).is_ok());
        assert!(check_code("  \n", 100).expect_err("empty").contains("empty"));
        assert!(check_code("x = 1\0", 100).expect_err("nul").contains("offset 5"));
        assert!(check_code(&"x".repeat(101), 100).expect_err("big").contains("over the limit"));
    }

    #[test]
    fn timeout_checks() {
        let cfg = crate::config::from_flags(&[]);
        assert_eq!(check_timeout(None, &cfg), Ok(Duration::from_secs(60)));
        assert_eq!(check_timeout(Some(2.5), &cfg), Ok(Duration::from_millis(2500)));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
            assert!(check_timeout(Some(bad), &cfg).expect_err("bad").contains("out of range"));
        }
        assert_eq!(check_wait(None, false, &cfg), Ok(None));
        assert_eq!(check_wait(None, true, &cfg), Ok(Some(Duration::ZERO)));
        assert_eq!(check_wait(Some(2.5), false, &cfg), Ok(Some(Duration::from_millis(2500))));
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e12] {
            assert!(check_wait(Some(bad), false, &cfg).expect_err("bad").contains("wait_s"), "{bad}");
        }
        assert!(check_wait(Some(1.0), true, &cfg).is_err(), "wait_s with background");
    }

    #[test]
    fn paths() {
        assert_eq!(check_path("a/./b//c.txt", false).as_deref(), Ok("a/b/c.txt"));
        assert_eq!(check_path("", true).as_deref(), Ok("."));
        assert_eq!(check_path("./", true).as_deref(), Ok("."));
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "a\0b", &"x".repeat(256), &"a/".repeat(600)] {
            assert!(check_path(bad, false).is_err(), "{bad:?} accepted");
        }
        for odd in ["a\\b", "a\nb", "\x1b]0;t\x07"] {
            assert_eq!(check_path(odd, false).as_deref(), Ok(odd), "a name the code can make is usable");
        }
        assert!(check_path("/x", false).expect_err("abs").contains("relative to the workspace"));
    }

    #[test]
    fn env_names_and_values() {
        let one = |k: &str, v: &str| BTreeMap::from([(k.to_owned(), v.to_owned())]);
        assert!(check_env(&one("API_URL", "http://x")).is_ok());
        for bad in
            ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONSTARTUP", "PYTHONHOME", "BASH_ENV", "PATH", "GLIBC_TUNABLES"]
        {
            let e = check_env(&one(bad, "x")).expect_err(bad);
            assert!(e.contains(bad) && e.contains("refused"), "{e}");
        }
        for bad in ["1X", "A-B", "", "A B"] {
            assert!(check_env(&one(bad, "x")).is_err(), "{bad:?}");
        }
        assert!(check_env(&one("A", "x\0y")).is_err());
    }

    #[test]
    fn dotenv() {
        let vars = parse_dotenv("# c\nA=1\nexport B = \"two words\"\nC='x=y'\n\nD=").expect("ok");
        assert_eq!(vars["A"], "1");
        assert_eq!(vars["B"], "two words");
        assert_eq!(vars["C"], "x=y");
        assert_eq!(vars["D"], "");
        assert!(parse_dotenv("A=1\nnonsense\n").expect_err("bad").contains("line 2"));
        let v = parse_dotenv("K=\"it's \\\"quoted\\\"\nsecond line\\tx\"\nL='a \"b\"\nc'\nM=plain # note\nN=1")
            .expect("multi-line");
        assert_eq!(v["K"], "it's \"quoted\"\nsecond line\tx");
        assert_eq!(v["L"], "a \"b\"\nc");
        assert_eq!(v["M"], "plain");
        assert_eq!(v["N"], "1", "lines after a multi-line value are read");
        assert!(parse_dotenv("K=\"open\n").expect_err("unclosed").contains("never closed"));
        let fixed = BTreeMap::from([("PYTHONDONTWRITEBYTECODE".to_owned(), String::new())]);
        assert!(check_env(&fixed).expect_err("fixed").contains("fixed by the sandbox"));
    }

    #[test]
    fn resource_uris() {
        let uri = resource_uri("s1", "data/out.csv");
        assert_eq!(parse_resource_uri(&uri), Some(("s1".into(), "data/out.csv".into())));
        assert_eq!(parse_resource_uri("pyberth://sessions/s/files/a%20b.txt"), Some(("s".into(), "a b.txt".into())));
        assert_eq!(parse_resource_uri("file:///etc/passwd"), None);
        let odd = "dir/a b\n%.txt";
        let uri = resource_uri("s", odd);
        assert_eq!(uri, "pyberth://sessions/s/files/dir/a%20b%0A%25.txt");
        assert_eq!(parse_resource_uri(&uri), Some(("s".into(), odd.into())));
        assert_eq!(parse_resource_uri("pyberth://sessions/s/files/%zz"), None);
    }
}
