//! The runtime a command stands on, built in one place: the engine, the state dir, this
//! server's instance, the owners (the registry and what it holds) and their background tasks,
//! and the order they stop in. `serve`, `run`, `bench`, `image` and `layers` all start here, so
//! the start-up sequence is written once.

use std::path::PathBuf;
use std::sync::Arc;

use crate::docker::EngineRef;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{EngineKind, K8sMode, SandboxConfig};
use crate::docker;
use crate::docker::engine::EngineFacts;
use crate::instance::Instance;
use crate::session::registry::{Error as RegistryError, Registry};

/// Why the runtime could not start: the caller's settings, or the engine and the host.
/// `pyberth run` turns them into different exit codes (usage, infra).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting, the state dir or an environment definition is wrong: the caller can fix it.
    #[error("{0}")]
    Settings(String),
    /// The engine or the host failed.
    #[error("{0}")]
    Engine(String),
}

/// The engine, reached and checked, and the state dir: what every command needs first.
#[derive(Debug)]
pub struct Host {
    /// The engine.
    pub docker: EngineRef,
    /// The private state dir (locks, records).
    pub state_dir: PathBuf,
    /// What a Docker engine said when reached, for the check.
    greeting: std::sync::Mutex<Option<docker::Greeting>>,
}

impl Host {
    /// Validates the settings, reaches the engine and secures the state dir.
    pub async fn open(cfg: &SandboxConfig) -> Result<Self, Error> {
        cfg.validate().map_err(|e| Error::Settings(e.to_string()))?;
        let (docker, greeting): (EngineRef, _) = match cfg.engine {
            EngineKind::Docker => {
                let (docker, greeting) =
                    docker::connect(cfg.docker_host.as_deref()).await.map_err(|e| Error::Engine(e.to_string()))?;
                (Arc::new(docker), Some(greeting))
            }
            EngineKind::Kubernetes => (Arc::new(kubernetes(cfg).await?), None),
        };
        let state_dir = cfg.secure_state_dir().map_err(Error::Settings)?;
        Ok(Self { docker, state_dir, greeting: std::sync::Mutex::new(greeting) })
    }

    /// Checks the engine: settles the runtime (`auto` included) and the seccomp profile of
    /// sandboxes, says what is known to be wrong with it, and refuses under `--strict-engine`.
    pub async fn check(&self, cfg: &mut SandboxConfig, voice: Voice) -> Result<EngineFacts, Error> {
        if cfg.engine == EngineKind::Kubernetes {
            settle_for_kubernetes(cfg);
            return Ok(kubernetes_facts(cfg, voice));
        }
        let greeting = self.greeting.lock().unwrap_or_else(|e| e.into_inner()).take();
        let engine = docker::engine::check(&self.docker, &cfg.engine_ask(), voice == Voice::Loud, greeting)
            .await
            .map_err(Error::Engine)?;
        // The operator's `auto` settled, as validation settles a setting; what the engine
        // itself is found to be stays in the facts, never in the settings.
        cfg.runtime.clone_from(&engine.sandboxing.runtime);
        docker::identity::warn_overlaps(cfg.uid_range);
        Ok(engine)
    }

    /// This server's instance: a lock in the state dir that tells it from a dead one's leftovers.
    pub fn instance(&self, name: Option<&str>) -> Result<Instance, Error> {
        Instance::acquire(&self.state_dir, name)
            .map_err(|e| Error::Engine(format!("cannot take an instance lock in {}: {e}", self.state_dir.display())))
    }
}

/// Turns off, with a word, what does not apply on Kubernetes: pyberth's own pool in
/// agent-sandbox mode. Leaving sessions for the next server stays as configured: their pods
/// are found again by name and label, and adopted from the state dir's records as containers
/// are (`session/registry/adopt.rs`, docs/kubernetes.md). `serve` calls it before it decides
/// whether a stop leaves sessions.
pub fn settle_for_kubernetes(cfg: &mut SandboxConfig) {
    if cfg.engine != EngineKind::Kubernetes {
        return;
    }
    // agent-sandbox's warm pools (`k8s_warm_pool`) take the place of ours: each pooled
    // container of ours would be a claim held on a warm sandbox, two pools for one.
    if cfg.k8s_mode == K8sMode::AgentSandbox && cfg.pool_size > 0 {
        tracing::info!("pool_size is off: agent-sandbox's warm pools (k8s_warm_pool) keep sandboxes ready");
        cfg.pool_size = 0;
    }
}

