//! The Kubernetes engine's answer to each call of the seam (what each maps to: `engine.rs`).

use std::time::SystemTime;

use bollard::models::{ContainerConfig, ContainerState, ContainerStateStatusEnum, ContainerSummaryStateEnum};
use futures::StreamExt;

use super::shelf::{Meta, Shelf};
use super::translate::{self, pod_name};
use super::{ExecRec, KubeEngine, START_LIMIT, Virtual, Vol, from_cluster, said, status, unsupported};
use crate::docker::chunks::{ChunkReader, chunk_writer};
use crate::docker::heartbeat::LABEL_BEAT;
use crate::docker::seam::types::*;
use crate::docker::seam::{Engine, matches_labels, once, ready};
use crate::docker::snapshot::LABEL_SNAPSHOT;
use crate::k8s::cluster;
use crate::packages::store::LABEL_STORE;

/// A volume as Docker describes one: `driver` says where it lives (a record, the shelf).
fn model(
    name: &str,
    driver: &str,
    labels: &HashMap<String, String>,
    options: &HashMap<String, String>,
    created: &str,
) -> Volume {
    Volume {
        name: name.to_owned(),
        driver: driver.into(),
        labels: labels.clone(),
        options: options.clone(),
        created_at: Some(created.to_owned()),
        ..Default::default()
    }
}

fn volume_model(name: &str, v: &Vol) -> Volume {
    model(name, "kubernetes", &v.labels, &v.options, &v.created)
}

fn shelf_model(name: &str, m: &Meta) -> Volume {
    model(name, "kubernetes-shelf", &m.labels, &m.options, &m.created)
}

fn virtual_summary(name: &str, v: &Virtual) -> ContainerSummary {
    ContainerSummary {
        id: Some(name.to_owned()),
        names: Some(vec![format!("/{name}")]),
        image: Some(v.image.clone()),
        labels: Some(v.labels.clone()),
        state: Some(if v.running { ContainerSummaryStateEnum::RUNNING } else { ContainerSummaryStateEnum::CREATED }),
        ..Default::default()
    }
}

fn virtual_inspect(name: &str, v: &Virtual) -> ContainerInspectResponse {
    let status = if v.running { ContainerStateStatusEnum::RUNNING } else { ContainerStateStatusEnum::CREATED };
    ContainerInspectResponse {
        id: Some(name.to_owned()),
        name: Some(format!("/{name}")),
        image: Some(v.image.clone()),
        state: Some(ContainerState { running: Some(v.running), status: Some(status), ..Default::default() }),
        config: Some(ContainerConfig { labels: Some(v.labels.clone()), ..Default::default() }),
        ..Default::default()
    }
}

/// `dir` and the last component of `path`, as `tar -C dir name` wants them.
pub(super) fn split_path(path: &str) -> (String, String) {
    let trimmed = path.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some(("", name)) => ("/".into(), name.into()),
        Some((dir, name)) => (dir.into(), name.into()),
        None => (".".into(), trimmed.into()),
    }
}

/// Unpacks `tar` into `volume` on `shelf` as it arrives: a snapshot is as big as
/// --snapshot-cache-mb lets a session's code make it, and every session may save at once.
async fn onto_shelf(shelf: Shelf, volume: String, tar: Body) -> Result<(), Error> {
    let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Bytes>>(8);
    let unpack = tokio::task::spawn_blocking(move || shelf.unpack(&volume, ChunkReader::new(rx)));
    let mut chunks = tar.into_stream();
    while let Some(chunk) = chunks.next().await {
        let failed = chunk.is_err();
        // A send fails once the unpack ended (done, or refused): its answer says which.
        if tx.send(chunk).await.is_err() || failed {
            break;
        }
    }
    drop(tx);
    let put = unpack.await.map_err(|e| said(e.to_string()))?;
    put.map_err(|e| said(format!("snapshot volume: {e}")))
}

