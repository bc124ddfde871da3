//! Heartbeats and their marks as Leases (`coordination.k8s.io/v1`), so that servers sharing a
//! namespace see each other's liveness (docs/design.md D9 on Kubernetes; issue 33, item 5).
//!
//! - A heartbeat container is a Lease held by its server: made with the record, renewed every
//!   `RENEW` while the server holds its attach, deleted when it lets go. A server that dies
//!   (SIGKILL, its node lost) stops renewing: the Lease is listed as a stopped container
//!   `LEASE` after its last renewal, which is when it stopped. So a live server's sessions are
//!   never taken for a dead one's, and a dead one's are swept once its grace has passed.
//! - A heartbeat mark (a volume labelled `pyberth.beat`: "had one", "stopped") is a Lease too,
//!   never renewed; its creation time (the API server's) is the mark's time.
//!
//! What a Lease says is believed as far as it names itself: its container-name annotation only
//! when the Lease is named after it, as a pod's. Whoever can write Leases in the namespace can
//! keep a dead server looking alive (its sessions then stay) or make a live one look dead for
//! the grace; RBAC on `leases` is that boundary.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bollard::errors::Error as EngineError;
use bollard::models::{
    ContainerConfig, ContainerInspectResponse, ContainerState, ContainerStateStatusEnum, ContainerSummary,
    ContainerSummaryStateEnum, Volume,
};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::translate::{ANNOTATION_NAME, pod_name};
use super::{KubeEngine, from_cluster, said, status};
use crate::audit::time::rfc3339;
use crate::docker::heartbeat::{LABEL_BEAT, LABEL_HEARTBEAT, parse_time};
use crate::k8s::labels;
use crate::packages::store::LABEL_STORE;

/// How long a Lease holds without renewal.
pub(super) const LEASE: Duration = Duration::from_secs(15);
/// How often a held Lease is renewed.
const RENEW: Duration = Duration::from_secs(5);

fn lease_of(name: &str, ours: &HashMap<String, String>, renewing: bool) -> Result<Lease, EngineError> {
    let sorted: BTreeMap<String, String> = ours.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let (l, mut notes) = labels::split(&sorted);
    notes.insert(ANNOTATION_NAME.into(), name.to_owned());
    let now = rfc3339(SystemTime::now());
    let spec = if renewing {
        json!({ "holderIdentity": name, "leaseDurationSeconds": LEASE.as_secs(), "renewTime": now, "acquireTime": now })
    } else {
        json!({})
    };
    let v = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": { "name": pod_name(name), "labels": l, "annotations": notes },
        "spec": spec,
    });
    serde_json::from_value(v).map_err(|e| said(format!("a Lease did not serialize: {e}")))
}

/// The name a Lease stands for (its annotation, when the Lease is named after it).
fn named(l: &Lease) -> String {
    let own = l.metadata.name.clone().unwrap_or_default();
    let kept = l.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_NAME));
    kept.filter(|n| pod_name(n) == own).cloned().unwrap_or(own)
}

/// Our labels of a Lease, as given (hashed values back from their annotations).
fn labels_of(l: &Lease) -> HashMap<String, String> {
    let pod = k8s_openapi::api::core::v1::Pod { metadata: l.metadata.clone(), ..Default::default() };
    let mut out = super::translate::our_labels(&pod);
    // `our_labels` leaves `pyberth.io/` keys out; ours have none.
    out.retain(|k, _| !k.starts_with("pyberth.io/"));
    out
}

/// When a heartbeat's Lease lapses (or lapsed): its last renewal and `LEASE`.
fn lapses(l: &Lease) -> Option<Duration> {
    let v = serde_json::to_value(l.spec.as_ref()?).ok()?;
    let renewed = parse_time(v.get("renewTime")?.as_str()?)?;
    let held = v.get("leaseDurationSeconds").and_then(serde_json::Value::as_u64).map_or(LEASE, Duration::from_secs);
    Some(renewed + held.min(LEASE * 4))
}

fn now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default()
}

fn when(d: Duration) -> String {
    rfc3339(UNIX_EPOCH + d)
}

