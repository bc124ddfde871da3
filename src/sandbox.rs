//! What a session's containers are made from: the settings of its environment, what the
//! engine found at start, its mounts and its egress, put together once by the owner that makes
//! the session and handed down as plain data. The engine reads the [`container::Spec`];
//! nothing is written back into the settings.

use std::sync::Arc;

use crate::docker::Engine;

use crate::config::SandboxConfig;
use crate::docker;
use crate::docker::container::{self, Created, Owner, Sandboxing};
use crate::egress::Attachment;
use crate::environment::spec::MountSpec;

/// The make of a session's containers, for its life (a container replaced, a wake, a restore
/// are made from the same blueprint).
#[derive(Debug)]
pub struct Blueprint {
    /// The settings of the session's environment.
    pub cfg: Arc<SandboxConfig>,
    /// What the engine is told.
    pub spec: container::Spec,
    /// The session's egress attachment, when it has a network.
    pub egress: Option<Arc<Attachment>>,
    /// Its environment's read-only host folders, as the operator named them.
    pub mounts: Vec<MountSpec>,
    /// Where its runs are audited and charged (off unless the registry sets it).
    pub oversight: crate::audit::Oversight,
    /// The server's metrics, which its sessions' runs and wakes add to.
    pub metrics: Arc<crate::metrics::Metrics>,
}

impl Blueprint {
    /// The blueprint of sessions of an environment's settings, with their mounts and egress.
    pub fn new(
        cfg: Arc<SandboxConfig>,
        sandboxing: &Sandboxing,
        mounts: &[MountSpec],
        egress: Option<Arc<Attachment>>,
    ) -> Self {
        let spec = container::Spec {
            memory_mb: cfg.memory_mb,
            cpus: cfg.cpus,
            pids: cfg.pids,
            tmp_mb: cfg.tmp_mb,
            workspace_mb: cfg.workspace_bound_mb(),
            uid_range: cfg.uid_range,
            sandboxing: sandboxing.clone(),
            mounts: mounts.iter().map(|m| container::read_only_bind(&m.host, &m.path)).collect(),
            network: egress.as_ref().map(|a| a.join()),
            orphan_after: cfg.orphan_after(),
        };
        Self {
            cfg,
            spec,
            egress,
            mounts: mounts.to_vec(),
            oversight: crate::audit::Oversight::default(),
            metrics: Arc::default(),
        }
    }

    /// The same, its sessions counted in `metrics` (the registry's).
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Makes and starts a container with `store` (the layer store's read-only mount) as well:
    /// the engine's create, then egress finishes (the CA bundle in place before any code runs).
    pub async fn create(
        &self,
        docker: &dyn Engine,
        store: bollard::models::Mount,
        image: &str,
        owner: &Owner,
        label: &str,
        principal: &str,
    ) -> Result<Created, docker::Error> {
        let mut spec = self.spec.clone();
        spec.mounts.insert(0, store);
        let made = container::create(docker, &spec, image, owner, label, principal).await?;
        if let Err(e) = self.tether_and_egress(docker, &made.id, &spec).await {
            self.remove(docker, &made).await;
            return Err(e);
        }
        Ok(made)
    }

    /// Removes a container made from this blueprint, its egress policy out of the proxy first:
    /// on Kubernetes the pod's address may be the next pod's (`egress::Attachment::unbind`).
    pub async fn remove(&self, docker: &dyn Engine, made: &Created) {
        if let Some(egress) = &self.egress {
            egress.unbind().await;
        }
        container::destroy(docker, made).await;
    }

    /// A started container tethered to this server, never able to outlive it for good
    /// (docs/design.md D12), then egress finished (its CA bundle in place before any code).
    async fn tether_and_egress(
        &self,
        docker: &dyn Engine,
        id: &str,
        spec: &container::Spec,
    ) -> Result<(), docker::Error> {
        docker::tether::hold(docker, id, spec.orphan_after).await?;
        if let Some(egress) = &self.egress {
            egress.after_start(docker, id).await?;
        }
        Ok(())
    }

    /// A new container on the volumes a session kept when its container went with no server
    /// (docs/design.md D12, orphans): made on `volume` as `uid`, a tmpfs workspace's copy put
    /// back, then tethered and given its egress, as [`Blueprint::create`] does. On failure the
    /// volumes stay; the caller decides.
    #[allow(clippy::too_many_arguments)] // `create`'s parts, and the volume and uid it had
    pub async fn recreate(
        &self,
        docker: &dyn Engine,
        store: bollard::models::Mount,
        image: &str,
        owner: &Owner,
        label: &str,
        principal: &str,
        volume: &str,
        uid: u32,
    ) -> Result<Created, docker::Error> {
        let mut spec = self.spec.clone();
        spec.mounts.insert(0, store);
        let made = container::recreate(docker, &spec, image, owner, label, principal, volume, uid).await?;
        let finish = async {
            // Before the tether, which empties the copy (the copy is back by then).
            docker::exec::run_as_code(docker, &made.id, uid, docker::tether::COPY_BACK).await?;
            self.tether_and_egress(docker, &made.id, &spec).await
        };
        if let Err(e) = finish.await {
            if let Some(egress) = &self.egress {
                egress.unbind().await;
            }
            container::remove_container(docker, &made.id).await;
            return Err(e);
        }
        Ok(made)
    }
}
