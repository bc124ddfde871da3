//! Notebook habits get a useful answer (issue 28): code written for Jupyter runs here too.
//!
//! - `%pip install x` / `!pip install x` (and `pip3`, `python -m pip`) lines become requirements
//!   installed through the package path before the code runs; the line itself does nothing.
//! - `%matplotlib …` does nothing: figures come back as images anyway.
//! - Another `!command` line runs the command through the shell, as in IPython.
//! - After a failed run, pip in the code (which cannot install here), a failure to reach the
//!   network in an offline session (`urlopen`, requests, pip) and `input()` without a stdin
//!   each get a notice that says why and what to do instead.
//!
//! Pure: the rewrite keeps every line where it was, so tracebacks point at the caller's lines.

/// Code with its notebook lines rewritten, the requirements its `%pip install` lines named,
/// and what the caller should be told.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Rewritten {
    pub code: String,
    pub packages: Vec<String>,
    pub notices: Vec<String>,
}

/// pip options that change nothing for an install through the package path.
const HARMLESS: [&str; 9] = [
    "-q",
    "--quiet",
    "-U",
    "--upgrade",
    "--user",
    "--no-cache-dir",
    "-qq",
    "--progress-bar=off",
    "--no-warn-script-location",
];

/// The words of a pip invocation after `pip`, if `rest` (a line without its `%`/`!`) is one.
fn pip_words(rest: &str) -> Option<Vec<&str>> {
    let words: Vec<&str> = rest.split_whitespace().collect();
    match words.as_slice() {
        [pip, tail @ ..] if matches!(*pip, "pip" | "pip3") => Some(tail.to_vec()),
        [py, "-m", "pip", tail @ ..] if py.starts_with("python") || py.contains("sys.executable") => {
            Some(tail.to_vec())
        }
        _ => None,
    }
}

/// Rewrites the notebook lines of `code`; an error is one line saying what to do instead.
pub(super) fn rewrite(code: &str) -> Result<Rewritten, String> {
    let mut out = Rewritten::default();
    if !code.lines().any(|l| l.trim_start().starts_with(['%', '!'])) {
        out.code = code.to_owned();
        return Ok(out);
    }
    let mut lines = Vec::new();
    for line in code.split('\n') {
        let body = line.trim_start();
        let indent = &line[..line.len() - body.len()];
        let (sigil, rest) = match body.chars().next() {
            // `!=` and `% x` continue an expression of the line before: Python, not a magic.
            Some(c @ ('%' | '!')) if body[1..].starts_with(|n: char| n.is_ascii_alphabetic() || n == '{') => {
                (c, body[1..].trim_end())
            }
            _ => {
                lines.push(line.to_owned());
                continue;
            }
        };
        let shown: String = body.chars().take(80).collect();
        if let Some(words) = pip_words(rest) {
            match words.split_first() {
                Some((&"install", args)) => {
                    for a in args {
                        if a.starts_with('-') {
                            if !HARMLESS.contains(a) {
                                return Err(format!(
                                    "`{shown}`: pip option {a} is not available here; give the requirement strings \
                                     to install_packages (or run_python's packages)"
                                ));
                            }
                        } else {
                            out.packages.push(a.trim_matches(['"', '\'']).to_owned());
                        }
                    }
                    out.notices.push(format!(
                        "`{shown}`: installed through the package tool before the code ran (install_packages does \
                         the same)"
                    ));
                }
                _ => {
                    return Err(format!(
                        "`{shown}`: only `pip install` has a meaning here: install_packages installs, list_packages \
                         lists"
                    ));
                }
            }
            lines.push(format!("{indent}pass"));
        } else if sigil == '%' && rest.split_whitespace().next() == Some("matplotlib") {
            lines.push(format!("{indent}pass"));
        } else if sigil == '!' {
            let cmd = serde_json::to_string(rest).unwrap_or_default();
            lines.push(format!("{indent}__import__('subprocess').run({cmd}, shell=True)"));
        } else {
            return Err(format!(
                "`{shown}`: IPython magics are not available, only plain Python (`%pip install` and `%matplotlib` \
                 excepted); a `!command` line runs a shell command"
            ));
        }
    }
    out.code = lines.join("\n");
    Ok(out)
}

