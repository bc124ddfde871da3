//! Our labels as Kubernetes label keys and values.
//!
//! A label value is at most 63 characters of `[A-Za-z0-9._-]`, starting and ending with an
//! alphanumeric. Session names pass as they are; a principal (an email, an OAuth subject)
//! often does not, and a value the API server refuses would fail every create. Such a value
//! becomes `h-` and a hash of it (still selectable, never ambiguous with a plain name, since a
//! plain value never starts with `h-` *and* is 66 characters long), and the original rides in
//! an annotation, where any string is allowed.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// Prefix of every annotation that carries an original label value.
pub const ORIGINAL_PREFIX: &str = "pyberth.io/original-";

/// Whether `v` is a label value the API server accepts as it is.
pub fn is_valid_value(v: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    v.is_empty()
        || (v.len() <= 63
            && v.chars().all(ok_char)
            && v.starts_with(|c: char| c.is_ascii_alphanumeric())
            && v.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

/// The label value for `v`: itself when valid, else `h-` and 60 hex digits of its SHA-256.
pub fn value(v: &str) -> String {
    if is_valid_value(v) && !v.starts_with("h-") {
        return v.to_owned();
    }
    let digest = Sha256::digest(v.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("h-{}", &hex[..60])
}

/// Labels and annotations for our Docker-style label map: every value made valid, and each
/// value that had to be hashed kept whole in an annotation.
pub fn split(labels: &BTreeMap<String, String>) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let mut out = BTreeMap::new();
    let mut notes = BTreeMap::new();
    for (k, v) in labels {
        let safe = value(v);
        if &safe != v {
            notes.insert(format!("{ORIGINAL_PREFIX}{k}"), v.clone());
        }
        out.insert(k.clone(), safe);
    }
    (out, notes)
}

/// A label selector matching all of `pairs`, each value made valid as [`value`] makes it: a
/// caller-chosen value (`a,pyberth.managed`) can neither add a term nor widen the selector.
pub fn selector(pairs: &[(&str, &str)]) -> String {
    pairs.iter().map(|(k, v)| format!("{k}={}", value(v))).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_values_pass_unchanged() {
        assert_eq!(value("s1"), "s1");
        assert_eq!(value("inst-0a.b_c"), "inst-0a.b_c");
        assert_eq!(value(""), "");
    }

    #[test]
    fn hostile_values_become_hashes_the_api_server_accepts() {
        // What a principal or a session name chosen by a caller could hold.
        for v in ["alice@example.com", "a,b=c", "x".repeat(64).as_str(), "-lead", "trail-", "a b", "ä", "h-abc"] {
            let safe = value(v);
            assert!(is_valid_value(&safe), "{v:?} -> {safe:?}");
            assert!(safe.starts_with("h-") && safe.len() == 62, "{v:?} -> {safe:?}");
        }
        assert_ne!(value("alice@example.com"), value("bob@example.com"));
        assert_eq!(value("alice@example.com"), value("alice@example.com"));
    }

    #[test]
    fn a_hostile_value_adds_no_term_to_a_selector() {
        assert_eq!(
            selector(&[("pyberth.session", "s1"), ("pyberth.managed", "true")]),
            "pyberth.session=s1,pyberth.managed=true"
        );
        for hostile in ["s1,pyberth.managed", "s1 in (a,b)", "s1!=x", "x=y"] {
            let s = selector(&[("pyberth.session", hostile)]);
            assert_eq!(s.matches(',').count() + s.matches('=').count(), 1, "one term, one `=`: {s}");
            assert!(s.starts_with("pyberth.session=h-"), "{s}");
        }
    }

    #[test]
    fn split_keeps_the_original_in_an_annotation() {
        let labels = BTreeMap::from([
            ("pyberth.session".to_owned(), "s1".to_owned()),
            ("pyberth.owner".to_owned(), "alice@example.com".to_owned()),
        ]);
        let (l, a) = split(&labels);
        assert_eq!(l["pyberth.session"], "s1");
        assert!(l["pyberth.owner"].starts_with("h-"));
        assert_eq!(a.len(), 1);
        assert_eq!(a["pyberth.io/original-pyberth.owner"], "alice@example.com");
    }
}
