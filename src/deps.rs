//! Dependency sets: validation of requirement strings and their canonical form.
//!
//! Only PEP 508 requirements made of a name, optional extras, version specifiers and an
//! environment marker are accepted. Options (`-e`, `--index-url`, `-r`), URLs, `@` direct
//! references, local paths and whitespace tricks are refused before anything runs: the
//! strings go on an installer's command line, and the set's hash names a shared layer.

use std::collections::BTreeMap;

/// A refused requirement; the message names the entry and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Error {
    /// Too many requirements.
    #[error("{count} packages requested, more than the limit of {max}: install them in several steps")]
    TooMany {
        /// How many were asked for.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A requirement that is not of the accepted form.
    #[error("{entry:?} is not a valid requirement: {why}")]
    Refused {
        /// The entry as given (shortened).
        entry: String,
        /// Why.
        why: String,
    },
    /// Two entries for one package with different constraints.
    #[error("packages {first:?} and {second:?} name the same package with different constraints: keep one")]
    Conflict {
        /// First entry.
        first: String,
        /// Second entry.
        second: String,
    },
}

/// One validated requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Requirement {
    /// Normalised name (PEP 503: lowercase, runs of `-_.` as `-`).
    pub name: String,
    /// Canonical text: normalised name, sorted extras, specifiers and marker without spaces.
    pub canonical: String,
}

fn refused(entry: &str, why: impl Into<String>) -> Error {
    let entry: String = entry.chars().take(80).collect();
    Error::Refused { entry, why: why.into() }
}

/// PEP 503 normalisation.
pub(crate) fn normalize_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut sep = false;
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            sep = true;
        } else {
            if sep && !out.is_empty() {
                out.push('-');
            }
            sep = false;
            out.push(c.to_ascii_lowercase());
        }
    }
    out
}

fn is_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 100
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

const OPS: [&str; 8] = ["===", "==", "!=", "<=", ">=", "~=", "<", ">"];

/// Parses a specifier list such as `>=1.2,<2` (spaces already removed).
fn canonical_specifiers(entry: &str, spec: &str) -> Result<String, Error> {
    let spec = spec.strip_prefix('(').and_then(|s| s.strip_suffix(')')).unwrap_or(spec);
    let mut parts: Vec<String> = Vec::new();
    for clause in spec.split(',') {
        let Some(op) = OPS.iter().find(|op| clause.starts_with(**op)) else {
            return Err(refused(entry, "expected a version constraint such as ==1.2 or >=1,<2"));
        };
        let version = &clause[op.len()..];
        if version.is_empty()
            || version.len() > 64
            || !version.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '*' | '+' | '!' | '_' | '-'))
        {
            return Err(refused(entry, "the version is not a plain version number"));
        }
        parts.push(format!("{op}{version}"));
    }
    parts.sort();
    Ok(parts.join(","))
}

