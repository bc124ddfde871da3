//! Everything that speaks to the Docker engine lives below this module, so that another
//! backend (Kubernetes pods through their exec API) can sit beside it later (docs/design.md D10).
//! The owners reach an engine only through the seam, [`Engine`] (`seam/`); the lib tests put
//! an in-process fake engine behind it (`fake/`, test-only).

pub mod archive;
pub mod chunks;
pub mod container;
mod copyback;
pub mod engine;
pub mod exec;
#[cfg(test)]
pub(crate) mod fake;
pub mod heartbeat;
pub mod identity;
pub mod image;
pub mod inventory;
pub mod seam;
pub mod snapshot;
pub mod tether;
pub(crate) mod unpack;
pub(crate) mod utility;
mod volume;

use bollard::Docker;

pub use seam::{Body, Counted, Engine, EngineRef, IntoEngine, body_full, body_try_stream};

/// Label on everything pyberth creates.
pub const LABEL_MANAGED: &str = "pyberth.managed";
/// Label naming the server instance that owns a container or volume.
pub const LABEL_INSTANCE: &str = "pyberth.instance";
/// Label naming the host the owning instance runs on (liveness can only be checked there).
pub const LABEL_HOST: &str = "pyberth.host";
/// Label naming the session of a container or volume.
pub const LABEL_SESSION: &str = "pyberth.session";
/// Label naming the owner (principal) of a session.
pub const LABEL_OWNER: &str = "pyberth.owner";
/// Label on images pyberth builds.
pub const LABEL_IMAGE: &str = "pyberth.image";