/// The Kubernetes engine of the settings: their namespace, kubeconfig and context reached.
async fn kubernetes(cfg: &SandboxConfig) -> Result<crate::k8s::engine::KubeEngine, Error> {
    let at = crate::k8s::cluster::Connect {
        kubeconfig: cfg.kubeconfig.clone(),
        context: cfg.k8s_context.clone(),
        namespace: cfg.k8s_namespace.clone(),
    };
    let shelf = cfg.k8s_snapshot_dir.clone().unwrap_or_else(|| cfg.state_dir().join("k8s-snapshots"));
    let engine = crate::k8s::engine::KubeEngine::connect(&at, cfg.k8s_runtime_class.clone())
        .await
        .map_err(|e| Error::Engine(e.to_string()))?
        .with_egress_image(cfg.k8s_egress_image.clone())
        .with_layer_claim(cfg.k8s_layer_claim.clone())
        .with_snapshots(shelf.clone())
        .map_err(|e| Error::Settings(format!("cannot use {} for snapshots: {e}", shelf.display())))?;
    Ok(match cfg.k8s_mode {
        K8sMode::Pods => engine,
        K8sMode::AgentSandbox => engine.agent_sandbox(cfg.k8s_warm_pool, cfg.uid_range.first),
    })
}

/// What a Kubernetes engine is, for the owners: the runtime is the pods' RuntimeClass, the
/// seccomp profile the runtime's default (both are the pod spec's, not Docker's).
fn kubernetes_facts(cfg: &SandboxConfig, voice: Voice) -> EngineFacts {
    let runtime = cfg.k8s_runtime_class.clone().unwrap_or_else(|| "the cluster's default".into());
    if voice == Voice::Loud {
        let mode = match cfg.k8s_mode {
            K8sMode::Pods => "plain Pods",
            K8sMode::AgentSandbox => "agent-sandbox claims",
        };
        tracing::info!(namespace = %cfg.k8s_namespace, runtime_class = %runtime, mode, "sandboxes are pods of a Kubernetes cluster");
    }
    let gvisor = cfg.k8s_runtime_class.as_deref().is_some_and(|r| r.contains("gvisor") || r.starts_with("runsc"));
    EngineFacts {
        engine: "kubernetes".into(),
        runc: None,
        runtime: runtime.clone(),
        default_runtime: runtime,
        gvisor: None,
        warnings: Vec::new(),
        sandboxing: docker::container::Sandboxing { runtime: None, gvisor, seccomp_profile: None },
    }
}

/// How loudly a command speaks of the engine at start (`pyberth run` shares stderr with the
/// program it runs, so it keeps quiet).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Voice {
    /// Engine facts and warnings at INFO and WARN.
    Loud,
    /// At DEBUG only.
    Quiet,
}

/// A started server: its settings as the engine settled them, the engine's facts, and the
/// registry with everything it owns.
#[derive(Debug)]
pub struct Runtime {
    /// The settings, with the runtime the engine check chose.
    pub cfg: Arc<SandboxConfig>,
    /// What the engine check found.
    pub engine: EngineFacts,
    /// Sessions and everything they use.
    pub registry: Arc<Registry>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    /// The audit log's writer, stopped last (the stop's own events go there too).
    audit: Option<crate::audit::Writer>,
}

impl Runtime {
    /// Checks the engine, takes this server's instance, builds the owners and adopts or sweeps
    /// what stopped servers left behind (`pyberth run`: no background tasks).
    pub async fn start(cfg: SandboxConfig, voice: Voice) -> Result<Self, Error> {
        let runtime = Self::build(cfg, voice).await?;
        runtime.sweep(voice).await;
        Ok(runtime)
    }

    /// [`Runtime::start`] for a long-lived server, with its background tasks, all started
    /// after the adoption and sweep of what stopped servers left (calls are served only after
    /// them too). Starting the warm pool before the adoption measured within the noise of the
    /// start row (docs/benchmarks.md, 2026-11-27), and adds a container being made to what the
    /// adoption races: the pool waits for it, as before.
    pub async fn serve(cfg: SandboxConfig) -> Result<Self, Error> {
        let runtime = Self::start(cfg, Voice::Loud).await?;
        runtime.background();
        Ok(runtime)
    }

