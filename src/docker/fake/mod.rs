//! An in-process engine for the lib tests (test-only: compiled under `cfg(test)`): containers
//! with their labels and state, volumes with their files, networks and images, all in memory,
//! behind the same [`Engine`] trait as Docker. An attached exec of the agent's command line
//! reaches a fake agent that speaks the real protocol (`agent.rs`); other execs succeed at
//! once, and `kill -KILL -1` kills the container's interpreter.
//!
//! It answers as Docker does where the owners read the answer: 404 for what is not there,
//! 409 for a name taken, a container not running or a volume in use; a volume created again
//! under its name is the one there; a mount of a missing volume makes an unlabelled one. What
//! it cannot do (build or pull an image, run a utility container's script) fails loudly.

mod agent;
mod engine;
mod files;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

use bollard::errors::Error;
use bollard::exec::StartExecResults;
use bollard::models::{ContainerCreateBody, MountType};
use bytes::Bytes;
use futures::StreamExt;

use self::agent::Interp;
pub(crate) use self::files::Files;

/// A container of the fake engine.
#[derive(Debug)]
pub(crate) struct Ctr {
    pub(crate) labels: HashMap<String, String>,
    pub(crate) image: String,
    pub(crate) running: bool,
    /// (target, volume) of each volume mount.
    pub(crate) mounts: Vec<(String, String)>,
    pub(crate) networks: BTreeSet<String>,
    /// The interpreter its agent runs, while one runs.
    interp: Option<Arc<Interp>>,
}

/// A volume of the fake engine.
#[derive(Debug, Default)]
pub(crate) struct Vol {
    pub(crate) labels: HashMap<String, String>,
    pub(crate) files: Files,
}

/// A network of the fake engine.
#[derive(Debug, Default)]
pub(crate) struct Net {
    pub(crate) labels: HashMap<String, String>,
}

/// See [`World::on_remove`].
#[derive(Clone, Default)]
pub(crate) struct OnRemove(pub(crate) Option<Probe>);

/// A test's look, given a container's name.
pub(crate) type Probe = Arc<dyn Fn(&str) + Send + Sync>;

impl std::fmt::Debug for OnRemove {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "OnRemove(set)" } else { "OnRemove(none)" })
    }
}

#[derive(Debug)]
struct Exec {
    container: String,
    cmd: Vec<String>,
}

/// Everything the fake engine holds.
#[derive(Debug, Default)]
pub(crate) struct World {
    /// Containers by name (their id too).
    pub(crate) containers: BTreeMap<String, Ctr>,
    pub(crate) volumes: BTreeMap<String, Vol>,
    pub(crate) networks: BTreeMap<String, Net>,
    pub(crate) images: BTreeSet<String>,
    /// Calls of the stats API (the CPU watchdog's samples).
    pub(crate) stats_calls: usize,
    /// How long a container's start takes (none: at once), and the most starts seen under
    /// way at one time: a test's view of how many containers are made at once.
    pub(crate) start_takes: Option<std::time::Duration>,
    pub(crate) starting: usize,
    pub(crate) most_starting: usize,
    /// The memory the stats API reports for every running container (none: not reported).
    pub(crate) idle_bytes: Option<u64>,
    /// Called with each container's name as it is removed (under the world's lock): a test's
    /// look at that moment, e.g. at the state dir's records.
    pub(crate) on_remove: OnRemove,
    execs: HashMap<String, Exec>,
    serial: u64,
}

impl World {
    fn next(&mut self) -> u64 {
        self.serial += 1;
        self.serial
    }

    /// The volume mounted at `/workspace` in `container`.
    pub(crate) fn workspace(&mut self, container: &str) -> Option<&mut Files> {
        let c = self.containers.get(container)?;
        let (_, volume) = c.mounts.iter().find(|(t, _)| t == super::WORKSPACE)?;
        let volume = volume.clone();
        self.volumes.get_mut(&volume).map(|v| &mut v.files)
    }

    /// The volume holding `path` of `container`, and the path's key in it.
    fn resolve(&self, container: &str, path: &str) -> Result<(String, String), Error> {
        let c = self.containers.get(container).ok_or_else(|| no_such("container", container))?;
        let path = files::key(path).ok_or_else(|| status(400, format!("bad path {path}")))?;
        let (target, volume) = c
            .mounts
            .iter()
            .filter_map(|(t, v)| Some((files::key(t)?, v)))
            .filter(|(t, _)| path == *t || path.starts_with(&format!("{t}/")))
            .max_by_key(|(t, _)| t.len())
            .ok_or_else(|| status(500, format!("the fake engine has no root filesystem: {path}")))?;
        let rest = path[target.len()..].trim_start_matches('/').to_owned();
        Ok((volume.clone(), rest))
    }

    /// Kills a container's interpreter (its agent's stream ends).
    fn kill(&mut self, container: &str) {
        if let Some(i) = self.containers.get_mut(container).and_then(|c| c.interp.take()) {
            i.stop.cancel();
        }
    }
}

/// The in-process engine. Clones share one world.
#[derive(Debug, Clone, Default)]
pub(crate) struct FakeEngine {
    world: Arc<Mutex<World>>,
}

