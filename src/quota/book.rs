//! Today's counts on disk: `quotas.json` in the private state dir, replaced atomically (a temp
//! file of a random name, 0600, renamed over it; never written through a symlink). A file
//! that does not parse, is of another version, or holds absurd values is not trusted: the
//! counts start from zero and the start says why (a log line and an audit record) rather
//! than refusing to start, since a refused start would stop every principal, not one.

use std::collections::BTreeMap;
use std::path::Path;

/// The file's name in the state dir.
pub(super) const FILE: &str = "quotas.json";
const VERSION: u32 = 1;
/// Largest file read.
const MAX_FILE: u64 = 8 << 20;

/// What one principal used on one UTC day.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Used {
    /// CPU time of its sessions' containers, ms.
    pub cpu_ms: u64,
    /// Wall time of its runs, ms.
    pub run_ms: u64,
    /// Bytes through the egress proxy, both ways.
    pub egress_bytes: u64,
}

/// The counts of one UTC day.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Book {
    pub(super) version: u32,
    /// Days since 1970-01-01, UTC.
    pub(super) day: u64,
    pub(super) used: BTreeMap<String, Used>,
}

impl Book {
    pub(super) fn new(day: u64) -> Self {
        Self { version: VERSION, day, used: BTreeMap::new() }
    }
}

/// What was found on disk.
#[derive(Debug)]
pub(super) enum Loaded {
    Absent,
    Read(Book),
    /// Not ours, or broken: why.
    Bad(String),
}

/// Reads the book; yesterday's counts read as a fresh day.
pub(super) fn read(path: &Path, today: u64) -> Loaded {
    let bytes = match crate::state_dir::read(path, MAX_FILE) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Loaded::Absent,
        Err(e) => return Loaded::Bad(format!("cannot read {}: {e}", path.display())),
    };
    let book: Book = match serde_json::from_slice(&bytes) {
        Ok(b) => b,
        Err(e) => return Loaded::Bad(format!("{} is not a quota record: {e}", path.display())),
    };
    if book.version != VERSION {
        return Loaded::Bad(format!("{} is of version {}, not {VERSION}", path.display(), book.version));
    }
    // A day ahead of the clock would keep its counts past their day.
    if book.day > today {
        return Loaded::Bad(format!("{} is dated after today (day {} > {today})", path.display(), book.day));
    }
    if book.day < today {
        return Loaded::Read(Book::new(today));
    }
    Loaded::Read(book)
}

pub(super) fn encode(book: &Book) -> Vec<u8> {
    serde_json::to_vec(book).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_book_round_trips_and_refuses_what_is_not_ours() {
        let dir = std::env::temp_dir().join(format!("pyberth-quota-book-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(FILE);
        assert!(matches!(read(&path, 10), Loaded::Absent));
        let mut b = Book::new(10);
        b.used.insert("alice".into(), Used { cpu_ms: 1, run_ms: 2, egress_bytes: 3 });
        crate::state_dir::replace(&path, &encode(&b)).expect("write");
        match read(&path, 10) {
            Loaded::Read(r) => assert_eq!(r.used["alice"].run_ms, 2),
            other => panic!("{other:?}"),
        }
        match read(&path, 11) {
            Loaded::Read(r) => assert!(r.used.is_empty() && r.day == 11, "yesterday's counts are gone"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(read(&path, 9), Loaded::Bad(why) if why.contains("after today")));
        for bad in [
            "{",
            "{\"version\":2,\"day\":10,\"used\":{}}",
            "{\"version\":1,\"day\":10,\"used\":{\"a\":{\"cpu_ms\":-1}}}",
        ] {
            std::fs::write(&path, bad).expect("forge");
            assert!(matches!(read(&path, 10), Loaded::Bad(_)), "{bad}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
