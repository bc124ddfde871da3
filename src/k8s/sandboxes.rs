//! agent-sandbox mode on the wire: the template and warm pool made at start, a claim per
//! session, its pod resolved and checked (`claims`), the claim deleted at close.
//!
//! The claim's Ready condition can come before its pod runs (a cold Sandbox, or a warm one
//! still starting): resolving waits for both, and for the pod to carry our labels.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::Value;

use super::claims::{self, Bound, EXTENSIONS_API, Refused, SANDBOX_API};
use super::cluster::{Cluster, Error};
use super::labels;

/// How often a claim, its Sandbox and its pod are read again while waiting.
const POLL: Duration = Duration::from_millis(100);

/// The agent-sandbox objects of our namespace.
#[derive(Clone)]
pub struct Sandboxes {
    cluster: Cluster,
    templates: Api<DynamicObject>,
    pools: Api<DynamicObject>,
    claims: Api<DynamicObject>,
    sandboxes: Api<DynamicObject>,
}

impl std::fmt::Debug for Sandboxes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandboxes").field("cluster", &self.cluster).finish_non_exhaustive()
    }
}

fn object(v: Value) -> Result<DynamicObject, Error> {
    serde_json::from_value(v).map_err(|e| Error::Transfer(format!("an agent-sandbox object did not serialize: {e}")))
}

impl Sandboxes {
    /// The agent-sandbox APIs beside `cluster`'s pods.
    pub fn new(cluster: &Cluster) -> Self {
        Self {
            cluster: cluster.clone(),
            templates: cluster.custom(EXTENSIONS_API, "SandboxTemplate", "sandboxtemplates"),
            pools: cluster.custom(EXTENSIONS_API, "SandboxWarmPool", "sandboxwarmpools"),
            claims: cluster.custom(EXTENSIONS_API, "SandboxClaim", "sandboxclaims"),
            sandboxes: cluster.custom(SANDBOX_API, "Sandbox", "sandboxes"),
        }
    }