/// A failure talking to Docker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The engine answered with an error or could not be reached.
    #[error("{}", describe(.0))]
    Engine(#[from] bollard::errors::Error),
    /// No engine answered at connect time.
    #[error("no Docker engine answers at {at} ({cause}): is it running? is DOCKER_HOST right?")]
    Unreachable {
        /// Where we asked (`DOCKER_HOST`, or the local socket).
        at: String,
        /// The engine's or the transport's word.
        cause: bollard::errors::Error,
    },
    /// `DOCKER_HOST` names a transport this build does not speak.
    #[error("unsupported DOCKER_HOST {0:?}: use unix:///path/to/docker.sock or tcp://host:port")]
    UnsupportedHost(String),
    /// Neither a registry nor the offline bootstrap could provide a base image.
    #[error("{0}")]
    NoBaseImage(String),
    /// The image build failed.
    #[error("image build failed: {0}")]
    Build(String),
    /// The image the operator named (`--image`) is not on the engine; nothing was built.
    #[error("image {0} (from --image/PYBERTH_IMAGE) does not exist: build or load it, or unset the setting")]
    MissingImage(String),
    /// Docker gave an exec a detached stream although we asked to attach.
    #[error("docker did not attach to the exec")]
    NotAttached,
    /// A local I/O failure (running the bootstrap script).
    #[error("{context}")]
    Io {
        /// What was being done.
        context: String,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
}

/// An engine's own account of a failure (the Kubernetes engine's: a refusal naming the Role,
/// a pod that never ran), carried in a bollard I/O error and passed on in its words: the
/// caller reads the cluster's terms, not "Docker responded with status code …".
#[derive(Debug)]
pub struct OwnWords(pub String);

impl std::fmt::Display for OwnWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for OwnWords {}

/// Says plainly when the engine itself is away (stopped, restarting, socket gone), so a caller
/// knows to retry later rather than to change its request.
fn describe(e: &bollard::errors::Error) -> String {
    use bollard::errors::Error as B;
    match e {
        // An engine's "not supported here" (the Kubernetes engine's): its own words.
        B::IOError { err } if err.kind() == std::io::ErrorKind::Unsupported => err.to_string(),
        B::IOError { err } if err.get_ref().is_some_and(|i| i.is::<OwnWords>()) => err.to_string(),
        B::IOError { .. }
        | B::HyperResponseError { .. }
        | B::HyperLegacyError { .. }
        | B::SocketNotFoundError(_)
        | B::RequestTimeoutError => {
            format!("the Docker engine is not answering ({e}); retry when it is back")
        }
        _ => format!("docker: {e}"),
    }
}

impl Error {
    /// True when Docker said the container (or exec) does not exist or is not running.
    pub fn is_gone(&self) -> bool {
        matches!(self, Error::Engine(bollard::errors::Error::DockerResponseServerError { status_code: 404 | 409, .. }))
    }
}

/// What the engine said when first reached, asked in the same round trip as the API version's
/// negotiation: the engine check (`engine::check`) reads it instead of asking again.
#[derive(Debug)]
pub struct Greeting {
    /// The engine's version and components (runc's among them).
    pub version: Result<bollard::models::SystemVersion, String>,
    /// Its runtimes and default runtime.
    pub info: Result<bollard::models::SystemInfo, String>,
}

/// Connects to the engine named by `host` (or the local socket), negotiates the API version,
/// and reads the engine's version and info meanwhile.
pub async fn connect(host: Option<&str>) -> Result<(Docker, Greeting), Error> {
    let docker = match host {
        None | Some("") => Docker::connect_with_local_defaults()?,
        Some(h) if h.starts_with("unix://") => Docker::connect_with_unix(h, 120, bollard::API_DEFAULT_VERSION)?,
        Some(h) if h.starts_with("tcp://") || h.starts_with("http://") => {
            Docker::connect_with_http(h, 120, bollard::API_DEFAULT_VERSION)?
        }
        Some(h) => return Err(Error::UnsupportedHost(h.to_owned())),
    };
    // bollard 0.21.1 sends unversioned requests; negotiating pins the engine's own version so
    // that later bollard releases keep working against older engines (docs/api-facts.md §3).
    // The version and info the engine check reads ride along, unversioned (the engine answers
    // in its own API version): start-up waits for one round trip (about 10 ms each here, the
    // engine asks runc for its version), not three. A negotiation answered proves the engine
    // reachable: no ping besides.
    let at = host.filter(|h| !h.is_empty()).unwrap_or("the local socket").to_owned();
    let unreachable = |cause| Error::Unreachable { at: at.clone(), cause };
    let (negotiated, version, info) = tokio::join!(docker.clone().negotiate_version(), docker.version(), docker.info());
    let docker = negotiated.map_err(unreachable)?;
    let greeting = Greeting { version: version.map_err(|e| e.to_string()), info: info.map_err(|e| e.to_string()) };
    Ok((docker, greeting))
}

/// A name part new on each call: our container, volume and network names are
/// `pyberth-<instance>-<what>-<serial>`, unique even when one thing is made again. A serial
/// alone restarts in each process, and a server that adopted an earlier one's sessions names
/// their new containers with that server's instance: so each serial follows a tag of this
/// process (its pid and start time), and a name the earlier server used is never met again.
pub fn next_serial() -> String {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    static TAG: OnceLock<String> = OnceLock::new();
    let tag = TAG.get_or_init(|| {
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let nanos = since.as_secs().wrapping_mul(1_000_000_000) ^ u64::from(since.subsec_nanos());
        // Six hex digits: the fixed width keeps "tag then serial" unambiguous.
        let mixed = nanos ^ u64::from(std::process::id()).rotate_left(20);
        format!("{:06x}", mixed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40)
    });
    format!("{tag}{}", SERIAL.fetch_add(1, Ordering::Relaxed))
}

/// Where the session workspace (a named volume) is mounted, and the code's working directory.
pub const WORKSPACE: &str = "/workspace";
/// uid:gid of PID 1 (init + sleep). User code runs under a uid of its own per container
/// (`identity`), never this one, so code cannot signal PID 1.
pub const INIT_USER: &str = "999:999";
/// The fixed environment of every sandbox. The server's own environment never reaches it.
/// The code's uid has no passwd entry: `USER` and `LOGNAME` name it for libraries that ask
/// (`getpass.getuser()` reads them first), `HOME` is the workspace.
pub const ENV: [&str; 9] = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/workspace",
    "USER=sandbox",
    "LOGNAME=sandbox",
    "LANG=C.UTF-8",
    "TMPDIR=/tmp",
    "PYTHONDONTWRITEBYTECODE=1",
    "PYTHONUNBUFFERED=1",
    "MPLBACKEND=Agg",
];
/// Where libraries keep their caches: the sandbox's /tmp, not the workspace (`HOME`), so they
/// never show in list_files, archives, snapshots or `pyberth run --output` (issue 28). Unlike
/// [`ENV`], a caller may set these (a run's `env`, `session_env`).
pub const CACHE_ENV: [&str; 4] = [
    "XDG_CACHE_HOME=/tmp/.cache",
    "MPLCONFIGDIR=/tmp/.cache/matplotlib",
    "PIP_CACHE_DIR=/tmp/.cache/pip",
    "IPYTHONDIR=/tmp/.cache/ipython",
];
