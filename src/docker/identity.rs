//! The code's identity: every sandbox container (a session's, the installer's, the marker
//! evaluator's) runs its code under a uid of its own, with the same number as its only gid,
//! picked at random from a range pyberth reserves (`--uid-range`) and recorded on the
//! container (`pyberth.uid`). Per-uid kernel limits (inotify instances, RLIMIT_NPROC,
//! RLIMIT_MSGQUEUE, pending signals, pipe buffers) are then one session's own, shared with no
//! other session and no host user (docs/design.md D4).
//!
//! The uid has no passwd entry (the root filesystem is read-only, and a writable
//! `/etc/passwd` would be the code's to forge): `USER` and `LOGNAME` name it, `HOME` is the
//! workspace.

use std::collections::{HashMap, HashSet};
use std::io::Read as _;
use std::sync::Mutex;

use bollard::query_parameters::{ListContainersOptionsBuilder, ListVolumesOptionsBuilder};

use super::Error;
use crate::docker::Engine;

/// Label holding the uid (and gid) a container's code runs as.
pub const LABEL_UID: &str = "pyberth.uid";

/// The first uid of the default range: 0x70000000, above systemd's container range
/// (524288–1879048191) and far above the uids distributions give users.
pub const DEFAULT_FIRST: u32 = 0x7000_0000;
/// The last uid of the default range: 0x7FFDFFFF, just below systemd's range for foreign OS
/// images (0x7FFE0000–0x7FFEFFFF), itself below 2^31 (uids from there on are unsafe: some
/// code, the kernel's devpts among it, reads them as signed).
pub const DEFAULT_LAST: u32 = 0x7FFD_FFFF;
/// The default `--uid-range`, as the flag spells it.
pub const DEFAULT_RANGE: &str = "1879048192-2147352575";
/// The smallest range accepted: enough that random picks rarely meet.
const MIN_SIZE: u32 = 1024;
/// Lowest first uid accepted: above the 16-bit uids of users and system accounts.
const MIN_FIRST: u32 = 65_536;
/// Highest last uid accepted: below 2^31.
const MAX_LAST: u32 = 0x7FFF_FFFE;

/// A range of uids (and the same gids) reserved for sandboxed code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UidRange {
    /// First uid, included.
    pub first: u32,
    /// Last uid, included.
    pub last: u32,
}

impl Default for UidRange {
    fn default() -> Self {
        Self { first: DEFAULT_FIRST, last: DEFAULT_LAST }
    }
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl std::str::FromStr for UidRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s.split_once('-').ok_or_else(|| format!("{s:?} is not FIRST-LAST (e.g. {DEFAULT_RANGE})"))?;
        let num = |t: &str| t.trim().parse::<u32>().map_err(|_| format!("{t:?} is not a uid"));
        let range = Self { first: num(a)?, last: num(b)? };
        range.check()?;
        Ok(range)
    }
}

impl UidRange {
    /// Whether the range is one pyberth can use: at least 1024 uids, from 65536 to below 2^31.
    pub fn check(&self) -> Result<(), String> {
        if self.first > self.last {
            return Err(format!("{self}: the first uid is past the last"));
        }
        if self.first < MIN_FIRST {
            return Err(format!("{self}: must start at {MIN_FIRST} or above, clear of users and system accounts"));
        }
        if self.last > MAX_LAST {
            return Err(format!("{self}: must end below 2^31 (2147483647): larger uids are unsafe"));
        }
        if self.last - self.first < MIN_SIZE - 1 {
            return Err(format!("{self}: must hold at least {MIN_SIZE} uids"));
        }
        Ok(())
    }

    /// How many uids it holds.
    pub fn size(&self) -> u64 {
        u64::from(self.last - self.first) + 1
    }

    /// Whether `[first, first + count)` meets it.
    fn meets(&self, first: u64, count: u64) -> bool {
        first <= u64::from(self.last) && first.saturating_add(count) > u64::from(self.first)
    }
}

impl serde::Serialize for UidRange {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for UidRange {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// uids lent to containers of this process and not yet given back.
static IN_USE: Mutex<Option<HashSet<u32>>> = Mutex::new(None);

/// Picks a uid for a new container: at random in `range`, lent to no container of this
/// process, and carried by no container the engine knows (another server sharing the
/// engine). Give it back with [`release`] when the container is gone.
pub async fn pick(docker: &dyn Engine, range: UidRange) -> Result<u32, Error> {
    for _ in 0..64 {
        let uid = random_in(range)?;
        if !lend(uid) {
            continue;
        }
        match engine_holds(docker, uid).await {
            Ok(false) => return Ok(uid),
            Ok(true) => release(uid),
            Err(e) => {
                release(uid);
                return Err(e);
            }
        }
    }
    Err(Error::Io {
        context: format!("no free uid in --uid-range {range}: make the range larger"),
        source: std::io::Error::other("every uid tried was in use"),
    })
}

/// Gives a uid back (its container is gone).
pub fn release(uid: u32) {
    let mut set = IN_USE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(set) = set.as_mut() {
        set.remove(&uid);
    }
}

/// Whether `uid` is lent now (tests).
#[cfg(test)]
pub(crate) fn is_lent(uid: u32) -> bool {
    IN_USE.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref().is_some_and(|s| s.contains(&uid))
}

/// Lends `uid` again to a session that had it (a new container on its old volumes, whose files
/// are that uid's): given back with [`release`] as any other.
pub fn reserve(uid: u32) {
    lend(uid);
}

/// Marks `uid` as lent; false when it already was.
fn lend(uid: u32) -> bool {
    let mut set = IN_USE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    set.get_or_insert_with(HashSet::new).insert(uid)
}

/// Whether any container on the engine, running or not, or any volume carries `uid` in its
/// label: a session whose container is gone keeps its uid in its workspace volume, for the
/// container a server makes on it again (docs/design.md D12).
async fn engine_holds(docker: &dyn Engine, uid: u32) -> Result<bool, Error> {
    let label = format!("{LABEL_UID}={uid}");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    if !docker.list_containers(Some(opts)).await?.is_empty() {
        return Ok(true);
    }
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    Ok(docker.list_volumes(Some(opts)).await?.volumes.is_some_and(|v| !v.is_empty()))
}

fn random_in(range: UidRange) -> Result<u32, Error> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|source| Error::Io { context: "cannot read /dev/urandom for a uid".into(), source })?;
    // The bias of a 64-bit value modulo at most 2^31 is below 2^-32: none worth a loop.
    let offset = u64::from_le_bytes(bytes) % range.size();
    let offset = u32::try_from(offset).unwrap_or(0);
    Ok(range.first + offset)
}