fn status(status_code: u16, message: String) -> Error {
    Error::DockerResponseServerError { status_code, message }
}

fn no_such(what: &str, name: &str) -> Error {
    status(404, format!("No such {what}: {name}"))
}

impl FakeEngine {
    /// An engine holding `images`.
    pub(crate) fn with_images(images: &[String]) -> Self {
        let fake = Self::default();
        fake.world().images.extend(images.iter().cloned());
        fake
    }

    /// The world, to look at or to change (a test kills a container behind the owners' back).
    pub(crate) fn world(&self) -> std::sync::MutexGuard<'_, World> {
        self.world.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Removes a container behind the owners' back (`docker rm -f` by someone else): its
    /// interpreter dies, its volumes stay.
    pub(crate) fn vanish(&self, name: &str) {
        let mut w = self.world();
        w.kill(name);
        w.containers.remove(name);
    }

    fn create_container_now(&self, name: Option<String>, body: ContainerCreateBody) -> Result<String, Error> {
        let mut w = self.world();
        let name = match name {
            Some(n) => n,
            None => format!("fake-{}", w.next()),
        };
        if w.containers.contains_key(&name) {
            return Err(status(409, format!("Conflict. The container name \"/{name}\" is already in use")));
        }
        let image = body.image.unwrap_or_default();
        if !w.images.contains(&image) {
            return Err(no_such("image", &image));
        }
        let hc = body.host_config.unwrap_or_default();
        let mut mounts = Vec::new();
        for m in hc.mounts.unwrap_or_default() {
            if m.typ == Some(MountType::VOLUME)
                && let (Some(target), Some(source)) = (m.target, m.source)
            {
                // Docker makes a missing named volume, unlabelled.
                w.volumes.entry(source.clone()).or_default();
                mounts.push((target, source));
            }
        }
        let networks = hc.network_mode.into_iter().filter(|n| n != "none" && n != "bridge").collect();
        let labels = body.labels.unwrap_or_default();
        w.containers.insert(name.clone(), Ctr { labels, image, running: false, mounts, networks, interp: None });
        Ok(name)
    }

    fn start_exec_now(&self, exec_id: &str) -> Result<StartExecResults, Error> {
        let mut w = self.world();
        let exec = w.execs.get(exec_id).ok_or_else(|| no_such("exec instance", exec_id))?;
        let (container, cmd) = (exec.container.clone(), exec.cmd.clone());
        if !w.containers.get(&container).is_some_and(|c| c.running) {
            return Err(status(409, format!("Container {container} is not running")));
        }
        if cmd.iter().any(|a| a == "/opt/pyberth/agent.py") {
            let pid = u32::try_from(w.next()).unwrap_or(u32::MAX);
            let c = w.containers.get_mut(&container).ok_or_else(|| no_such("container", &container))?;
            let interp = c.interp.get_or_insert_with(|| Interp::new(pid)).clone();
            let stop = interp.stop.clone();
            drop(w);
            let (theirs, ours) = tokio::io::duplex(64 << 10);
            let (tx, mut rx) = tokio::sync::mpsc::channel(64);
            // Owned by the connection: it ends when the server drops the exec's stdin, or
            // when the interpreter is killed (`kill -KILL -1`, its container removed).
            tokio::spawn(agent::serve(self.world.clone(), container, interp, ours, tx));
            // A killed interpreter's stream ends at once, as the relay's does when its agent dies.
            let output =
                futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).take_until(stop.cancelled_owned()).boxed();
            return Ok(StartExecResults::Attached { output, input: Box::pin(theirs) });
        }
        if cmd.last().is_some_and(|s| s == "kill -KILL -1") {
            w.kill(&container);
        }
        Ok(StartExecResults::Attached { output: futures::stream::empty().boxed(), input: Box::pin(tokio::io::sink()) })
    }

    fn remove_volume_now(&self, name: &str) -> Result<(), Error> {
        let mut w = self.world();
        if !w.volumes.contains_key(name) {
            return Err(no_such("volume", name));
        }
        if w.containers.values().any(|c| c.mounts.iter().any(|(_, v)| v == name)) {
            return Err(status(409, format!("remove {name}: volume is in use")));
        }
        w.volumes.remove(name);
        Ok(())
    }

    fn upload_now(&self, container: &str, path: &str, tar: &[u8]) -> Result<(), Error> {
        let mut w = self.world();
        let (volume, at) = w.resolve(container, path)?;
        let vol = w.volumes.get_mut(&volume).ok_or_else(|| no_such("volume", &volume))?;
        vol.files.unpack(&at, tar).map_err(|e| status(400, e))
    }

    fn download_now(&self, container: &str, path: &str) -> Result<Bytes, Error> {
        let w = self.world();
        let (volume, at) = w.resolve(container, path)?;
        let vol = w.volumes.get(&volume).ok_or_else(|| no_such("volume", &volume))?;
        if !vol.files.is_dir(&at) {
            return Err(status(404, format!("Could not find the file {path} in container {container}")));
        }
        let top = path.trim_end_matches('/').rsplit('/').next().unwrap_or_default();
        vol.files.pack(&at, top).map(Bytes::from).map_err(|e| status(500, e))
    }
}
