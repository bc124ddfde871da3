//! A new session's container: its image and layer, then a pooled container, a new one, or a
//! new one on a network of its own when it has egress; counted in the metrics by source.

use super::*;
use crate::metrics::Source;

/// Most containers made at once for new sessions the pool did not serve. A burst past the
/// pool on a small machine then serves its first sessions first, instead of all of them
/// together and late (100 at once on 2 cores: each took 20 s, and some agents missed the
/// hello's wait); the pool keeper makes its own beside them ([`pool::AT_ONCE`]).
pub(crate) const COLD_AT_ONCE: usize = 4;
/// Of those, most one principal's sessions hold: one caller's burst always leaves a turn to
/// the others.
pub(crate) const COLD_PER_PRINCIPAL: usize = 3;

/// A turn to make a new session's own container: one of its principal's, then one of the
/// server's.
type Turn<'a> = (tokio::sync::OwnedSemaphorePermit, tokio::sync::SemaphorePermit<'a>);

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
        // Packages or not: a set is a directory put on the path, so the pool serves all, of
        // each environment. Never with egress: a pooled container has no network to put the
        // proxy on (and one popped here would be left running).
        let pooled = (!with_egress).then_some(env.name.as_str());
        let mut taken = match pooled {
            Some(env) => self.pool_pop_or_wait(env).await,
            None => None,
        };
        // The pool did not serve it: its own container, in its turn, unless a pooled one comes
        // meanwhile. Not egress sessions: never pooled, they make their network and bind it
        // in the proxy with their container, and queue for none of it here (as before).
        let mut turn = None;
        if taken.is_none() && !with_egress {
            match self.turn_or_pooled(&principal, pooled).await? {
                Ok(t) => turn = Some(t),
                Err(p) => taken = Some(p),
            }
        }
        if pooled.is_some() {
            self.metrics.pool_take(taken.is_some());
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
            if let Some(network) = session.egress_network() {
                self.egress.detach_network(&principal, &name, network).await;
            }
            return Err(Error::from(e));
        }
        self.metrics.session_created(source, &principal, asked.elapsed());
        if !with_egress {
            // A hibernated session wakes into a pooled container of its environment (one with
            // egress needs its network: it wakes into a container of its own).
            let _ = session.pool.set(self.pool_take(&env.name));
        }
        Ok(session)
    }

    /// A turn to make a new session's own container ([`COLD_PER_PRINCIPAL`], then
    /// [`COLD_AT_ONCE`]), or a pooled container that came while it waited (`pooled`: the
    /// environment whose pool may serve it). [`Error::Stopping`] once the server stops.
    async fn turn_or_pooled(
        &self,
        principal: &str,
        pooled: Option<&str>,
    ) -> Result<Result<Turn<'_>, crate::session::Prepared>, Error> {
        let share = shared(&mut self.colds.lock().unwrap_or_else(|e| e.into_inner()), principal.to_owned(), || {
            tokio::sync::Semaphore::new(COLD_PER_PRINCIPAL)
        });
        let turn = async {
            let mine = share.acquire_owned().await.map_err(|_| Error::Stopping)?;
            let all = self.cold.acquire().await.map_err(|_| Error::Stopping)?;
            Ok::<_, Error>((mine, all))
        };
        tokio::pin!(turn);
        loop {
            let came = self.pool_ready.notified();
            tokio::pin!(came);
            came.as_mut().enable();
            if let Some(p) = pooled.and_then(|env| self.pool_pop_quiet(env)) {
                return Ok(Err(p));
            }
            tokio::select! {
                t = &mut turn => {
                    let t = t?;
                    return Ok(match pooled.and_then(|env| self.pool_pop_quiet(env)) {
                        Some(p) => Err(p),
                        None => Ok(t),
                    });
                }
                () = came => {}
            }
        }
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
        let network = attachment.network.clone();
        let blueprint = self.blueprint(env, Some(Arc::new(attachment)));
        let owner = self.instance.owner.clone();
        // Never from the pool: a pooled container has no network to put the proxy on.
        match Session::start(self.docker.clone(), blueprint, image, owner, naming, Vec::new()).await {
            Ok(s) => Ok(s),
            Err(e) => {
                self.egress.detach_network(&principal, &name, &network).await;
                Err(e.into())
            }
        }
    }
}
