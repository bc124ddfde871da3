//! The heartbeat of a server instance (docs/design.md D9): one tiny container per live
//! instance, whose liveness every instance on the engine can read, whatever state dir it uses.
//!
//! The container's only process reads its stdin until end of file. It is created with stdin
//! open and `StdinOnce`, and this server attaches to its stdin before starting it and holds
//! that connection for its whole life. When the server dies, even by SIGKILL, the kernel
//! closes the connection, the engine closes the container's stdin, and the container stops
//! (checked on Engine 20.10: within half a second) and is removed (`AutoRemove`): nothing of a
//! dead server stays on `docker ps -a`. No call is made while it runs: no polling, no
//! timestamps to refresh.
//!
//! Its absence alone would prove nothing (an older pyberth, a server that never got its
//! heartbeat up), so two labelled volumes say what a missing heartbeat means ([`evidence`]):
//! `pyberth-<instance>-heartbeat` (this instance has had a heartbeat: made when one first
//! runs) and `pyberth-<instance>-heartbeat-stopped`, made when it stopped, at the latest:
//! by the server itself when it leaves its sessions, or by the first server (or `pyberth gc`)
//! that finds the heartbeat gone. Its creation time, by the engine's clock, is the moment the
//! grace counts from; a server whose heartbeat runs again removes it.

use std::collections::HashMap;
use std::pin::Pin;
use std::time::Duration;

use crate::docker::Engine;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, HostConfig, VolumeCreateRequest};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, ListContainersOptionsBuilder,
    ListVolumesOptionsBuilder,
};
use futures::{Stream, StreamExt};

use super::container::{Found, Owner, remove_container, remove_volume};
use super::{Error, LABEL_HOST, LABEL_MANAGED};

/// Label on a heartbeat container, naming the instance it beats for. Heartbeats carry no
/// `pyberth.instance` label: they are not resources of a session, and counting or sweeping
/// by instance never mistakes one for a session's container.
pub const LABEL_HEARTBEAT: &str = "pyberth.heartbeat";
/// Label on the two volumes that say what a missing heartbeat means: [`HAD`] or [`STOPPED`].
pub const LABEL_BEAT: &str = "pyberth.beat";
/// This instance has had a heartbeat.
const HAD: &str = "had";
/// This instance's heartbeat stopped, at the latest when this volume was made.
const STOPPED: &str = "stopped";

/// Reads stdin to its end, then exits: alive exactly as long as the attach connection.
const BEAT: &str = "import sys\nwhile sys.stdin.buffer.read(65536):\n    pass\n";

type Output = Pin<Box<dyn Stream<Item = Result<LogOutput, bollard::errors::Error>> + Send>>;
type Input = Pin<Box<dyn tokio::io::AsyncWrite + Send>>;

