//! A new session's container: its image and layer, then a pooled container, a new one, or a
//! new one on a network of its own when it has egress; counted in the metrics by source.

use super::*;
use crate::metrics::Source;

/// Most containers made at once for new sessions the pool did not serve. A burst past the
/// pool on a small machine then serves its first sessions first, instead of all of them
/// together and late (100 at once on 2 cores: each took 20 s, and some agents missed the
/// hello's wait); the pool keeper makes its own beside them ([`pool::AT_ONCE`]).
pub(crate) const COLD_AT_ONCE: usize = 4;

impl Registry {
    /// Makes a new session: its image, its layer, a pooled container or a new one (on its own
    /// network when it has egress), the layer attached.
    pub(super) async fn make(
        &self,
        env: &Environment,
        naming: crate::session::Naming,
        packages: &[String],
        egress: Vec<crate::egress::policy::Rule>,
        progress: Progress<'_>,
    ) -> Result<Arc<Session>, Error> {
        let (principal, name) = (naming.principal.clone(), naming.name.clone());
        let asked = Instant::now();
        let mut all: Vec<String> = env.packages.iter().chain(packages).cloned().collect();
        all.sort();
        all.dedup();
        let image = self.image(env, progress).await?;
        let layer = if all.is_empty() { None } else { Some(self.layer(env, &all, progress).await?) };
        let with_egress = !egress.is_empty();
        // Packages or not: a set is a directory put on the path, so the pool serves all.
        // Never with egress: a pooled container has no network to put the proxy on (and one
        // popped here would be left running).
        let taken = if env.name == self.environments.default_name() && !with_egress {
            let taken = self.pool_pop_or_wait().await;
            self.metrics.pool_take(taken.is_some());
            taken
        } else {
            None
        };
        // The pool did not serve it: its own container, in its turn (a pooled one may have
        // come while it waited).
        let (mut taken, mut turn) = (taken, None);
        if taken.is_none() && !with_egress {
            turn = Some(self.cold.acquire().await);
            if env.name == self.environments.default_name() {
                taken = self.pool_pop_quiet();
            }
        }
        let source = if taken.is_some() { Source::Pool } else { Source::Cold };
        let (docker, owner) = (self.docker.clone(), self.instance.owner.clone());
        let session = match taken {
            _ if with_egress => self.start_with_egress(env, image, naming, egress).await,
            Some(prepared) => {
                Ok(Session::adopt(docker, self.blueprint(env, None), image, owner, naming, Vec::new(), prepared))
            }
            None => Session::start(docker, self.blueprint(env, None), image, owner, naming, Vec::new())
                .await
                .map_err(Error::from),
        }?;
        drop(turn);
        if let Some(layer) = layer
            && let Err(e) = session.add_layer(&layer, &all).await
        {
            session.close().await;
            if with_egress {
                self.egress.detach(&principal, &name).await;
            }
            return Err(Error::from(e));
        }
        self.metrics.session_created(source, &principal, asked.elapsed());
        if !with_egress {
            // A hibernated session wakes into a pooled container of its image (one with egress
            // needs its network: it wakes into a container of its own).
            let _ = session.pool.set(self.pool_take());
        }
        Ok(session)
    }

    /// A new session on a network of its own whose only other member is the egress proxy.
    async fn start_with_egress(
        &self,
        env: &Environment,
        image: String,
        naming: crate::session::Naming,
        rules: Vec<crate::egress::policy::Rule>,
    ) -> Result<Arc<Session>, Error> {
        let (principal, name) = (naming.principal.clone(), naming.name.clone());
        let headers = env.egress_headers.0.clone();
        let attachment = self.egress.attach(&principal, &name, &image, rules, headers).await.map_err(Error::Egress)?;
        let blueprint = self.blueprint(env, Some(Arc::new(attachment)));
        let owner = self.instance.owner.clone();
        // Never from the pool: a pooled container has no network to put the proxy on.
        let _turn = self.cold.acquire().await;
        match Session::start(self.docker.clone(), blueprint, image, owner, naming, Vec::new()).await {
            Ok(s) => Ok(s),
            Err(e) => {
                self.egress.detach(&principal, &name).await;
                Err(e.into())
            }
        }
    }
}
