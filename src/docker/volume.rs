//! Volumes of ours: made new, never taken over by name; removed.

use bollard::models::VolumeCreateRequest;
use bollard::query_parameters::RemoveVolumeOptionsBuilder;

use super::{Engine, Error};

/// Creates the volume `request` names, new. The engine answers a create of a name taken
/// with the volume there (another session's workspace, perhaps another caller's): that one is
/// refused, never mounted and never removed. A failed create leaves nothing.
pub async fn new_volume(docker: &dyn Engine, request: VolumeCreateRequest) -> Result<(), Error> {
    let name = request.name.clone().unwrap_or_default();
    let asked = request.labels.clone().unwrap_or_default();
    match docker.create_volume(request).await {
        // A conflict is a volume of that name there already (another driver): not ours.
        Err(e @ bollard::errors::Error::DockerResponseServerError { status_code: 409, .. }) => Err(e.into()),
        Err(e) => {
            remove_volume(docker, &name).await;
            Err(e.into())
        }
        Ok(v) if v.labels != asked => {
            let message = format!("volume {name} exists already, made for another session: nothing was mounted");
            Err(bollard::errors::Error::DockerResponseServerError { status_code: 409, message }.into())
        }
        Ok(_) => Ok(()),
    }
}

/// Removes a volume; failures are logged.
pub async fn remove_volume(docker: &dyn Engine, name: &str) {
    let opts = RemoveVolumeOptionsBuilder::default().force(true).build();
    match docker.remove_volume(name, Some(opts)).await {
        Ok(()) => {}
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => {}
        Err(e) => tracing::warn!(volume = %name, error = %e, "cannot remove volume"),
    }
}