/// What a run that failed to install with pip in its own code should be told: pip there
/// cannot install (the system is read-only; a Debian Python refuses outright; the sandbox is
/// usually offline).
pub(super) fn pip_notice(said: &str) -> Option<String> {
    const SIGNS: [&str; 4] =
        ["externally-managed-environment", "No matching distribution found", "No module named pip", "pip: not found"];
    SIGNS.iter().any(|s| said.contains(s)).then(|| {
        "pip in the code cannot install into the sandbox: install_packages (or run_python's packages) installs \
         through the package tool, and %pip install x lines do the same"
            .to_owned()
    })
}

/// What an offline session's run should be told about its failure, if it failed for want of a
/// network.
pub(super) fn offline_notice(said: &str) -> Option<String> {
    const SIGNS: [&str; 7] = [
        "Temporary failure in name resolution",
        "Name or service not known",
        "Network is unreachable",
        "Failed to establish a new connection",
        "urlopen error",
        "Could not fetch URL",
        "No address associated with hostname",
    ];
    SIGNS.iter().any(|s| said.contains(s)).then(|| {
        "this session is offline: the sandbox has no network. Install packages with install_packages (or \
         run_python's packages); to reach other hosts, use an environment whose egress allows them \
         (list_environments)"
            .to_owned()
    })
}

/// The notice for `input()` in a sandbox, whose stdin is empty.
pub(super) fn stdin_notice(kind: &str, message: &str) -> Option<String> {
    (kind == "EOFError" && message.contains("when reading a line")).then(|| {
        "input() has no stdin here: no one can type into the sandbox. Put the data in the code, in a file \
         (write_file), or in env"
            .to_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_python_is_untouched() {
        let code = "x = (1\n     % 2)\ny = (x\n != 3)\n";
        assert_eq!(rewrite(code).expect("plain").code, code);
    }

    #[test]
    fn pip_lines_become_requirements_and_keep_the_line_numbers() {
        let r = rewrite(
            "%pip install -q six 'attrs>=23'\nimport six\nif True:\n    !pip3 install tomli\n%matplotlib inline",
        )
        .expect("rewritten");
        assert_eq!(r.packages, ["six", "attrs>=23", "tomli"]);
        assert_eq!(r.code, "pass\nimport six\nif True:\n    pass\npass");
        assert_eq!(r.notices.len(), 2);
        let r = rewrite("!python -m pip install six").expect("python -m pip");
        assert_eq!(r.packages, ["six"]);
    }

    #[test]
    fn what_has_no_meaning_here_says_what_to_do() {
        assert!(rewrite("%pip install -r req.txt").expect_err("-r").contains("install_packages"));
        assert!(rewrite("!pip list").expect_err("list").contains("list_packages"));
        assert!(rewrite("%timeit 1 + 1").expect_err("magic").contains("not available"));
    }

    #[test]
    fn a_shell_line_runs_in_the_shell() {
        let r = rewrite("!echo \"hi\" $HOME").expect("shell");
        assert_eq!(r.code, "__import__('subprocess').run(\"echo \\\"hi\\\" $HOME\", shell=True)");
    }

    #[test]
    fn network_failures_and_stdin_are_explained() {
        assert!(offline_notice("URLError: <urlopen error [Errno -3] Temporary failure in name resolution>").is_some());
        assert!(offline_notice("ValueError: 3").is_none());
        assert!(pip_notice("error: externally-managed-environment").is_some());
        assert!(stdin_notice("EOFError", "EOF when reading a line").is_some());
    }
}
