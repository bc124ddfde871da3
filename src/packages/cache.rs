//! The layer store as a cache: its size, the sets by last use, and the prune that keeps it
//! within `--layer-cache-mb`, never removing a set a live session holds.

use super::*;

/// Whether the sets this process knows of may exceed `keep_bytes` (0: keep none), so a prune
/// is worth reading the store for. Unknown: yes.
pub async fn over(docker: &dyn Engine, keep_bytes: u64) -> bool {
    match Store::get(docker).await {
        Ok(store) => known_bytes(&store).is_none_or(|b| keep_bytes == 0 || b > keep_bytes),
        Err(_) => true,
    }
}

/// A set of the store, for listings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayerInfo {
    /// Its directory's name in the store.
    pub dir: String,
    /// Content key (empty when its metadata is unreadable).
    pub key: String,
    /// Requirements it holds.
    pub requirements: Vec<String>,
    /// Bytes of its files.
    pub size: u64,
    /// Creation time, seconds since the epoch.
    pub created: i64,
    /// Last use recorded in the state dir, else its creation.
    pub used: i64,
    /// The image it was installed for.
    pub base: String,
}

/// The store's sets, most recently used first, by the use record in `state_dir`.
pub async fn list_by_use(
    docker: &dyn Engine,
    image: &str,
    owner: &Owner,
    state_dir: &std::path::Path,
) -> Result<Vec<LayerInfo>, Error> {
    let store = Store::open(docker).await?;
    let index = store::index(docker, &store, image, owner).await?;
    set_known(&store, sizes(index.clone()));
    let used = crate::durable::layer_use::read_uses(state_dir);
    let mut out: Vec<LayerInfo> = index
        .into_iter()
        .map(|(dir, meta)| {
            let meta = meta.and_then(|m| serde_json::from_value::<Meta>(m).ok());
            let (key, requirements, size, created, base) = match meta {
                Some(m) => (m.key, m.requirements, m.size, m.created, m.base),
                None => (String::new(), Vec::new(), 0, 0, String::new()),
            };
            let used = used.get(&key).copied().unwrap_or(created);
            LayerInfo { dir, key, requirements, size, created, used, base }
        })
        .collect();
    out.sort_by_key(|l| std::cmp::Reverse(l.used));
    Ok(out)
}

/// The sets in use by any live instance's sessions: the records of instances that still have
/// a container on the engine (an instance without one has no session holding a set; its
/// record is left from a crash and is removed).
async fn in_use(docker: &dyn Engine, state_dir: &std::path::Path) -> Result<HashSet<String>, DockerError> {
    let inventory = crate::docker::container::inventory(docker).await?;
    let alive: HashSet<&str> = inventory
        .containers
        .iter()
        .filter_map(|c| c.labels.get(crate::docker::LABEL_INSTANCE).map(String::as_str))
        .collect();
    Ok(crate::durable::layer_use::in_use_of(state_dir, &alive))
}

/// Removes sets, least recently used first, until their bytes are at most `keep_bytes` (0
/// removes all), never one a session uses (`in_use`) nor one of `protect`. Returns the
/// removed sets.
pub async fn prune(
    docker: &dyn Engine,
    image: &str,
    owner: &Owner,
    state_dir: &std::path::Path,
    keep_bytes: u64,
    protect: &[String],
) -> Result<Vec<LayerInfo>, Error> {
    let layers = list_by_use(docker, image, owner, state_dir).await?;
    let mut held = in_use(docker, state_dir).await?;
    held.extend(protect.iter().cloned());
    let mut total: u64 = layers.iter().map(|l| l.size).sum();
    let mut doomed = Vec::new();
    for l in layers.iter().rev() {
        if keep_bytes > 0 && total <= keep_bytes {
            break;
        }
        if held.contains(&l.key) {
            continue;
        }
        total = total.saturating_sub(l.size);
        doomed.push(l.clone());
    }
    let store = Store::get(docker).await?;
    let dirs: Vec<String> = doomed.iter().map(|l| l.dir.clone()).collect();
    let removed: HashSet<String> = store::remove(docker, &store, image, owner, &dirs).await?.into_iter().collect();
    for dir in &removed {
        mark_known(&store, dir, None);
    }
    Ok(doomed.into_iter().filter(|l| removed.contains(&l.dir)).collect())
}

/// Removes the layer images of pyberth before the store (`pyberth-layer:*`); returns their
/// names. One a container still uses is kept by the engine.
pub async fn prune_old_images(docker: &dyn Engine) -> Result<Vec<String>, DockerError> {
    let label = format!("{LABEL_IMAGE}=layer");
    let filters = HashMap::from([("label", vec![label.as_str()])]);
    let opts = ListImagesOptionsBuilder::default().filters(&filters).build();
    let mut removed = Vec::new();
    for i in docker.list_images(Some(opts)).await? {
        let name = i.repo_tags.iter().find(|t| t.starts_with(LAYER_REPO)).cloned().unwrap_or(i.id);
        match docker.remove_image(&name, Some(RemoveImageOptionsBuilder::default().build()), None).await {
            Ok(_) => removed.push(name),
            Err(e) => tracing::info!(image = %name, error = %e, "old layer image kept"),
        }
    }
    Ok(removed)
}