/// `uid:gid` for the engine's `User` fields.
pub fn user(uid: u32) -> String {
    format!("{uid}:{uid}")
}

/// Where the host's own ids meet `range`: subordinate ranges in `/etc/subuid` and
/// `/etc/subgid` (rootless containers, `userns-remap`) and accounts in `/etc/passwd` and
/// `/etc/group`. Each finding is one sentence; empty when the range is clear. Files that
/// cannot be read are skipped (a server in a container sees its own, not the host's).
pub fn host_overlaps(range: UidRange) -> Vec<String> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let mut found = Vec::new();
    for file in ["/etc/subuid", "/etc/subgid"] {
        found.extend(subordinate_overlaps(range, &read(file)).into_iter().map(|l| format!("{file}: {l}")));
    }
    for file in ["/etc/passwd", "/etc/group"] {
        found.extend(account_overlaps(range, &read(file)).into_iter().map(|l| format!("{file}: {l}")));
    }
    found
}

/// Lines of a subuid/subgid file (`name:first:count`) whose range meets `range`.
fn subordinate_overlaps(range: UidRange, text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| {
            let mut f = l.trim().split(':');
            let (_, Some(first), Some(count)) = (f.next(), f.next(), f.next()) else { return false };
            match (first.trim().parse::<u64>(), count.trim().parse::<u64>()) {
                (Ok(first), Ok(count)) => range.meets(first, count),
                _ => false,
            }
        })
        .map(|l| l.trim().to_owned())
        .collect()
}

/// Names of passwd or group entries (`name:x:id:…`) whose id lies in `range`.
fn account_overlaps(range: UidRange, text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let (Some(name), _, Some(id)) = (f.next(), f.next(), f.next()) else { return None };
            let id = id.trim().parse::<u64>().ok()?;
            range.meets(id, 1).then(|| format!("{name} ({id})"))
        })
        .collect()
}

/// Logs a warning for each place the host's ids meet `range`.
pub fn warn_overlaps(range: UidRange) {
    for what in host_overlaps(range) {
        tracing::warn!(
            uid_range = %range,
            overlap = %what,
            "--uid-range meets ids the host gives out: sandboxed code could share per-uid limits (and, for \
             subordinate ids, file ownership) with them; choose a free range"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_range_is_the_documented_one_and_valid() {
        let r: UidRange = DEFAULT_RANGE.parse().expect("valid");
        assert_eq!(r, UidRange::default());
        assert_eq!(r.to_string(), DEFAULT_RANGE);
        assert_eq!((r.first, r.last), (0x7000_0000, 0x7FFD_FFFF));
    }

    #[test]
    fn bad_ranges_are_refused_with_a_reason() {
        for (bad, why) in [
            ("1000-5000", "65536"),
            ("100000-99999", "past the last"),
            ("100000-100010", "at least 1024"),
            ("2147483000-2147483647", "2^31"),
            ("70000", "FIRST-LAST"),
            ("a-b", "not a uid"),
            ("-1-5", "not a uid"),
        ] {
            let e = bad.parse::<UidRange>().expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!("100000-165535".parse::<UidRange>().is_ok());
    }

    #[test]
    fn picks_stay_in_the_range_and_are_lent_once() {
        let r: UidRange = "100000-101023".parse().expect("valid");
        for _ in 0..1000 {
            let u = random_in(r).expect("random");
            assert!((100_000..=101_023).contains(&u));
        }
        let u = 123_456_789;
        assert!(lend(u));
        assert!(!lend(u), "lent already");
        release(u);
        assert!(lend(u), "given back");
        release(u);
    }

    #[test]
    fn host_ranges_that_meet_ours_are_found() {
        let r = UidRange::default();
        let subuid = "alice:100000:65536\nbob:1879048000:1000\n# junk\ncarol:2147352575:1\ndave:2147352576:5\n";
        assert_eq!(subordinate_overlaps(r, subuid), vec!["bob:1879048000:1000", "carol:2147352575:1"]);
        let passwd = "root:x:0:0::/root:/bin/sh\nsvc:x:1879048200:1879048200::/:/bin/false\nbad:x:y:1\n";
        assert_eq!(account_overlaps(r, passwd), vec!["svc (1879048200)"]);
        assert!(subordinate_overlaps(r, "").is_empty());
    }
}