    /// Creates `v` through `api`, or when it exists brings its spec to `v`'s (a merge patch).
    async fn create_or_patch(&self, api: &Api<DynamicObject>, what: &str, v: Value) -> Result<(), Error> {
        let name = v.pointer("/metadata/name").and_then(Value::as_str).unwrap_or_default().to_owned();
        match api.create(&PostParams::default(), &object(v.clone())?).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let patch = Patch::Merge(serde_json::json!({ "spec": v["spec"] }));
                api.patch(&name, &PatchParams::default(), &patch)
                    .await
                    .map_err(self.cluster.error(format!("patch {what}")))?;
                Ok(())
            }
            Err(e) => Err(self.cluster.error(format!("create {what}"))(e)),
        }
    }

    /// Makes (or updates) environment `name`'s template from `pod` and its warm pool of `size`.
    pub async fn ensure_pool(&self, name: &str, pod: &Pod, size: u32) -> Result<(), Error> {
        self.create_or_patch(&self.templates, "sandboxtemplates", claims::template(name, pod)).await?;
        self.create_or_patch(&self.pools, "sandboxwarmpools", claims::warm_pool(name, name, size)).await
    }

    /// Claims a sandbox of `pool` for the session labelled `ours`, until `shutdown`.
    pub async fn claim(
        &self,
        name: &str,
        pool: &str,
        ours: &BTreeMap<String, String>,
        shutdown: &str,
    ) -> Result<(), Error> {
        self.create_claim(claims::claim(name, pool, ours, shutdown)).await
    }

    /// Creates claim `c` as it is.
    pub async fn create_claim(&self, c: Value) -> Result<(), Error> {
        let c = object(c)?;
        self.claims.create(&PostParams::default(), &c).await.map_err(self.cluster.error("create sandboxclaims"))?;
        Ok(())
    }

    /// Merge-patches claim `name` with `patch`.
    pub async fn patch_claim(&self, name: &str, patch: Value) -> Result<(), Error> {
        let patch = Patch::Merge(patch);
        self.claims
            .patch(name, &PatchParams::default(), &patch)
            .await
            .map_err(self.cluster.error("patch sandboxclaims"))?;
        Ok(())
    }

    /// Claim `name`, if it is there.
    pub async fn get_claim(&self, name: &str) -> Result<Option<DynamicObject>, Error> {
        self.claims.get_opt(name).await.map_err(self.cluster.error("get sandboxclaims"))
    }

    /// The claims whose labels match `selector`.
    pub async fn list_claims(&self, selector: &str) -> Result<Vec<DynamicObject>, Error> {
        let lp = ListParams::default().labels(selector);
        Ok(self.claims.list(&lp).await.map_err(self.cluster.error("list sandboxclaims"))?.items)
    }

    /// The running pod of claim `name`, once it is Ready and its pod carries `ours`; a pod
    /// that is not this session's is refused at once, never exec'd into.
    pub async fn resolve(&self, name: &str, ours: &BTreeMap<String, String>, limit: Duration) -> Result<String, Error> {
        let want: BTreeMap<String, String> = ours.iter().map(|(k, v)| (k.clone(), labels::value(v))).collect();
        self.resolve_with(name, Some(&want), limit).await
    }

    /// As [`Self::resolve`], the labels checked being the claim's own (what we asked for when
    /// we made it: found again after a restart without a record).
    pub async fn resolve_own(&self, name: &str, limit: Duration) -> Result<Pod, Error> {
        let pod = self.resolve_with(name, None, limit).await?;
        self.cluster.get_pod(&pod).await?.ok_or_else(|| Error::Gone(pod))
    }

    async fn resolve_with(
        &self,
        name: &str,
        want: Option<&BTreeMap<String, String>>,
        limit: Duration,
    ) -> Result<String, Error> {
        let until = Instant::now() + limit;
        let last = loop {
            match self.look(name, want).await? {
                Ok(pod) => return Ok(pod.metadata.name.unwrap_or_default()),
                Err(why) if Instant::now() >= until => break why,
                Err(_) => tokio::time::sleep(POLL).await,
            }
        };
        Err(Error::Claim { claim: name.into(), reason: format!("not served after {} s ({last})", limit.as_secs()) })
    }

    /// One look at claim `name`: its running pod, or why not yet; an error when it will never
    /// be served. `want`: the labels the pod must carry (`None`: the claim's own).
    pub async fn look(
        &self,
        name: &str,
        want: Option<&BTreeMap<String, String>>,
    ) -> Result<Result<Pod, String>, Error> {
        let claim = self.get_claim(name).await?;
        let claim = claim.ok_or_else(|| Error::Claim { claim: name.into(), reason: "it was deleted".into() })?;
        let own = claim.metadata.labels.clone().unwrap_or_default();
        let want = want.unwrap_or(&own);
        let sandbox = match claims::bound(&serde_json::to_value(&claim).unwrap_or_default()) {
            Bound::Waiting => return Ok(Err("the claim is not Ready".into())),
            Bound::Failed(reason) => return Err(Error::Claim { claim: name.into(), reason }),
            Bound::Sandbox(s) => s,
        };
        let sb = self.sandboxes.get_opt(&sandbox).await.map_err(self.cluster.error("get sandboxes"))?;
        let Some(pod) = sb.and_then(|s| claims::sandbox_pod(&serde_json::to_value(&s).unwrap_or_default())) else {
            return Ok(Err(format!("sandbox {sandbox} is not there yet")));
        };
        let Some(p) = self.cluster.get_pod(&pod).await? else {
            return Ok(Err(format!("pod {pod} is not there yet")));
        };
        match claims::check_labels(&p, want) {
            Ok(()) => match p.spec.as_ref().map(super::pod::hardened) {
                Some(Ok(())) => Ok(Ok(p)),
                // Its template was loosened after we made it (or another pod is named): refused.
                Some(Err(why)) => {
                    Err(Error::Claim { claim: name.into(), reason: format!("pod {pod} is not hardened: {why}") })
                }
                None => Err(Error::Claim { claim: name.into(), reason: format!("pod {pod} has no spec") }),
            },
            Err(why @ (Refused::NotRunning(_) | Refused::Unlabelled { .. })) => Ok(Err(why.to_string())),
            Err(why @ Refused::NotOurs { .. }) => Err(Error::Claim { claim: name.into(), reason: why.to_string() }),
        }
    }

    /// Deletes claim `name` (agent-sandbox then deletes its Sandbox and pod); gone is fine.
    pub async fn release(&self, name: &str) -> Result<(), Error> {
        match self.claims.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(self.cluster.error("delete sandboxclaims")(e)),
        }
    }
}
