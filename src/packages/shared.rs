//! The installer's shared volume per base image and index: uv, and the download cache
//! (see the installer's module doc for who may write it).

use std::collections::HashMap;

use crate::docker::Engine;
use bollard::models::VolumeCreateRequest;
use bollard::query_parameters::ListVolumesOptionsBuilder;
use sha2::{Digest, Sha256};

use super::{Error, IndexSettings};

use crate::config::SandboxConfig;
use crate::docker::LABEL_MANAGED;
use crate::docker::container::{self};
use crate::docker::identity::{self, LABEL_UID};

/// Label on the shared installer volumes.
pub const LABEL_INSTALLER_VOLUME: &str = "pyberth.installer-volume";
/// Label holding the id of the image a shared installer volume serves.
const LABEL_BASE_ID: &str = "pyberth.base-id";
/// Label holding the image tag an installer volume serves.
const LABEL_BASE: &str = "pyberth.base";

/// The installer's shared volume: its name and the uid wheels-only installs run as.
pub(super) struct Shared {
    pub(super) name: String,
    pub(super) uid: u32,
}

/// The shared installer volume of `base` and `index`, created when absent if `create`.
/// `None` when neither uv nor the cache is wanted, when it is absent and not to be created,
/// or when the uid it records is not one of ours (a volume of another configuration).
pub(super) async fn shared_volume(
    docker: &dyn Engine,
    cfg: &SandboxConfig,
    base: &str,
    index: &IndexSettings,
    create: bool,
) -> Result<Option<Shared>, Error> {
    if cfg.installer_uv == "none" && cfg.installer_cache_mb == 0 {
        return Ok(None);
    }
    let base_id = docker.inspect_image(base).await?.id.unwrap_or_else(|| base.to_owned());
    let name = format!("pyberth-installer-{}", shared_key(&base_id, index, &cfg.installer_uv));
    let found = match docker.inspect_volume(&name).await {
        Ok(v) => Some(v),
        Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) => None,
        Err(e) => return Err(e.into()),
    };
    let volume = match found {
        Some(v) => v,
        None if !create => return Ok(None),
        None => {
            prune_stale(docker).await;
            // A uid from the range, recorded on the volume: every wheels-only installer of
            // this volume runs as it, so the files one writes the next can use.
            let uid = identity::pick(docker, cfg.uid_range).await?;
            let labels = HashMap::from([
                (LABEL_MANAGED.to_owned(), "1".to_owned()),
                (LABEL_INSTALLER_VOLUME.to_owned(), "1".to_owned()),
                (LABEL_UID.to_owned(), uid.to_string()),
                (LABEL_BASE_ID.to_owned(), base_id.clone()),
                ("pyberth.installer-uv".to_owned(), cfg.installer_uv.clone()),
                // What else the key holds, for those who look for a volume by its labels (the bench).
                ("pyberth.installer-index".to_owned(), index.index_url.clone().unwrap_or_else(|| "default".into())),
                (
                    "pyberth.installer-extra-index".to_owned(),
                    index.extra_index_url.clone().unwrap_or_else(|| "none".into()),
                ),
                (LABEL_BASE.to_owned(), base.to_owned()),
            ]);
            let request = VolumeCreateRequest { name: Some(name.clone()), labels: Some(labels), ..Default::default() };
            let created = docker.create_volume(request).await;
            identity::release(uid);
            // Two servers creating it at once get the same volume: its labels are the first's.
            created?
        }
    };
    let uid = volume.labels.get(LABEL_UID).and_then(|u| u.parse::<u32>().ok());
    match uid {
        Some(uid) if (cfg.uid_range.first..=cfg.uid_range.last).contains(&uid) => Ok(Some(Shared { name, uid })),
        _ => {
            tracing::warn!(volume = %name, "the installer volume's uid is not in --uid-range; installing without it");
            Ok(None)
        }
    }
}

/// The shared volume's key: what fixes the uv wheel it holds (the base image's platform and
/// the index it came from, and the requirement it was fetched by).
pub(super) fn shared_key(base_id: &str, index: &IndexSettings, uv: &str) -> String {
    let mut h = Sha256::new();
    for part in [
        "pyberth-installer-v1",
        base_id,
        index.index_url.as_deref().unwrap_or(""),
        index.extra_index_url.as_deref().unwrap_or(""),
        uv,
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// Removes shared installer volumes whose base image is gone (a rebuilt sandbox image): no
/// install can use them again. The engine refuses to remove one an installer is using.
pub(super) async fn prune_stale(docker: &dyn Engine) {
    let filters = HashMap::from([("label", vec![LABEL_INSTALLER_VOLUME])]);
    let opts = ListVolumesOptionsBuilder::default().filters(&filters).build();
    let Ok(list) = docker.list_volumes(Some(opts)).await else { return };
    for v in list.volumes.unwrap_or_default() {
        let Some(id) = v.labels.get(LABEL_BASE_ID) else { continue };
        if let Err(bollard::errors::Error::DockerResponseServerError { status_code: 404, .. }) =
            docker.inspect_image(id).await
        {
            container::remove_volume(docker, &v.name).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_volume_key_follows_the_base_the_index_and_the_uv_requirement() {
        let idx = IndexSettings::default();
        let k = shared_key("sha256:a", &idx, "uv");
        assert_eq!(k.len(), 16);
        assert_ne!(k, shared_key("sha256:b", &idx, "uv"));
        assert_ne!(k, shared_key("sha256:a", &idx, "uv==0.13.9"));
        let other = IndexSettings { index_url: Some("https://mirror/simple".into()), ..Default::default() };
        assert_ne!(k, shared_key("sha256:a", &other, "uv"));
        let ca = IndexSettings { ca_bundle: Some(b"pem".to_vec()), ..Default::default() };
        assert_eq!(k, shared_key("sha256:a", &ca, "uv"), "the CA bundle changes how, not what");
    }
}