/// Docker's `label` filters as a selector over Leases, with `kind` (a key that must be there).
fn selector(filters: Option<&HashMap<String, Vec<String>>>, kind: &str) -> String {
    let wanted = filters.and_then(|f| f.get("label")).map(Vec::as_slice).unwrap_or_default();
    let mut terms = vec![kind.to_owned()];
    terms.extend(wanted.iter().map(|w| match w.split_once('=') {
        Some((k, v)) => format!("{k}={}", labels::value(v)),
        None => w.clone(),
    }));
    terms.join(",")
}

impl KubeEngine {
    fn leases(&self) -> kube::Api<Lease> {
        self.cluster.leases()
    }

    /// Makes the Lease of heartbeat `name`.
    pub(super) async fn beat_create(&self, name: &str, ours: &HashMap<String, String>) -> Result<(), EngineError> {
        let l = lease_of(name, ours, true)?;
        self.leases()
            .create(&PostParams::default(), &l)
            .await
            .map_err(|e| from_cluster(self.cluster.error("create leases")(e)))?;
        Ok(())
    }

    /// Renews heartbeat `name`'s Lease until `gone`, then deletes it. The task ends with the
    /// token (its last act, the delete, is bounded).
    pub(super) fn beat_renew(&self, name: &str, gone: CancellationToken) {
        let (leases, lease) = (self.leases(), pod_name(name));
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = gone.cancelled() => break,
                    () = tokio::time::sleep(RENEW) => {}
                }
                let patch = Patch::Merge(json!({ "spec": { "renewTime": rfc3339(SystemTime::now()) } }));
                if let Err(e) = leases.patch(&lease, &PatchParams::default(), &patch).await {
                    tracing::warn!(lease = %lease, error = %e, "cannot renew the heartbeat's Lease");
                }
            }
            let dp = DeleteParams::default();
            let deleted = tokio::time::timeout(Duration::from_secs(5), leases.delete(&lease, &dp));
            if let Ok(Err(e)) = deleted.await {
                tracing::debug!(lease = %lease, error = %e, "the heartbeat's Lease was not deleted");
            }
        });
    }

    async fn list_leases(&self, selector: &str) -> Result<Vec<Lease>, EngineError> {
        let lp = ListParams::default().labels(selector);
        let list = self.leases().list(&lp).await.map_err(|e| from_cluster(self.cluster.error("list leases")(e)))?;
        Ok(list.items)
    }

    /// Heartbeats of other servers (Leases not among `mine`), as containers.
    pub(super) async fn beat_list(
        &self,
        filters: Option<&HashMap<String, Vec<String>>>,
        mine: &[String],
    ) -> Result<Vec<ContainerSummary>, EngineError> {
        let leases = self.list_leases(&selector(filters, LABEL_HEARTBEAT)).await?;
        let now = now();
        let beats = leases.iter().filter(|l| !labels_of(l).contains_key(LABEL_BEAT));
        let found = beats.filter(|l| !mine.contains(&named(l))).map(|l| {
            let running = lapses(l).is_some_and(|t| t > now);
            let name = named(l);
            ContainerSummary {
                id: Some(name.clone()),
                names: Some(vec![format!("/{name}")]),
                labels: Some(labels_of(l)),
                state: Some(if running {
                    ContainerSummaryStateEnum::RUNNING
                } else {
                    ContainerSummaryStateEnum::EXITED
                }),
                ..Default::default()
            }
        });
        Ok(found.collect())
    }

    /// Heartbeat `name` of another server, if its Lease is there: running until it lapses,
    /// then stopped at that time.
    pub(super) async fn beat_inspect(&self, name: &str) -> Result<Option<ContainerInspectResponse>, EngineError> {
        let got = self.leases().get_opt(&pod_name(name)).await;
        let Some(l) = got.map_err(|e| from_cluster(self.cluster.error("get leases")(e)))? else { return Ok(None) };
        let ours = labels_of(&l);
        if !ours.contains_key(LABEL_HEARTBEAT) || ours.contains_key(LABEL_BEAT) || named(&l) != name {
            return Ok(None);
        }
        let until = lapses(&l).unwrap_or_default();
        let running = until > now();
        let state = ContainerState {
            running: Some(running),
            status: Some(if running { ContainerStateStatusEnum::RUNNING } else { ContainerStateStatusEnum::EXITED }),
            finished_at: (!running).then(|| when(until)),
            ..Default::default()
        };
        Ok(Some(ContainerInspectResponse {
            id: Some(name.to_owned()),
            name: Some(format!("/{name}")),
            state: Some(state),
            config: Some(ContainerConfig { labels: Some(ours), ..Default::default() }),
            ..Default::default()
        }))
    }

    /// Deletes the Lease named for `name` (a heartbeat or a mark); false when none was there.
    pub(super) async fn lease_remove(&self, name: &str, kind: &str) -> Result<bool, EngineError> {
        let lease = pod_name(name);
        let got = self.leases().get_opt(&lease).await.map_err(|e| from_cluster(self.cluster.error("get leases")(e)))?;
        match got {
            Some(l) if named(&l) == name && labels_of(&l).contains_key(kind) => {}
            _ => return Ok(false),
        }
        match self.leases().delete(&lease, &DeleteParams::default()).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
            Err(e) => Err(from_cluster(self.cluster.error("delete leases")(e))),
        }
    }

    /// Makes mark `name` (or finds it: a mark is made once), as a volume.
    pub(super) async fn mark_create(&self, name: &str, ours: &HashMap<String, String>) -> Result<Volume, EngineError> {
        let l = lease_of(name, ours, false)?;
        match self.leases().create(&PostParams::default(), &l).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(from_cluster(self.cluster.error("create leases")(e))),
        }
        let got = self.mark_get(name).await?;
        got.ok_or_else(|| status(404, format!("No such volume: {name}")))
    }

    /// Mark `name`, if its Lease is there.
    pub(super) async fn mark_get(&self, name: &str) -> Result<Option<Volume>, EngineError> {
        let got = self.leases().get_opt(&pod_name(name)).await;
        let got = got.map_err(|e| from_cluster(self.cluster.error("get leases")(e)))?;
        let mark = |v: &Volume| v.labels.contains_key(LABEL_BEAT) || v.labels.contains_key(LABEL_STORE);
        Ok(got.filter(|l| named(l) == name).map(|l| mark_volume(&l)).filter(mark))
    }

    /// The marks that match `filters`, as volumes.
    pub(super) async fn mark_list(
        &self,
        filters: Option<&HashMap<String, Vec<String>>>,
    ) -> Result<Vec<Volume>, EngineError> {
        let leases = self.list_leases(&selector(filters, LABEL_BEAT)).await?;
        Ok(leases.iter().map(mark_volume).collect())
    }
}