/// A running heartbeat, alive while this value is.
pub struct Live {
    /// Container id.
    pub id: String,
    output: Output,
    /// Never written to; held so the engine keeps the container's stdin open.
    _input: Input,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Live {
    /// Resolves when the heartbeat container stopped (or the engine dropped the connection).
    pub async fn stopped(&mut self) {
        while let Some(Ok(_)) = self.output.next().await {}
    }
}

/// Creates, attaches to and starts a heartbeat for `owner` on `image` (any image with
/// `python3`: the sandbox image). Attached before it starts, so that no moment exists where
/// it runs with nobody holding its stdin: such a heartbeat would beat forever.
pub async fn start(docker: &dyn Engine, image: &str, owner: &Owner, suffix: &str) -> Result<Live, Error> {
    let name = format!("pyberth-{}-heartbeat-{suffix}", owner.instance);
    let labels = HashMap::from([
        (LABEL_MANAGED.to_owned(), "1".to_owned()),
        (LABEL_HOST.to_owned(), owner.host.clone()),
        (LABEL_HEARTBEAT.to_owned(), owner.instance.clone()),
    ]);
    let body = ContainerCreateBody {
        image: Some(image.into()),
        cmd: Some(["python3", "-I", "-S", "-c", BEAT].iter().map(|s| (*s).to_owned()).collect()),
        entrypoint: Some(Vec::new()),
        user: Some("65534:65534".into()),
        env: Some(vec!["PATH=/usr/local/bin:/usr/bin:/bin".into()]),
        open_stdin: Some(true),
        stdin_once: Some(true),
        labels: Some(labels),
        network_disabled: Some(true),
        host_config: Some(HostConfig {
            nano_cpus: Some(50_000_000),
            log_config: super::container::no_log(),
            restart_policy: super::container::no_restart(),
            // Gone when it stops: the volumes of [`mark_beating`] and [`mark_stopped`] say it
            // stopped, and when.
            auto_remove: Some(true),
            ..super::container::hardened(super::container::Fence {
                memory: 32 << 20,
                pids: 8,
                seccomp: None,
                runtime: None,
                network: "none",
                read_only: true,
            })
        }),
        ..Default::default()
    };
    let opts = CreateContainerOptionsBuilder::default().name(&name).build();
    let id = docker.create_container(Some(opts), body).await?.id;
    let started = async {
        let attach =
            AttachContainerOptionsBuilder::default().stdin(true).stdout(true).stderr(true).stream(true).build();
        let attached = docker.attach_container(&id, Some(attach)).await?;
        docker.start_container(&id, None).await?;
        Ok::<_, Error>(attached)
    };
    match started.await {
        Ok(a) => Ok(Live { id, output: a.output, _input: a.input }),
        Err(e) => {
            remove_container(docker, &id).await;
            Err(e)
        }
    }
}

/// Removes every heartbeat of `owner`, running or not, and its volumes. The mark that it had
/// one goes before the stop mark: a server that finds the heartbeat gone meanwhile and marks
/// it stopped looks for that mark after its own and takes its stop mark back ([`evidence`]).
/// The marks go even when the heartbeats cannot be listed.
pub async fn remove_all(docker: &dyn Engine, owner: &Owner) -> Result<(), Error> {
    let beat = format!("{LABEL_HEARTBEAT}={}", owner.instance);
    let host = format!("{LABEL_HOST}={}", owner.host);
    let filters = HashMap::from([("label", vec![beat.as_str(), host.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    let listed = docker.list_containers(Some(opts)).await;
    for c in listed.as_deref().unwrap_or_default() {
        if let Some(id) = &c.id {
            remove_container(docker, id).await;
        }
    }
    for kind in [HAD, STOPPED] {
        remove_volume(docker, &mark_name(&owner.instance, kind)).await;
    }
    listed.map(drop).map_err(Error::from)
}

fn mark_name(instance: &str, kind: &str) -> String {
    match kind {
        HAD => format!("pyberth-{instance}-heartbeat"),
        _ => format!("pyberth-{instance}-heartbeat-{kind}"),
    }
}

/// Makes (or finds: a name is made once) the volume saying `kind` of `owner`'s heartbeat.
async fn mark(docker: &dyn Engine, owner: &Owner, kind: &str) -> Result<(), Error> {
    let labels = HashMap::from([
        (LABEL_MANAGED.to_owned(), "1".to_owned()),
        (LABEL_HOST.to_owned(), owner.host.clone()),
        (LABEL_HEARTBEAT.to_owned(), owner.instance.clone()),
        (LABEL_BEAT.to_owned(), kind.to_owned()),
    ]);
    let request = VolumeCreateRequest {
        name: Some(mark_name(&owner.instance, kind)),
        labels: Some(labels),
        ..Default::default()
    };
    docker.create_volume(request).await?;
    Ok(())
}

/// Once a heartbeat of `owner` runs: the volume saying it has had one, and no longer one
/// saying it stopped (made by its own leave before, or by a server that found it gone while
/// this one made another). Called after the heartbeat started, never before: a server that
/// marks it stopped meanwhile looks again afterwards and finds it running ([`evidence`]).
pub async fn mark_beating(docker: &dyn Engine, owner: &Owner) -> Result<(), Error> {
    mark(docker, owner, HAD).await?;
    let opts = bollard::query_parameters::RemoveVolumeOptionsBuilder::default().force(true).build();
    match docker.remove_volume(&mark_name(&owner.instance, STOPPED), Some(opts)).await {
        Ok(()) | Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// When `owner`'s heartbeat has stopped and its server leaves its sessions: the moment, kept.
pub async fn mark_stopped(docker: &dyn Engine, owner: &Owner) -> Result<(), Error> {
    mark(docker, owner, STOPPED).await
}

/// What the engine says of an instance's heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beat {
    /// A heartbeat runs (or one's state could not be read: not provably stopped).
    Running,
    /// It stopped; the latest stop this long ago, at least.
    StoppedFor(Duration),
    /// No heartbeat, and none is known to have run: nothing is known.
    Absent,
}

/// An instance as labels name it: (instance, host).
type Key = (String, String);

/// The heartbeat of `c`'s labels: its (instance, host), when it is one.
fn beat_key(labels: &HashMap<String, String>) -> Option<Key> {
    Some((labels.get(LABEL_HEARTBEAT)?.clone(), labels.get(LABEL_HOST)?.clone()))
}

/// The heartbeat evidence of the instances `wanted` picks, read from `containers` (a listing
/// of ours, heartbeats among them) and the marks (one volume listing): running, stopped for
/// how long (the latest stop: a stopped heartbeat not yet removed, or the stop mark), or
/// absent. An instance that has had a heartbeat and has neither a running one nor a stop
/// mark is marked stopped now, and stopped for zero: its grace starts here, never earlier
/// than its real stop. Then its heartbeats are listed again: one running now (its server made
/// another meanwhile, and marked it beating before this mark) removes the mark again.
pub async fn evidence(
    docker: &dyn Engine,
    containers: &[Found],
    wanted: &(dyn Fn(&Key) -> bool + Send + Sync),
) -> HashMap<Key, Beat> {
    let mut running: HashMap<Key, bool> = HashMap::new();
    let mut latest: HashMap<Key, Duration> = HashMap::new();
    let mut had: Vec<Key> = Vec::new();
    let later = |m: &mut HashMap<Key, Duration>, k: Key, at: Duration| {
        let t = m.entry(k).or_insert(at);
        *t = (*t).max(at);
    };
    for c in containers {
        let Some(key) = beat_key(&c.labels).filter(|k| wanted(k)) else { continue };
        if c.running || running.get(&key) == Some(&true) {
            running.insert(key, true);
            continue;
        }
        match stopped_at(docker, &c.id, c.created).await {
            Ok(Some(at)) => later(&mut latest, key.clone(), at),
            Err(e) if e.is_gone() => continue,
            // Not provably stopped.
            Ok(None) | Err(_) => {
                running.insert(key, true);
                continue;
            }
        }
        running.entry(key).or_insert(false);
    }
    let filters = HashMap::from([("label", vec![LABEL_BEAT])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let marks = match docker.list_volumes(Some(opts)).await {
        Ok(v) => v.volumes.unwrap_or_default(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the heartbeat marks; going by heartbeat containers alone");
            Vec::new()
        }
    };
    for v in marks {
        let Some(key) = beat_key(&v.labels).filter(|k| wanted(k)) else { continue };
        match v.labels.get(LABEL_BEAT).map(String::as_str) {
            Some(STOPPED) => match v.created_at.as_deref().and_then(parse_time) {
                Some(at) => later(&mut latest, key, at),
                // A mark without a time: stopped, since when unknown, so from now.
                None => had.push(key),
            },
            Some(HAD) => had.push(key),
            _ => {}
        }
    }
    let now = engine_clock(docker).await;
    let mut out: HashMap<Key, Beat> =
        running.into_iter().filter(|(_, r)| *r).map(|(key, _)| (key, Beat::Running)).collect();
    for (key, at) in latest {
        out.entry(key).or_insert(Beat::StoppedFor(now.saturating_sub(at)));
    }
    had.sort();
    had.dedup();
    had.retain(|k| !out.contains_key(k));
    for key in had {
        let beat = observe_gone(docker, &key).await;
        out.insert(key, beat);
    }
    out
}

/// An instance that has had a heartbeat and shows none: marked stopped now (see [`evidence`]).
async fn observe_gone(docker: &dyn Engine, key: &Key) -> Beat {
    use bollard::models::ContainerSummaryStateEnum as S;
    let owner = Owner { instance: key.0.clone(), host: key.1.clone() };
    if let Err(e) = mark_stopped(docker, &owner).await {
        tracing::warn!(instance = %key.0, error = %e, "cannot mark a missing heartbeat stopped; its instance is left alone");
        return Beat::Running;
    }
    let beat = format!("{LABEL_HEARTBEAT}={}", key.0);
    let host = format!("{LABEL_HOST}={}", key.1);
    let filters = HashMap::from([("label", vec![beat.as_str(), host.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    let (beat, keep) = match docker.list_containers(Some(opts)).await {
        // Its server removed its marks meanwhile (a clean stop: `remove_all` takes this one
        // first): nothing to mark, and this mark made after theirs went would stay.
        Ok(list) if list.iter().all(|c| matches!(c.state, Some(S::EXITED | S::DEAD))) => {
            match docker.inspect_volume(&mark_name(&key.0, HAD)).await {
                Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => {
                    (Beat::Absent, false)
                }
                _ => (Beat::StoppedFor(Duration::ZERO), true),
            }
        }
        // One runs (or is being made) again: alive, and the mark goes (its server removes it
        // too once its new heartbeat runs). Unreadable: left alone, the mark taken back.
        Ok(_) | Err(_) => (Beat::Running, false),
    };
    if !keep {
        remove_volume(docker, &mark_name(&key.0, STOPPED)).await;
    }
    beat
}

/// The engine's clock, or ours when the engine does not say.
pub async fn engine_clock(docker: &dyn Engine) -> Duration {
    match engine_now(docker).await {
        Ok(Some(t)) => t,
        _ => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default(),
    }
}

/// The engine's clock, read once per sweep: stop times are compared with the clock that wrote
/// them, so a skew between this host and a remote engine does not shorten the grace.
pub async fn engine_now(docker: &dyn Engine) -> Result<Option<Duration>, Error> {
    Ok(docker.info().await?.system_time.as_deref().and_then(parse_time))
}

/// When a stopped heartbeat stopped, by the engine's clock: `State.FinishedAt`, or its
/// creation time when it never ran (its server died between creating and starting it).
pub async fn stopped_at(docker: &dyn Engine, id: &str, created: Option<i64>) -> Result<Option<Duration>, Error> {
    let finished = docker.inspect_container(id, None).await?.state.and_then(|s| s.finished_at);
    let finished = finished.as_deref().and_then(parse_time).filter(|t| t.as_secs() > 0);
    Ok(finished.or_else(|| created.and_then(|c| u64::try_from(c).ok()).map(Duration::from_secs)))
}

/// Parses the engine's RFC 3339 times (`2026-11-23T11:09:44.945454897Z`, or with an offset) into
/// time since the epoch. Times before 1970 (the engine's zero time, year 1) are `None`.
pub fn parse_time(s: &str) -> Option<Duration> {
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if t.bytes().all(|b| b.is_ascii_digit()) { t.parse().ok() } else { None }
    };
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') || b[13] != b':' {
        return None;
    }
    if b[16] != b':' {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, min, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut nanos = 0u32;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        for (i, d) in frac.bytes().take(9).take(digits).enumerate() {
            nanos += u32::from(d - b'0') * 10u32.pow(8 - u32::try_from(i).ok()?);
        }
        rest = &frac[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes().first() {
                Some(b'+') => 1,
                Some(b'-') => -1,
                _ => return None,
            };
            let r = rest.as_bytes();
            if r.len() != 6 || r[3] != b':' {
                return None;
            }
            let h: i64 = rest[1..3].parse().ok()?;
            let m: i64 = rest[4..6].parse().ok()?;
            sign * (h * 3600 + m * 60)
        }
    };
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3600 + min * 60 + sec - offset;
    Some(Duration::new(u64::try_from(secs).ok()?, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that finds another's heartbeat gone marks it stopped; when that other server
    /// has meanwhile removed its marks (it stopped cleanly), the mark made after theirs went is
    /// taken back, not left on the engine (a flaky leftover the orphan test saw under load).
    #[tokio::test]
    async fn a_stop_mark_made_after_the_instance_removed_its_marks_is_taken_back() {
        let fake = crate::docker::fake::FakeEngine::default();
        let key: Key = ("gone".into(), "h".into());
        // What the evidence read listed: a mark that it had a heartbeat, removed since.
        assert_eq!(observe_gone(&fake, &key).await, Beat::Absent);
        let left: Vec<String> = fake.world().volumes.keys().cloned().collect();
        assert!(left.is_empty(), "no mark is left: {left:?}");
        // Still there: stopped from now, and marked so.
        let owner = Owner { instance: key.0.clone(), host: key.1.clone() };
        mark(&fake, &owner, HAD).await.expect("a mark");
        assert_eq!(observe_gone(&fake, &key).await, Beat::StoppedFor(Duration::ZERO));
        assert!(fake.world().volumes.contains_key(&mark_name("gone", STOPPED)));
        remove_all(&fake, &owner).await.expect("removed");
        assert!(fake.world().volumes.is_empty());
    }

    #[test]
    fn engine_times_parse() {
        let t = |s: &str| parse_time(s).map(|d| (d.as_secs(), d.subsec_nanos()));
        assert_eq!(t("1970-01-01T00:00:00Z"), Some((0, 0)));
        assert_eq!(t("2026-11-23T11:09:44.945454897Z"), Some((1_795_432_184, 945_454_897)));
        assert_eq!(t("2026-11-23T12:09:44.5+01:00"), Some((1_795_432_184, 500_000_000)));
        assert_eq!(t("2000-02-29T00:00:00Z"), Some((951_782_400, 0)));
        assert_eq!(t("0001-01-01T00:00:00Z"), None, "the engine's zero time");
        for bad in [
            "",
            "2026-11-23",
            "2026-13-01T00:00:00Z",
            "2026-11-23T11:09:44",
            "2026-11-23T11:09:44.Z",
            "x026-11-23T11:09:44Z",
        ] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }
}
