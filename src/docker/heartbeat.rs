//! The heartbeat of a server instance (docs/design.md D9): one tiny container per live
//! instance, whose liveness every instance on the engine can read, whatever state dir it uses.
//!
//! The container's only process reads its stdin until end of file. It is created with stdin
//! open and `StdinOnce`, and this server attaches to its stdin before starting it and holds
//! that connection for its whole life. When the server dies, even by SIGKILL, the kernel
//! closes the connection, the engine closes the container's stdin, and the container stops
//! (checked on Engine 20.10: within half a second). It is never auto-removed: a stopped
//! heartbeat, and when it stopped (`State.FinishedAt`), is the evidence the sweep reads. No
//! call is made while it runs: no polling, no timestamps to refresh.

use std::collections::HashMap;
use std::pin::Pin;
use std::time::Duration;

use crate::docker::Engine;
use bollard::container::LogOutput;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    AttachContainerOptionsBuilder, CreateContainerOptionsBuilder, ListContainersOptionsBuilder,
};
use futures::{Stream, StreamExt};

use super::container::{Owner, remove_container};
use super::{Error, LABEL_HOST, LABEL_MANAGED};

/// Label on a heartbeat container, naming the instance it beats for. Heartbeats carry no
/// `pyberth.instance` label: they are not resources of a session, and counting or sweeping
/// by instance never mistakes one for a session's container.
pub const LABEL_HEARTBEAT: &str = "pyberth.heartbeat";

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
            // Kept when it stops: a stopped heartbeat is how others learn this instance died.
            auto_remove: Some(false),
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

/// Removes every heartbeat of `owner`, running or not.
pub async fn remove_all(docker: &dyn Engine, owner: &Owner) -> Result<(), Error> {
    let beat = format!("{LABEL_HEARTBEAT}={}", owner.instance);
    let host = format!("{LABEL_HOST}={}", owner.host);
    let filters = HashMap::from([("label", vec![beat.as_str(), host.as_str()])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    for c in docker.list_containers(Some(opts)).await? {
        if let Some(id) = c.id {
            remove_container(docker, &id).await;
        }
    }
    Ok(())
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