fn mark_volume(l: &Lease) -> Volume {
    let created = serde_json::to_value(&l.metadata.creation_timestamp).ok().and_then(|v| v.as_str().map(str::to_owned));
    Volume {
        name: named(l),
        driver: "kubernetes-lease".into(),
        labels: labels_of(l),
        options: HashMap::new(),
        created_at: created,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_lapses_after_its_last_renewal() {
        let ours =
            HashMap::from([(LABEL_HEARTBEAT.to_owned(), "i1".to_owned()), ("pyberth.host".to_owned(), "h".to_owned())]);
        let mut l = lease_of("pyberth-i1-heartbeat-x", &ours, true).expect("lease");
        let at = lapses(&l).expect("a time");
        assert!(at > now() + LEASE - Duration::from_secs(2) && at <= now() + LEASE, "{at:?}");
        assert_eq!(named(&l), "pyberth-i1-heartbeat-x");
        assert_eq!(labels_of(&l), ours);
        // An annotation naming another heartbeat is not believed.
        l.metadata.annotations.get_or_insert_default().insert(ANNOTATION_NAME.into(), "pyberth-i2-heartbeat-y".into());
        assert_eq!(named(&l), l.metadata.name.clone().unwrap_or_default());
        // A mark is never renewed: it has no lapse.
        assert_eq!(lapses(&lease_of("m", &ours, false).expect("mark")), None);
    }

    #[test]
    fn lease_selectors_carry_the_kind_and_hash_values() {
        let f =
            HashMap::from([("label".to_owned(), vec!["pyberth.host=a b".to_owned(), "pyberth.managed".to_owned()])]);
        let s = selector(Some(&f), LABEL_BEAT);
        assert!(s.starts_with("pyberth.beat,pyberth.host=h-") && s.ends_with(",pyberth.managed"), "{s}");
    }
}