    async fn build(mut cfg: SandboxConfig, voice: Voice) -> Result<Self, Error> {
        let host = Host::open(&cfg).await?;
        let engine = host.check(&mut cfg, voice).await?;
        let instance = host.instance(cfg.instance.as_deref())?;
        if voice == Voice::Loud {
            tracing::info!(instance = %instance.owner.instance, runtime = %engine.runtime, "pyberth starting");
        }
        let cfg = Arc::new(cfg);
        let (writer, audit) = match audit_sink(&cfg) {
            Some(sink) => {
                let (w, a) = crate::audit::Writer::start(&sink).map_err(Error::Settings)?;
                (Some(w), a)
            }
            None => (None, crate::audit::Audit::off()),
        };
        audit.emit(config_loaded(&cfg));
        let registry = Arc::new(
            Registry::new(host.docker, cfg.clone(), instance, engine.sandboxing.clone())
                .map_err(Error::Settings)?
                .with_audit(audit),
        );
        Ok(Self { cfg, engine, registry, shutdown: CancellationToken::new(), tasks: TaskTracker::new(), audit: writer })
    }

    /// Adopts or sweeps what stopped servers left behind, and starts this one's heartbeat.
    async fn sweep(&self, voice: Voice) {
        // On Kubernetes a server's heartbeat is a Lease, known dead only once it lapsed
        // (`k8s/engine/beats.rs`): the sweep runs again every grace (5 s to a minute) so a
        // killed server's pods go without waiting for the next start. Not `pyberth run`
        // (quiet), a short guest.
        let again = (self.cfg.engine == EngineKind::Kubernetes && voice == Voice::Loud).then(|| {
            self.cfg.leftover_grace().clamp(std::time::Duration::from_secs(5), std::time::Duration::from_secs(60))
        });
        if let Err(e) = self.registry.sweep_leftovers(again).await {
            tracing::warn!(error = %e, "cannot sweep leftovers of dead instances");
        }
    }

    /// A token cancelled when the runtime stops (and that a front may cancel to stop it).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// The tasks of a long-lived server: the idle reaper, the quota keeper, the warm pool, and
    /// the image found or built now so the first call does not wait for it.
    fn background(&self) {
        self.tasks.spawn(self.registry.clone().reaper(self.shutdown.clone()));
        self.tasks.spawn(self.registry.clone().quota_keeper(self.shutdown.clone()));
        self.tasks.spawn(self.registry.clone().pool_keeper(self.shutdown.clone()));
        let warm = self.registry.clone();
        let stop = self.shutdown.clone();
        self.tasks.spawn(async move {
            let built = match warm.environments.get(None) {
                Ok(env) => tokio::select! {
                    built = warm.image(&env, &|_| {}) => built.map(|_| ()),
                    () = stop.cancelled() => Ok(()),
                },
                Err(e) => Err(RegistryError::Environment(e)),
            };
            if let Err(e) = built {
                tracing::error!(error = %e, "sandbox image unavailable");
            }
        });
    }

    /// Spawns a task the runtime owns: it is waited for at [`Runtime::stop`].
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<()>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.tasks.spawn(task)
    }

    /// Stops the background tasks, then the registry. With `leave`, sessions stay for the next
    /// server of the state dir (docs/design.md D12).
    pub async fn stop(self, leave: bool) {
        self.shutdown.cancel();
        self.tasks.close();
        // The tasks first: a pool container being made when the stop came must be in the pool
        // (or gone) before the registry removes what it holds, or it outlives the server.
        self.tasks.wait().await;
        self.registry.shutdown(leave).await;
        if let Some(w) = self.audit {
            w.finish().await;
        }
    }
}

/// Where `--audit-log` sends records, if anywhere (`-`: stdout).
fn audit_sink(cfg: &SandboxConfig) -> Option<crate::audit::Sink> {
    let path = cfg.audit_log.as_ref()?;
    Some(if path.as_os_str() == "-" {
        crate::audit::Sink::Stdout
    } else {
        crate::audit::Sink::File {
            path: path.clone(),
            max_bytes: cfg.audit_log_mb.saturating_mul(1 << 20),
            keep: cfg.audit_log_keep,
        }
    })
}

/// The record of the settings a server started with: their hash (secrets are in upstream
/// settings and the environment: none of them is written), and how many principals have quotas.
fn config_loaded(cfg: &SandboxConfig) -> crate::audit::Event {
    let sha = crate::audit::sha256_hex(&serde_json::to_vec(cfg).unwrap_or_default());
    crate::audit::Event::new("config_loaded", "server")
        .field("config_sha256", sha)
        .field("principals", cfg.principals.len())
        .field("version", env!("CARGO_PKG_VERSION"))
}
