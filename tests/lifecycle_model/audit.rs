//! What the engine and the state dir hold, and whether they account for each other and for
//! what the live server lists.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use bollard::query_parameters::{
    ListContainersOptionsBuilder, ListNetworksOptionsBuilder, ListVolumesOptionsBuilder, RemoveContainerOptionsBuilder,
    RemoveVolumeOptionsBuilder,
};
use serde_json::Value;

use crate::common::docker;
use crate::world::{Broke, World, broke, sname};

pub struct Container {
    pub id: String,
    pub name: String,
    pub running: bool,
    pub labels: HashMap<String, String>,
}

pub struct Volume {
    pub name: String,
    pub labels: HashMap<String, String>,
}

/// Everything on the engine labelled with an instance of `prefix`.
#[derive(Default)]
pub struct Engine {
    pub containers: Vec<Container>,
    pub volumes: Vec<Volume>,
    pub networks: Vec<String>,
}

fn ours(labels: Option<&HashMap<String, String>>, prefix: &str) -> bool {
    labels.and_then(|l| l.get("pyberth.instance")).is_some_and(|i| i.starts_with(&format!("{prefix}-")))
}

pub async fn engine(prefix: &str) -> Engine {
    let d = docker().await;
    let filters = HashMap::from([("label", vec!["pyberth.managed"])]);
    let mut e = Engine::default();
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    for c in d.list_containers(Some(opts)).await.unwrap_or_default() {
        if !ours(c.labels.as_ref(), prefix) {
            continue;
        }
        let name = c.names.as_ref().and_then(|n| n.first()).map(|n| n.trim_start_matches('/').to_owned());
        let running = c.state.as_ref().is_some_and(|s| format!("{s:?}").eq_ignore_ascii_case("running"));
        e.containers.push(Container {
            id: c.id.unwrap_or_default(),
            name: name.unwrap_or_default(),
            running,
            labels: c.labels.unwrap_or_default(),
        });
    }
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let volumes = d.list_volumes(Some(opts)).await.ok().and_then(|v| v.volumes).unwrap_or_default();
    for v in volumes {
        if ours(Some(&v.labels), prefix) {
            e.volumes.push(Volume { name: v.name, labels: v.labels });
        }
    }
    let opts = ListNetworksOptionsBuilder::default().build();
    for n in d.list_networks(Some(opts)).await.unwrap_or_default() {
        if ours(n.labels.as_ref(), prefix) {
            e.networks.push(n.name.unwrap_or_default());
        }
    }
    e
}

/// The JSON records of one folder of the state dir.
fn records(w: &World, dir: &str) -> Vec<Value> {
    let Ok(entries) = std::fs::read_dir(w.state.join(dir)) else { return Vec::new() };
    entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|t| serde_json::from_str(&t).ok())
        .collect()
}

/// One look: what does not add up yet (empty: all accounted for), what cannot (a session
/// unrecorded: records are written as sessions change, never later).
async fn look(w: &World) -> Result<Found, Broke> {
    let listed = w.listed().await?;
    let snapshots = w.snapshots().await?;
    // The session records before the engine is read as well as after: a session the server
    // wakes meanwhile has its container made, then its record moved to sessions/; read only
    // before, its container would look unrecorded. A hibernating session is recorded in
    // sleepers/ (naming its container) before its container goes.
    let mut before = records(w, "sessions");
    before.extend(records(w, "sleepers"));
    let e = engine(&w.prefix).await;
    let mut bad = Vec::new();
    let asleep = listed.values().filter(|s| *s == "hibernated").count();
    let mut per_session: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &e.containers {
        match c.labels.get("pyberth.session") {
            Some(s) if listed.get(s).is_some_and(|st| st != "hibernated") && c.running => {
                *per_session.entry(s.as_str()).or_default() += 1;
            }
            Some(s) => {
                bad.push(format!("container {} of session {s} ({:?}, running {})", c.name, listed.get(s), c.running))
            }
            None => {
                let of = c.name.strip_suffix("-io");
                let snap = of.is_some_and(|v| e.volumes.iter().any(|x| x.name == v));
                if !snap {
                    bad.push(format!("container {} belongs to no session or snapshot", c.name));
                }
            }
        }
    }
    for (s, st) in &listed {
        let n = per_session.get(s.as_str()).copied().unwrap_or_default();
        if st != "hibernated" && n != 1 {
            bad.push(format!("session {s} ({st}) has {n} running containers"));
        }
    }
    let snap_volumes = e.volumes.iter().filter(|v| v.labels.contains_key("pyberth.snapshot")).count();
    if snap_volumes != snapshots.len() + asleep {
        bad.push(format!(
            "{snap_volumes} snapshot volumes for {} snapshots ({snapshots:?}) and {asleep} hibernated sessions",
            snapshots.len()
        ));
    }
    for v in e.volumes.iter().filter(|v| !v.labels.contains_key("pyberth.snapshot")) {
        // A tmpfs workspace's keep volume (`<workspace>-keep`) belongs to the same container.
        let of = v.name.strip_suffix("-keep").unwrap_or(&v.name);
        if !e.containers.iter().any(|c| (c.name == v.name || c.name == of) && c.labels.contains_key("pyberth.session"))
        {
            bad.push(format!("volume {} belongs to no session container", v.name));
        }
    }
    for n in &e.networks {
        bad.push(format!("network {n} (no session here has egress)"));
    }
    let mut found = Found { bad, ..Found::default() };
    records_agree(w, &e, &listed, &before, &mut found);
    Ok(found)
}