fn check_marker(entry: &str, marker: &str) -> Result<String, Error> {
    let ok = !marker.trim().is_empty()
        && marker.len() <= 200
        && marker.chars().all(|c| {
            c.is_ascii_alphanumeric()
                || matches!(c, ' ' | '\'' | '"' | '.' | '_' | '-' | '<' | '>' | '=' | '!' | '(' | ')' | '~' | ',' | '*')
        });
    if !ok {
        return Err(refused(
            entry,
            "after ';' comes an environment marker such as python_version < \"3.12\", and this one has characters \
             a marker never has (a requirement is not a shell command)",
        ));
    }
    // Outside quotes, a marker holds only its variables and operators.
    const WORDS: [&str; 16] = [
        "python_version",
        "python_full_version",
        "os_name",
        "sys_platform",
        "platform_release",
        "platform_system",
        "platform_version",
        "platform_machine",
        "platform_python_implementation",
        "implementation_name",
        "implementation_version",
        "extra",
        "and",
        "or",
        "in",
        "not",
    ];
    let mut quote: Option<char> = None;
    let mut word = String::new();
    for c in marker.chars().chain(std::iter::once(' ')) {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => quote = Some(c),
            None if c.is_ascii_alphanumeric() || c == '_' || c == '.' => word.push(c),
            None => {
                if !word.is_empty()
                    && !WORDS.contains(&word.as_str())
                    && !word.starts_with(|d: char| d.is_ascii_digit())
                {
                    return Err(refused(entry, "the environment marker uses a word that is not a marker variable"));
                }
                word.clear();
            }
        }
    }
    if quote.is_some() {
        return Err(refused(entry, "the environment marker has an unclosed quote"));
    }
    // Collapse runs of spaces so equivalent markers hash alike.
    Ok(marker.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// Validates one requirement string.
pub(crate) fn parse(entry: &str) -> Result<Requirement, Error> {
    if entry.len() > 300 {
        return Err(refused(entry, "longer than 300 characters"));
    }
    if entry.chars().any(|c| c.is_control() || (!c.is_ascii() && c.is_whitespace())) {
        return Err(refused(entry, "contains control characters or line breaks"));
    }
    let trimmed = entry.trim();
    if trimmed.is_empty() {
        return Err(refused(entry, "empty"));
    }
    if trimmed.starts_with('-') {
        return Err(refused(entry, "installer options are not accepted; give only package requirements"));
    }
    if let Some((_, m)) = trimmed.split_once(';') {
        check_marker(entry, m)?;
    }
    if trimmed.contains("://") || trimmed.contains('@') {
        return Err(refused(entry, "URLs and direct references (@) are not accepted; give a package name and version"));
    }
    if trimmed.contains('/') || trimmed.contains('\\') || trimmed.starts_with('.') || trimmed.starts_with('~') {
        return Err(refused(entry, "local paths are not accepted; give a package name from the index"));
    }
    let (req, marker) = match trimmed.split_once(';') {
        Some((r, m)) => (r, Some(check_marker(entry, m)?)),
        None => (trimmed, None),
    };
    let req = req.trim();
    let name_end =
        req.find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))).unwrap_or(req.len());
    let (name, rest) = req.split_at(name_end);
    // Spaces may separate the parts, never sit inside a name or version.
    let rest: String = rest.chars().filter(|c| *c != ' ').collect();
    let rest = rest.as_str();
    if !is_name(name) {
        return Err(refused(entry, "not a package name (letters, digits, '-', '_', '.')"));
    }
    let (extras, spec) = if let Some(rest) = rest.strip_prefix('[') {
        let Some((inner, after)) = rest.split_once(']') else {
            return Err(refused(entry, "unclosed [extras]"));
        };
        let mut extras: Vec<String> = Vec::new();
        for e in inner.split(',').filter(|e| !e.is_empty()) {
            if !is_name(e) {
                return Err(refused(entry, "an extra is not a name"));
            }
            extras.push(normalize_name(e));
        }
        extras.sort();
        extras.dedup();
        (extras, after)
    } else {
        (Vec::new(), rest)
    };
    if !spec.is_empty() && !spec.starts_with('(') && !OPS.iter().any(|op| spec.starts_with(op)) {
        // Say what broke the name, not what a constraint would have needed.
        let bad = match req[name_end..].chars().next() {
            Some(' ') | None => "a space".to_owned(),
            Some(c) => format!("{c:?}"),
        };
        return Err(refused(
            entry,
            format!("{bad} after the name {name:?}: a name has only letters, digits, '-', '_' and '.'"),
        ));
    }
    let spec = if spec.is_empty() { String::new() } else { canonical_specifiers(entry, spec)? };
    let name = normalize_name(name);
    let mut canonical = name.clone();
    if !extras.is_empty() {
        canonical.push_str(&format!("[{}]", extras.join(",")));
    }
    canonical.push_str(&spec);
    if let Some(m) = marker {
        canonical.push_str(&format!("; {m}"));
    }
    Ok(Requirement { name, canonical })
}

/// The environment marker of a canonical requirement (`six; python_version < '3'`), if any.
pub(crate) fn marker_of(canonical: &str) -> Option<&str> {
    canonical.split_once(';').map(|(_, m)| m.trim()).filter(|m| !m.is_empty())
}

/// Validates a list: each entry, the count, and duplicates (identical ones merge; different
/// constraints on one package are refused). Returns the canonical strings, sorted.
pub(crate) fn parse_set(entries: &[String], max: usize) -> Result<Vec<String>, Error> {
    if entries.len() > max {
        return Err(Error::TooMany { count: entries.len(), max });
    }
    let mut by_name: BTreeMap<String, (String, String)> = BTreeMap::new();
    for entry in entries {
        let r = parse(entry)?;
        match by_name.get(&r.name) {
            Some((canonical, first)) if *canonical != r.canonical => {
                return Err(Error::Conflict { first: first.clone(), second: entry.clone() });
            }
            Some(_) => {}
            None => {
                by_name.insert(r.name.clone(), (r.canonical, entry.clone()));
            }
        }
    }
    let mut set: Vec<String> = by_name.into_values().map(|(c, _)| c).collect();
    set.sort();
    Ok(set)
}

