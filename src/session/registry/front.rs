//! What the MCP and HTTP fronts ask of the server beyond sessions: a session's egress for a
//! run, the engine's health, an environment as built. The fronts call these, never the egress
//! manager or the engine themselves (docs/architecture.md).

use std::sync::Arc;
use std::time::Duration;

use super::Registry;
use crate::docker::image;
use crate::egress::Totals;
use crate::environment::Environment;
use crate::session::Session;

/// Counts the egress of one run of a session, from its start.
pub struct EgressMeter {
    registry: Arc<Registry>,
    principal: String,
    session: String,
    /// The session's totals when the run began (`None`: not begun, or no egress).
    before: std::sync::Mutex<Option<Totals>>,
}

impl std::fmt::Debug for EgressMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressMeter").field("principal", &self.principal).field("session", &self.session).finish()
    }
}

impl EgressMeter {
    /// What the run calls once it holds its session ([`crate::session::OnStart`]): its byte
    /// budget and its totals begin there.
    pub fn on_start(self: &Arc<Self>) -> crate::session::OnStart {
        let me = self.clone();
        crate::session::OnStart(Arc::new(move || {
            let me = me.clone();
            Box::pin(async move {
                let before = me.registry.egress.begin_run(&me.principal, &me.session).await;
                *me.before.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = before;
            })
        }))
    }

    /// What the session reached since its run began; `None` when it has no egress, or the run
    /// never began.
    pub async fn used(&self) -> Option<Totals> {
        let before = self.before.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()?;
        let now = self.registry.egress.totals(&self.principal, &self.session).await?;
        Some(now.since(&before))
    }
}

/// Whether the engine answers and the default environment's image exists.
#[derive(Debug)]
pub struct Health {
    /// The engine answered a ping within 5 s.
    pub engine: bool,
    /// The default environment's image is on the engine.
    pub image: bool,
    /// That image's tag.
    pub image_tag: String,
}

impl Registry {
    /// Why a session's egress could not be taken over from an earlier server, if it could not:
    /// said in every run of that session.
    pub fn egress_notice(&self, principal: &str, session: &str) -> Option<String> {
        self.egress.notice(principal, session)
    }

    /// Narrows what `session` may reach (never widens): the list in force after, which its
    /// record keeps for a next server.
    pub async fn narrow(&self, session: &Session, asked: &[String]) -> Result<Vec<String>, String> {
        let now = self.egress.narrow(&session.principal, &session.name, asked).await?;
        session.write_through();
        Ok(now)
    }

    /// The egress rules a session runs under (empty: no network).
    pub fn egress_rules(&self, principal: &str, session: &str) -> Vec<String> {
        self.egress.rules(principal, session).unwrap_or_default()
    }

    /// Starts counting a run's egress; `None` when the session has none.
    pub fn egress_meter(self: &Arc<Self>, principal: &str, session: &str) -> Arc<EgressMeter> {
        Arc::new(EgressMeter {
            registry: self.clone(),
            principal: principal.to_owned(),
            session: session.to_owned(),
            before: std::sync::Mutex::new(None),
        })
    }

    /// What an environment runs, as built on this engine.
    pub async fn environment_as_built(&self, env: &Environment) -> String {
        crate::environment::description_as_built(&self.docker, env).await
    }

    /// The server's metrics, for the fronts that count what they refuse.
    pub fn metrics(&self) -> Arc<crate::metrics::Metrics> {
        self.metrics.clone()
    }

    /// The text a `/metrics` scrape gets: the gauges set from what the registry holds now,
    /// then every series.
    pub fn metrics_text(&self) -> String {
        let mut now = crate::metrics::State::default();
        let sessions: Vec<Arc<Session>> = self.slots().values().filter_map(|slot| slot.get().cloned()).collect();
        for s in sessions {
            let state = if s.is_asleep() { "hibernated" } else { "running" };
            *now.sessions.entry((state, s.environment.clone())).or_default() += 1;
        }
        let gauge = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        now.pool = gauge(self.pool_len());
        now.pool_target = gauge(self.pool_target());
        now.pool_bytes = i64::try_from(self.pool_bytes()).unwrap_or(i64::MAX);
        now.snapshots = gauge(self.snapshots.count());
        now.snapshot_bytes = i64::try_from(self.snapshots.total()).unwrap_or(i64::MAX);
        now.quotas = self.quota_rows();
        self.metrics.set_state(&now);
        self.metrics.encode()
    }

    /// Quota use against quota of each principal the configuration names (issue 32).
    fn quota_rows(&self) -> Vec<crate::metrics::QuotaRow> {
        let mut rows = Vec::new();
        let open = |who: &str| self.slots().values().filter_map(|s| s.get()).filter(|s| *s.principal == *who).count();
        for u in self.quotas.usage().into_iter().filter(|u| self.quotas.is_named(&u.principal)) {
            let (_, kept) = self.snapshots.use_of(&u.principal, "");
            let l = u.limits;
            let f = |n: Option<u64>| n.map(|n| n as f64);
            for (quota, used, limit) in [
                ("cpu_seconds", u.used.cpu_ms as f64 / 1000.0, f(l.cpu_seconds_per_day)),
                ("run_seconds", u.used.run_ms as f64 / 1000.0, f(l.run_seconds_per_day)),
                ("egress_bytes", u.used.egress_bytes as f64, f(l.egress_bytes_per_day)),
                ("snapshot_bytes", kept as f64, f(l.snapshot_bytes)),
                ("sessions", open(&u.principal) as f64, l.sessions.map(|n| n as f64)),
            ] {
                rows.push(crate::metrics::QuotaRow { principal: u.principal.clone(), quota, used, limit });
            }
        }
        rows
    }

    /// The engine's health, for `/healthz`.
    pub async fn health(&self) -> Health {
        let engine = tokio::time::timeout(Duration::from_secs(5), self.docker.ping()).await.is_ok_and(|r| r.is_ok());
        let image_tag = match self.environments.get(None) {
            Ok(env) => env.cfg.image.clone().unwrap_or_else(|| image::tag_for(&env.cfg)),
            Err(_) => self.cfg.image.clone().unwrap_or_else(image::sandbox_tag),
        };
        let image = engine && image::exists(&self.docker, &image_tag).await.unwrap_or(false);
        Health { engine, image, image_tag }
    }
}
