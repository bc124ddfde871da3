//! What carries our labels on the engine, and the sweep that removes what dead server
//! instances left behind (docs/design.md D9).

use std::collections::HashMap;

use crate::docker::Engine;
use bollard::query_parameters::{
    ListContainersOptionsBuilder, ListVolumesOptionsBuilder, RemoveContainerOptionsBuilder, RemoveVolumeOptionsBuilder,
};

use super::container::{removal_under_way, short};
use super::{Error, LABEL_MANAGED};

/// A container carrying our label, as a listing shows it.
#[derive(Debug, Clone)]
pub struct Found {
    /// Container id.
    pub id: String,
    /// Its name (without the engine's leading `/`); a session container's is its workspace
    /// volume's.
    pub name: String,
    /// Its labels.
    pub labels: HashMap<String, String>,
    /// Not provably stopped: any state but created, exited or dead.
    pub running: bool,
    /// Creation time, seconds since the epoch, by the engine's clock.
    pub created: Option<i64>,
}

/// Everything carrying our label: containers (running or not) and volumes with their labels.
#[derive(Debug, Default)]
pub struct Inventory {
    /// Containers.
    pub containers: Vec<Found>,
    /// Volumes: name and labels.
    pub volumes: Vec<(String, HashMap<String, String>)>,
}

/// Lists everything carrying our label: two engine calls.
pub async fn inventory(docker: &dyn Engine) -> Result<Inventory, Error> {
    use bollard::models::ContainerSummaryStateEnum as S;
    let filters = HashMap::from([("label", vec![LABEL_MANAGED])]);
    let opts = ListContainersOptionsBuilder::default().all(true).filters(&filters).build();
    let containers = docker
        .list_containers(Some(opts))
        .await?
        .into_iter()
        .filter_map(|c| {
            let name = c.names.as_ref().and_then(|n| n.first()).map(|n| n.trim_start_matches('/').to_owned());
            Some(Found {
                id: c.id?,
                name: name.unwrap_or_default(),
                labels: c.labels.unwrap_or_default(),
                running: !matches!(c.state, Some(S::CREATED | S::EXITED | S::DEAD)),
                created: c.created,
            })
        })
        .collect();
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let volumes = docker
        .list_volumes(Some(opts))
        .await?
        .volumes
        .unwrap_or_default()
        .into_iter()
        .map(|v| (v.name, v.labels))
        .collect();
    Ok(Inventory { containers, volumes })
}

/// Removes (killing) a leftover container; true when it was removed by this call.
pub async fn remove_leftover_container(docker: &dyn Engine, id: &str) -> bool {
    let opts = RemoveContainerOptionsBuilder::default().force(true).v(true).build();
    match docker.remove_container(id, Some(opts)).await {
        Ok(()) => true,
        // Already going, by a close of our own (shutdown's final sweep meets it) or gone.
        Err(e) if removal_under_way(&e) => false,
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => false,
        Err(e) => {
            tracing::warn!(container = %short(id), error = %e, "cannot remove leftover container");
            false
        }
    }
}

/// Removes a leftover volume; true when it was removed by this call.
pub async fn remove_leftover_volume(docker: &dyn Engine, name: &str) -> bool {
    let opts = RemoveVolumeOptionsBuilder::default().force(true).build();
    match docker.remove_volume(name, Some(opts)).await {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(volume = %name, error = %e, "cannot remove leftover volume");
            false
        }
    }
}

/// Removes the containers, then the volumes, carrying our label for which `pick` says yes
/// (the shutdown's belt and braces: this instance's own). Returns how many of each went.
pub async fn sweep(
    docker: &dyn Engine,
    pick: &(dyn Fn(&HashMap<String, String>) -> bool + Send + Sync),
) -> Result<(usize, usize), Error> {
    let found = inventory(docker).await?;
    let mut containers = 0;
    for c in found.containers.iter().filter(|c| pick(&c.labels)) {
        containers += usize::from(remove_leftover_container(docker, &c.id).await);
    }
    let mut volumes = 0;
    for (name, _) in found.volumes.iter().filter(|(_, l)| pick(l)) {
        volumes += usize::from(remove_leftover_volume(docker, name).await);
    }
    Ok((containers, volumes))
}