/// Dependencies declared by PEP 723 inline script metadata (`# /// script` ... `# ///`), or
/// an empty list when the code has none. Only the `dependencies` array is read.
pub(crate) fn inline_dependencies(code: &str) -> Result<Vec<String>, String> {
    let mut lines = code.lines();
    let mut body = String::new();
    let mut found = false;
    for line in lines.by_ref() {
        if line.trim_end() == "# /// script" {
            found = true;
            break;
        }
    }
    if !found {
        return Ok(Vec::new());
    }
    let mut closed = false;
    for line in lines {
        let line = line.trim_end();
        if line == "# ///" {
            closed = true;
            break;
        }
        let Some(content) = line.strip_prefix("# ").or_else(|| (line == "#").then_some("")) else {
            return Err("inline script metadata: every line inside `# /// script` must start with '# '".into());
        };
        body.push_str(content);
        body.push('\n');
    }
    if !closed {
        return Err("inline script metadata: the `# /// script` block has no closing `# ///` line".into());
    }
    let Some(start) = body.find("dependencies") else { return Ok(Vec::new()) };
    let after = body[start + "dependencies".len()..].trim_start();
    let Some(after) = after.strip_prefix('=') else {
        return Err("inline script metadata: expected `dependencies = [...]`".into());
    };
    let after = after.trim_start();
    let Some(after) = after.strip_prefix('[') else {
        return Err("inline script metadata: `dependencies` must be an array of strings".into());
    };
    let Some(end) = after.find(']') else {
        return Err("inline script metadata: unclosed `dependencies` array".into());
    };
    let mut deps = Vec::new();
    let mut rest = &after[..end];
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
        if rest.is_empty() {
            break;
        }
        let quote = rest.chars().next().unwrap_or('"');
        if quote != '"' && quote != '\'' {
            return Err("inline script metadata: `dependencies` must hold quoted strings".into());
        }
        let Some(close) = rest[1..].find(quote) else {
            return Err("inline script metadata: unterminated string in `dependencies`".into());
        };
        deps.push(rest[1..1 + close].to_owned());
        rest = &rest[close + 2..];
    }
    Ok(deps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_forms_are_canonicalised() {
        let c = |s: &str| parse(s).expect(s).canonical;
        assert_eq!(c("six"), "six");
        assert_eq!(c("Flask_SQLAlchemy"), "flask-sqlalchemy");
        assert_eq!(c("requests [socks, security] >= 2.0 , < 3"), "requests[security,socks]<3,>=2.0");
        assert_eq!(c("numpy==1.26.*"), "numpy==1.26.*");
        assert_eq!(c("pywin32 ; sys_platform == 'win32'"), "pywin32; sys_platform == 'win32'");
        assert_eq!(c("attrs (>=22)"), "attrs>=22");
        assert_eq!(c("zope.interface~=6.0"), "zope-interface~=6.0");
        assert_eq!(marker_of(&c("six ; python_version < '3'")), Some("python_version < '3'"));
        assert_eq!(marker_of(&c("six>=1")), None);
    }

    #[test]
    fn dangerous_forms_are_refused() {
        for bad in [
            "-e .",
            "--index-url=http://evil",
            "-r requirements.txt",
            "pkg @ https://evil/pkg.whl",
            "git+https://github.com/x/y",
            "https://evil/x.whl",
            "./local",
            "/abs/path",
            "..\\up",
            "~/x",
            "six\n--extra-index-url http://evil",
            "six\t",
            "",
            "six; import os",
            "name with spaces",
            "six===",
            "six==1.0$(rm)",
            &"a".repeat(301),
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
        let e = parse("-e .").expect_err("option");
        assert!(e.to_string().contains("\"-e .\""), "names the entry: {e}");
        let e = parse("bad name!").expect_err("space").to_string();
        assert!(e.contains("a space after the name \"bad\""), "names what broke the name: {e}");
        let e = parse("pandas!").expect_err("bang").to_string();
        assert!(e.contains("'!' after the name \"pandas\""), "{e}");
    }

    #[test]
    fn sets_dedupe_refuse_conflicts_and_cap_the_count() {
        let v = |xs: &[&str]| xs.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(parse_set(&v(&["six", "attrs", "Six"]), 50).expect("ok"), ["attrs", "six"]);
        let e = parse_set(&v(&["six==1.16", "six==1.17"]), 50).expect_err("conflict");
        assert!(matches!(e, Error::Conflict { .. }), "{e}");
        let e = parse_set(&v(&["a", "b", "c"]), 2).expect_err("too many");
        assert!(e.to_string().contains("limit of 2"), "{e}");
        assert_eq!(parse_set(&v(&["b", "a"]), 50), parse_set(&v(&["a", "b"]), 50), "order does not matter");
    }

    #[test]
    fn inline_metadata() {
        let code = "# /// script\n# requires-python = \">=3.11\"\n# dependencies = [\n#   \"six\",\n#   'attrs>=22',\n# ]\n# ///\nimport six\n";
        assert_eq!(inline_dependencies(code).expect("ok"), ["six", "attrs>=22"]);
        assert_eq!(inline_dependencies("print(1)").expect("none"), Vec::<String>::new());
        assert!(inline_dependencies("# /// script\n# dependencies = [\"six\"]\n").is_err(), "unclosed");
        assert_eq!(
            inline_dependencies("# /// script\n# requires-python = \">=3\"\n# ///\n").expect("no deps"),
            Vec::<String>::new()
        );
    }
}