/// Volume `volume` on `shelf` as a tar, packed as it is read (never held whole). The packer
/// ends when it is done, or at its next chunk once the stream is dropped.
fn off_shelf(shelf: Shelf, volume: String) -> Items<'static, Bytes> {
    let (mut writer, rx) = chunk_writer();
    let packer = tokio::task::spawn_blocking(move || {
        if let Err(e) = shelf.pack(&volume, &mut writer) {
            writer.fail(&format!("snapshot volume: {e}"));
        }
    });
    let chunks = futures::stream::unfold((rx, packer), |(mut rx, packer)| async move {
        let chunk = rx.recv().await?;
        Some((chunk.map_err(|e| said(e.to_string())), (rx, packer)))
    });
    chunks.boxed()
}

impl Engine for KubeEngine {
    fn list_containers(&self, options: Option<q::ListContainersOptions>) -> Fut<'_, Vec<ContainerSummary>> {
        Box::pin(async move {
            let (all, filters) = options.map(|o| (o.all, o.filters)).unwrap_or_default();
            let selector = translate::selector(filters.as_ref());
            let mut found: Vec<ContainerSummary> = match &self.claimed {
                Some(c) => {
                    // Claims, and helper pods (plain pods in either mode), so sweeps find them.
                    let mut found = c.list(&selector).await?;
                    found.extend(self.list_helpers(&selector).await?);
                    found
                }
                None => {
                    // Session pods and egress proxy pods (the latter not `sandbox`-labelled).
                    let mut pods = self.cluster.list_pods(&selector).await.map_err(from_cluster)?;
                    let proxies = translate::proxy_selector(filters.as_ref());
                    pods.extend(self.cluster.list_pods(&proxies).await.map_err(from_cluster)?);
                    pods.iter().map(translate::summary).collect()
                }
            };
            let mine: Vec<String> = self.records().virtuals.keys().cloned().collect();
            found.extend(self.beat_list(filters.as_ref(), &mine).await?);
            let r = self.records();
            let virtuals = r.virtuals.iter().filter(|(_, v)| matches_labels(&v.labels, filters.as_ref()));
            found.extend(virtuals.map(|(n, v)| virtual_summary(n, v)));
            found.retain(|c| all || c.state == Some(ContainerSummaryStateEnum::RUNNING));
            Ok(found)
        })
    }
    fn create_container(
        &self,
        options: Option<q::CreateContainerOptions>,
        config: ContainerCreateBody,
    ) -> Fut<'_, ContainerCreateResponse> {
        Box::pin(async move {
            let id = self.create(options.and_then(|o| o.name), config).await?;
            Ok(ContainerCreateResponse { id, warnings: Vec::new() })
        })
    }
    fn start_container<'a>(&'a self, name: &'a str, _: Option<q::StartContainerOptions>) -> Fut<'a, ()> {
        Box::pin(async move {
            if self.is_helper(name) {
                return self.start_helper(name).await;
            }
            if let Some(v) = self.records().virtuals.get_mut(name) {
                v.running = true;
                return Ok(());
            }
            if let Some(c) = &self.claimed {
                return c.start(name).await;
            }
            self.cluster.wait_running(&pod_name(name), START_LIMIT).await.map_err(from_cluster)
        })
    }
    fn remove_container<'a>(&'a self, name: &'a str, _: Option<q::RemoveContainerOptions>) -> Fut<'a, ()> {
        Box::pin(self.remove(name))
    }
    fn inspect_container<'a>(
        &'a self,
        name: &'a str,
        _: Option<q::InspectContainerOptions>,
    ) -> Fut<'a, ContainerInspectResponse> {
        Box::pin(async move {
            if let Some(v) = self.records().virtuals.get(name) {
                return Ok(virtual_inspect(name, v));
            }
            if let Some(beat) = self.beat_inspect(name).await? {
                return Ok(beat);
            }
            if let (Some(c), false) = (&self.claimed, self.is_helper(name)) {
                return c.inspect(name).await;
            }
            match self.cluster.get_pod(&pod_name(name)).await.map_err(from_cluster)? {
                Some(pod) => Ok(self.with_address(name, &pod, translate::inspect(&pod))),
                None => Err(status(404, format!("No such container: {name}"))),
            }
        })
    }
    fn wait_container(&self, name: &str, _: Option<q::WaitContainerOptions>) -> Items<'static, ContainerWaitResponse> {
        if self.is_helper(name) {
            return self.wait_helper(name);
        }
        once(Err(unsupported("waiting for a container that is not a helper")))
    }
    fn attach_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::AttachContainerOptions>,
    ) -> Fut<'a, AttachContainerResults> {
        Box::pin(async move {
            if let Some(cmd) = self.proxy_cmd(name, &options) {
                return self.attach_proxy(name, cmd).await;
            }
            if self.is_helper(name) {
                return self.attach_helper(name);
            }
            // A heartbeat's attach lasts until it is removed; nothing else is attached to.
            let gone = self.records().virtuals.get(name).map(|v| v.gone.clone());
            let Some(gone) = gone else { return Err(unsupported("attaching to a container")) };
            // Let go of, it is gone, as Docker auto-removes a heartbeat whose stdin closed: a
            // stop that leaves sessions waits for that (`instance::leave_stopped`).
            let held = super::Detached { records: self.records.clone(), name: name.to_owned() };
            let output = futures::stream::pending()
                .take_until(gone.cancelled_owned())
                .map(move |x| {
                    let _ = &held;
                    x
                })
                .boxed();
            Ok(AttachContainerResults { output, input: Box::pin(tokio::io::sink()) })
        })
    }
    fn stats(&self, _: &str, _: Option<q::StatsOptions>) -> Items<'static, ContainerStatsResponse> {
        // No CPU figures (the metrics API is not ours to require): the owners read none.
        futures::stream::empty().boxed()
    }
    fn top_processes<'a>(&'a self, _: &'a str, _: Option<q::TopOptions>) -> Fut<'a, ContainerTopResponse> {
        ready(Err(unsupported("listing a pod's processes")))
    }
    fn upload_to_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::UploadToContainerOptions>,
        tar: Body,
    ) -> Fut<'a, ()> {
        Box::pin(async move {
            let helper = self.records().helpers.get(name).cloned();
            if let (Some(volume), Some(shelf)) = (helper, self.shelf.clone()) {
                return onto_shelf(shelf, volume, tar).await;
            }
            // The proxy pod's image carries the executable Docker's proxy gets uploaded.
            if self.records().proxies.contains_key(name) {
                return Ok(());
            }
            let dir = options.map(|o| o.path).unwrap_or_else(|| "/".into());
            match self.cluster.upload_tar(&self.pod_of(name).await?, &dir, tar).await.map_err(from_cluster)? {
                cluster::ExecEnd::Exited(0) => Ok(()),
                end => Err(said(format!("cannot unpack the files into {dir} of {name}: {end:?}"))),
            }
        })
    }
    fn download_from_container(
        &self,
        name: &str,
        options: Option<q::DownloadFromContainerOptions>,
    ) -> Items<'static, Bytes> {
        let (engine, name) = (self.clone(), name.to_owned());
        let helper = self.records().helpers.get(&name).cloned();
        if let (Some(volume), Some(shelf)) = (helper, self.shelf.clone()) {
            return off_shelf(shelf, volume);
        }
        let (dir, base) = split_path(&options.map(|o| o.path).unwrap_or_default());
        futures::stream::once(async move {
            let pod = engine.pod_of(&name).await?;
            let tar = engine.cluster.download_tar(&pod, &dir, &base, super::DOWNLOAD_CAP).await;
            tar.map(Bytes::from).map_err(from_cluster)
        })
        .boxed()
    }
    fn create_exec<'a>(&'a self, container: &'a str, config: ExecConfig) -> Fut<'a, CreateExecResults> {
        let mut r = self.records();
        r.serial += 1;
        let id = format!("k8s-exec-{}", r.serial);
        let exec = ExecRec {
            container: container.to_owned(),
            cmd: config.cmd.unwrap_or_default(),
            stdin: config.attach_stdin.unwrap_or(false),
            end: None,
        };
        r.execs.insert(id.clone(), exec);
        ready(Ok(CreateExecResults { id }))
    }
    fn start_exec<'a>(&'a self, exec_id: &'a str, config: Option<StartExecOptions>) -> Fut<'a, StartExecResults> {
        if config.is_some_and(|c| c.detach) {
            return ready(Err(unsupported("a detached exec")));
        }
        Box::pin(self.start(exec_id))
    }
    fn inspect_exec<'a>(&'a self, exec_id: &'a str) -> Fut<'a, ExecInspectResponse> {
        let r = self.records();
        let found = r.execs.get(exec_id).map(|e| ExecInspectResponse {
            id: Some(exec_id.to_owned()),
            running: Some(e.end.is_none()),
            exit_code: match &e.end {
                Some(cluster::ExecEnd::Exited(c)) => Some(i64::from(*c)),
                _ => None,
            },
            ..Default::default()
        });
        ready(found.ok_or_else(|| status(404, format!("No such exec instance: {exec_id}"))))
    }
    fn create_volume(&self, config: VolumeCreateRequest) -> Fut<'_, Volume> {
        let labels = config.labels.clone().unwrap_or_default();
        if labels.contains_key(LABEL_BEAT) {
            let Some(name) = config.name else { return ready(Err(said("a heartbeat mark needs a name"))) };
            return Box::pin(async move { self.mark_create(&name, &labels).await });
        }
        // The layer store, on the claim: its secret in a Lease (`helpers.rs`).
        if labels.contains_key(LABEL_STORE) && self.settings.layer_claim.is_some() {
            let Some(name) = config.name else { return ready(Err(said("the layer store needs a name"))) };
            return Box::pin(async move { self.create_store(&name, &labels).await });
        }
        if let Some(shelf) = self.shelf.as_ref().filter(|_| labels.contains_key(LABEL_SNAPSHOT)) {
            let Some(name) = config.name else { return ready(Err(said("a snapshot volume needs a name"))) };
            let meta = Meta {
                labels,
                options: config.driver_opts.unwrap_or_default(),
                created: crate::audit::time::rfc3339(SystemTime::now()),
            };
            let made = shelf.create(&name, &meta).map_err(|e| said(format!("cannot make snapshot volume {name}: {e}")));
            return ready(made.map(|m| shelf_model(&name, &m)));
        }
        let mut r = self.records();
        r.serial += 1;
        let name = config.name.unwrap_or_else(|| format!("pyberth-k8s-volume-{}", r.serial));
        let v = r.volumes.entry(name.clone()).or_insert_with(|| Vol {
            labels,
            options: config.driver_opts.unwrap_or_default(),
            created: crate::audit::time::rfc3339(SystemTime::now()),
        });
        ready(Ok(volume_model(&name, v)))
    }
    fn remove_volume<'a>(&'a self, name: &'a str, _: Option<q::RemoveVolumeOptions>) -> Fut<'a, ()> {
        let removed =
            self.records().volumes.remove(name).is_some() || self.shelf.as_ref().is_some_and(|s| s.remove(name));
        Box::pin(async move {
            // Else a heartbeat mark, a Lease (`beats.rs`).
            if removed || self.lease_remove(name, LABEL_BEAT).await? {
                Ok(())
            } else {
                Err(status(404, format!("No such volume: {name}")))
            }
        })
    }
    fn inspect_volume<'a>(&'a self, name: &'a str) -> Fut<'a, Volume> {
        let found = self.records().volumes.get(name).map(|v| volume_model(name, v));
        let found = found.or_else(|| self.shelf.as_ref()?.get(name).map(|m| shelf_model(name, &m)));
        Box::pin(async move {
            let found = match found {
                Some(v) => Some(v),
                None => self.mark_get(name).await?,
            };
            found.ok_or_else(|| status(404, format!("No such volume: {name}")))
        })
    }
    fn list_volumes(&self, options: Option<q::ListVolumesOptions>) -> Fut<'_, VolumeListResponse> {
        let filters = options.and_then(|o| o.filters);
        let r = self.records();
        let mut volumes: Vec<Volume> = r
            .volumes
            .iter()
            .filter(|(_, v)| matches_labels(&v.labels, filters.as_ref()))
            .map(|(n, v)| volume_model(n, v))
            .collect();
        drop(r);
        let shelved = self.shelf.as_ref().map(|s| s.list()).unwrap_or_default();
        let shelved = shelved.iter().filter(|(_, m)| matches_labels(&m.labels, filters.as_ref()));
        volumes.extend(shelved.map(|(n, m)| shelf_model(n, m)));
        Box::pin(async move {
            volumes.extend(self.mark_list(filters.as_ref()).await?);
            Ok(VolumeListResponse { volumes: Some(volumes), warnings: None })
        })
    }
    fn create_network(&self, req: NetworkCreateRequest) -> Fut<'_, NetworkCreateResponse> {
        ready(self.network_create(req))
    }
    fn remove_network<'a>(&'a self, name: &'a str) -> Fut<'a, ()> {
        Box::pin(async move {
            self.network_known(name, true)?;
            self.proxy_service_done().await;
            Ok(())
        })
    }
    fn list_networks(&self, options: Option<q::ListNetworksOptions>) -> Fut<'_, Vec<Network>> {
        let filters = options.and_then(|o| o.filters);
        ready(Ok(self.network_list(filters.as_ref())))
    }
    /// Every pod reaches the proxy pod already (as the NetworkPolicy allows): joining is a check.
    fn connect_network<'a>(&'a self, name: &'a str, _: NetworkConnectRequest) -> Fut<'a, ()> {
        ready(self.network_known(name, false))
    }
    fn disconnect_network<'a>(&'a self, name: &'a str, _: NetworkDisconnectRequest) -> Fut<'a, ()> {
        ready(self.network_known(name, false))
    }
    /// Every image is there: the nodes have it (the operator's job, docs/kubernetes.md); a
    /// missing one fails the pod, and its start says so.
    fn inspect_image<'a>(&'a self, name: &'a str) -> Fut<'a, ImageInspect> {
        let found =
            ImageInspect { id: Some(name.to_owned()), repo_tags: Some(vec![name.to_owned()]), ..Default::default() };
        ready(Ok(found))
    }
    fn list_images(&self, _: Option<q::ListImagesOptions>) -> Fut<'_, Vec<ImageSummary>> {
        ready(Ok(Vec::new()))
    }
    fn remove_image<'a>(
        &'a self,
        _: &'a str,
        _: Option<q::RemoveImageOptions>,
        _: Option<DockerCredentials>,
    ) -> Fut<'a, Vec<ImageDeleteResponseItem>> {
        ready(Err(unsupported("removing an image")))
    }
    fn image_history<'a>(&'a self, _: &'a str) -> Fut<'a, Vec<ImageHistoryResponseItem>> {
        ready(Err(unsupported("reading an image's history")))
    }
    fn build_image(
        &self,
        _: q::BuildImageOptions,
        _: Option<HashMap<String, DockerCredentials>>,
        _: Option<Body>,
    ) -> Items<'_, bollard::models::BuildInfo> {
        once(Err(unsupported("building an image (build it with Docker and put it on the nodes)")))
    }
    fn create_image(
        &self,
        _: Option<q::CreateImageOptions>,
        _: Option<Body>,
        _: Option<DockerCredentials>,
    ) -> Items<'static, CreateImageInfo> {
        once(Err(unsupported("pulling or importing an image")))
    }
    fn events(&self, options: Option<q::EventsOptions>) -> Items<'static, EventMessage> {
        self.oom_events(options)
    }
    fn info(&self) -> Fut<'_, SystemInfo> {
        let info =
            SystemInfo { system_time: Some(crate::audit::time::rfc3339(SystemTime::now())), ..Default::default() };
        ready(Ok(info))
    }
    fn version(&self) -> Fut<'_, SystemVersion> {
        ready(Ok(SystemVersion { version: Some("kubernetes".into()), ..Default::default() }))
    }
    fn ping(&self) -> Fut<'_, String> {
        Box::pin(async move {
            self.cluster.list_pods("pyberth.io/sandbox=true").await.map_err(from_cluster)?;
            Ok("OK".into())
        })
    }
}