/// The state dir's records against the engine and the listing. Every running session must
/// be recorded (or a restart loses it), every hibernated one too. A record naming something
/// the engine no longer has is stale: a note here (the next server drops it when it reads
/// it); none may be left when everything is closed ([`records_left`]).
fn records_agree(w: &World, e: &Engine, listed: &BTreeMap<String, String>, before: &[Value], found: &mut Found) {
    let sessions = records(w, "sessions");
    let sleepers = records(w, "sleepers");
    for c in e.containers.iter().filter(|c| c.running && c.labels.contains_key("pyberth.session")) {
        let named = |r: &Value| r["container"].as_str().is_some_and(|x| x == c.name || c.id.starts_with(x));
        if !sessions.iter().chain(&sleepers).chain(before).any(named) {
            let s = &c.labels["pyberth.session"];
            found.unrecorded(
                w,
                s,
                format!(
                    "running session {s} (container {}) has no record in sessions/ or sleepers/: a restart loses it",
                    c.name
                ),
            );
        }
    }
    for r in &sessions {
        let c = r["container"].as_str().unwrap_or_default();
        if !e.containers.iter().any(|x| x.name == c || x.id.starts_with(c)) {
            found.notes.push(format!("stale sessions/ record of {} (container gone)", r["name"]));
        }
    }
    let sleeper_volume = |r: &Value| r["saved"]["volume"].as_str().unwrap_or_default().to_owned();
    for (name, st) in listed {
        if st != "hibernated" {
            continue;
        }
        let recorded = sleepers
            .iter()
            .any(|r| r["name"] == name.as_str() && e.volumes.iter().any(|v| v.name == sleeper_volume(r)));
        if !recorded {
            found.unrecorded(
                w,
                name,
                format!("hibernated session {name} has no sleepers/ record of its snapshot: a restart loses it"),
            );
        }
    }
    for r in &sleepers {
        if !e.volumes.iter().any(|x| x.name == sleeper_volume(r)) {
            found.notes.push(format!("stale sleepers/ record of {} (volume gone)", r["name"]));
        }
    }
    for r in records(w, "snapshots") {
        let v = r["saved"]["volume"].as_str().unwrap_or_default();
        if !e.volumes.iter().any(|x| x.name == v) {
            found.notes.push(format!("stale snapshots/ record of {} (volume gone)", r["name"]));
        }
    }
}

/// What a look found.
#[derive(Default)]
struct Found {
    /// Not accounted for yet (hibernations and removals finish on their own time).
    bad: Vec<String>,
    /// Never to be waited out: a session unrecorded now is lost if the server dies now.
    hard: Vec<String>,
    /// Stale records.
    notes: Vec<String>,
}

impl Found {
    /// A session with no record: hard, unless a job of its own is waking it right now (a
    /// background run on a hibernated session answers before the wake is done).
    fn unrecorded(&mut self, w: &World, session: &str, what: String) {
        let waking = w.model.sessions.iter().any(|(s, h)| sname(*s) == session && h.job.is_some());
        if waking { self.bad.push(what) } else { self.hard.push(what) }
    }
}

/// Polls until everything is accounted for (hibernations and removals finish on their own
/// time), or fails with what is still not.
pub async fn settled(w: &World) -> Result<(), Broke> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut looks = 0;
    loop {
        let Found { bad, hard, notes } = look(w).await?;
        // PYBERTH_MODEL_NO_RECORD_AUDIT=1 skips this check, to see what a user meets instead.
        if !hard.is_empty() && std::env::var("PYBERTH_MODEL_NO_RECORD_AUDIT").is_err() {
            return Err(broke("audit", hard.join("; ")));
        }
        looks += 1;
        if looks == 2 {
            eprintln!("      audit: not settled at first look: {}", bad.join("; "));
        }
        if bad.is_empty() {
            if !notes.is_empty() {
                eprintln!("      note: {}", notes.join("; "));
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(broke("audit", format!("unaccounted after 20 s: {}", bad.join("; "))));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The records left in the state dir (with everything closed and the server stopped, none).
pub fn records_left(w: &World) -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["sessions", "sleepers", "snapshots"] {
        out.extend(records(w, dir).iter().map(|r| format!("{dir}/ record of {}", r["name"])));
    }
    if let Ok(instances) = std::fs::read_dir(w.state.join("jobs")) {
        for i in instances.flatten() {
            let files = std::fs::read_dir(i.path()).map(|d| d.count()).unwrap_or_default();
            if files > 0 {
                out.push(format!("{files} job files in jobs/{}", i.file_name().to_string_lossy()));
            }
        }
    }
    out
}

/// What is left of `prefix` on the engine after the last server stopped.
pub async fn left(prefix: &str) -> Vec<String> {
    let e = engine(prefix).await;
    let mut out: Vec<String> = e.containers.iter().map(|c| format!("container {}", c.name)).collect();
    out.extend(e.volumes.iter().map(|v| format!("volume {}", v.name)));
    out.extend(e.networks.iter().map(|n| format!("network {n}")));
    out
}

/// Removes everything labelled with an instance of `prefix` (ours alone), from a Drop.
pub fn sweep_blocking(prefix: &str) {
    let prefix = prefix.to_owned();
    let _ = std::thread::spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async {
            let d = docker().await;
            let e = engine(&prefix).await;
            for c in &e.containers {
                let opts = RemoveContainerOptionsBuilder::default().force(true).v(true).build();
                let _ = d.remove_container(&c.id, Some(opts)).await;
            }
            for v in &e.volumes {
                let opts = RemoveVolumeOptionsBuilder::default().force(true).build();
                let _ = d.remove_volume(&v.name, Some(opts)).await;
            }
            for n in &e.networks {
                let _ = d.remove_network(n).await;
            }
        });
    })
    .join();
}
