//! The registry's dependency layers and images: the layer a session's requirements need,
//! installs into a live session, and each environment's image, found or built once.

use super::*;

impl Registry {
    /// The layer holding `requirements` (canonical, sorted) on an environment's image,
    /// installed if absent.
    pub async fn layer(
        &self,
        env: &Environment,
        requirements: &[String],
        progress: Progress<'_>,
    ) -> Result<Layer, Error> {
        let base = self.image(env, progress).await?;
        let lock = {
            let mut installs = self.installs.lock().unwrap_or_else(|e| e.into_inner());
            shared(&mut installs, requirements.to_vec(), Default::default)
        };
        let _guard = lock.lock().await;
        let asked = std::time::Instant::now();
        let layer = packages::ensure(
            &self.docker,
            &self.blueprint(env, None),
            &self.instance.owner,
            &base,
            requirements,
            &self.index,
            &self.egress,
            progress,
        )
        .await;
        self.metrics.install(layer.as_ref().ok().map(|l| l.cached), asked.elapsed());
        let layer = layer?;
        let state_dir = self.cfg.state_dir();
        // A file read, write and rename: off the runtime's workers.
        let (ledger, key) = (self.ledger.clone(), layer.key.clone());
        if let Err(e) = tokio::task::spawn_blocking(move || ledger.layer_used(&key)).await {
            tracing::debug!(error = %e, "cannot record layer use");
        }
        if !layer.cached && packages::over(&self.docker, self.cfg.layer_cache_mb << 20).await {
            // Never the set just made, nor one a session of ours holds (the record of this
            // instance may lag a session being created).
            let mut protect = self.layers_in_use();
            protect.push(layer.key.clone());
            let (owner, keep) = (&self.instance.owner, self.cfg.layer_cache_mb << 20);
            match packages::prune(&self.docker, &base, owner, &state_dir, keep, &protect).await {
                Ok(removed) if !removed.is_empty() => {
                    let removed: Vec<&str> = removed.iter().map(|l| l.key.as_str()).collect();
                    tracing::info!(removed = %removed.join(" "), "layer cache over its size; pruned");
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot prune layers"),
            }
        }
        Ok(layer)
    }

    /// Keys of the layers this server's sessions hold.
    pub(super) fn layers_in_use(&self) -> Vec<String> {
        let sessions: Vec<Arc<Session>> = self.slots().values().filter_map(|slot| slot.get().cloned()).collect();
        let mut keys: Vec<String> = sessions.iter().flat_map(|s| s.layer_keys()).collect();
        keys.sort();
        keys.dedup();
        keys
    }

    /// Writes this instance's record of the layers its sessions hold, which every prune on
    /// this host reads (docs/design.md D6): a small file, written in place of the last.
    pub(super) fn record_layers(&self) {
        self.ledger.layers_in_use(&self.instance.owner.instance, &self.layers_in_use());
    }

    /// Adds requirements to a running session (a no-op for those it has).
    #[tracing::instrument(target = "pyberth::otel", name = "step", skip_all, fields(otel.name = "install", otel.kind = "internal"))]
    pub async fn install(
        &self,
        session: &Session,
        requirements: &[String],
        progress: Progress<'_>,
    ) -> Result<Installed, Error> {
        let added = session.missing(requirements);
        let present: Vec<String> = requirements.iter().filter(|r| !added.contains(r)).cloned().collect();
        if added.is_empty() {
            return Ok(Installed { added, present, layer: None, skipped: Vec::new() });
        }
        let env = self.environments.get(Some(&session.environment)).map_err(Error::Environment)?;
        let layer = self.layer(&env, &added, progress).await?;
        let attached = session.add_layer(&layer, &added).await;
        self.record_layers();
        attached?;
        Ok(Installed { added, present, layer: Some(layer), skipped: Vec::new() })
    }

    /// Splits `packages` into those to install and those whose environment marker is false
    /// where the session `name` runs (or will run): pip ignores those, so installing them
    /// would install nothing while saying it did. Markers are evaluated by the environment's
    /// own interpreter, once per image and marker. When they cannot be evaluated, nothing is
    /// skipped (pip still decides, as before).
    pub(super) async fn without_false_markers(
        &self,
        principal: &str,
        name: &str,
        environment: Option<&str>,
        packages: &[String],
        progress: Progress<'_>,
    ) -> (Vec<String>, Vec<String>) {
        let unchanged = || (packages.to_vec(), Vec::new());
        if !packages.iter().any(|p| crate::deps::marker_of(p).is_some()) {
            return unchanged();
        }
        let env_name = self.find(principal, name).map(|s| s.environment.clone());
        let Ok(env) = self.environments.get(env_name.as_deref().or(environment)) else { return unchanged() };
        let Ok(image) = self.image(&env, progress).await else { return unchanged() };
        let known = |m: &str| {
            let cache = self.markers.lock().unwrap_or_else(|e| e.into_inner());
            cache.get(&(image.clone(), m.to_owned())).copied()
        };
        let mut unknown: Vec<String> = packages
            .iter()
            .filter_map(|p| crate::deps::marker_of(p))
            .filter(|m| known(m).is_none())
            .map(str::to_owned)
            .collect();
        unknown.sort();
        unknown.dedup();
        if !unknown.is_empty() {
            match packages::evaluate_markers(
                &self.docker,
                &self.blueprint(&env, None),
                &self.instance.owner,
                &image,
                &unknown,
            )
            .await
            {
                Ok(verdicts) => {
                    let mut cache = self.markers.lock().unwrap_or_else(|e| e.into_inner());
                    for (m, v) in unknown.into_iter().zip(verdicts) {
                        if let Some(v) = v {
                            cache.insert((image.clone(), m), v);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot evaluate environment markers; pip decides"),
            }
        }
        let (mut keep, mut skipped) = (Vec::new(), Vec::new());
        for p in packages {
            if crate::deps::marker_of(p).is_some_and(|m| known(m) == Some(false)) {
                progress(&format!("{p}: skipped, marker false in this environment"));
                skipped.push(p.clone());
            } else {
                keep.push(p.clone());
            }
        }
        (keep, skipped)
    }

    /// An environment's image, found or built once per server (a build reports progress).
    pub async fn image(&self, env: &Environment, progress: Progress<'_>) -> Result<String, Error> {
        let slot = {
            let mut images = self.images.lock().unwrap_or_else(|e| e.into_inner());
            images.entry(env.name.clone()).or_default().clone()
        };
        if let Some(tag) = slot.tag.get() {
            return Ok(tag.clone());
        }
        // Whoever builds, every caller waiting for the image hears its progress: the first
        // call of a fresh server waits for the build its start-up began.
        let mut lines = slot.lines.subscribe();
        // A caller that comes while the build is under way hears where it got to at once, not
        // only from its next line (a build whose last steps are cached says nothing more).
        if !lines.borrow().is_empty() {
            lines.mark_changed();
        }
        let build = slot.tag.get_or_try_init(|| async {
            let both = |line: &str| {
                let line = crate::output::plain_line(line);
                tracing::info!(target: "pyberth::image", environment = %env.name, "{line}");
                slot.lines.send_replace(line);
            };
            let built = image::ensure(&self.docker, &env.cfg, &both).await;
            if built.is_err() {
                // A next attempt's callers must not hear this one's last line as their own.
                slot.lines.send_replace(String::new());
            }
            built
        });
        tokio::pin!(build);
        loop {
            tokio::select! {
                built = &mut build => {
                    // The watch keeps only the latest line: a caller that polled after a burst
                    // of them still hears where the build got to.
                    if lines.has_changed().unwrap_or(false) {
                        let line = lines.borrow_and_update().clone();
                        if !line.is_empty() {
                            progress(&line);
                        }
                    }
                    return built.cloned().map_err(Error::Image);
                }
                Ok(()) = lines.changed() => {
                    let line = lines.borrow_and_update().clone();
                    if !line.is_empty() {
                        progress(&line);
                    }
                }
            }
        }
    }
}
