//! Every engine call's failure counted, whatever owner made it: a delegating [`Engine`] the
//! registry wraps its engine in once, so `pyberth_engine_errors_total{op}` sees them all (issue
//! 32). `op` is the trait method's name, a fixed set.
//!
//! Not counted: a 404 (the object is not there: an answer the owners act on, e.g. removing a
//! container that is already gone) and a container's non-zero exit reported by `wait_container`.

use std::collections::HashMap;
use std::sync::Arc;

use bollard::auth::DockerCredentials;
use bollard::container::AttachContainerResults;
use bollard::errors::Error;
use bollard::exec::{CreateExecResults, StartExecOptions, StartExecResults};
use bollard::models::{
    ContainerCreateBody, ContainerCreateResponse, ContainerInspectResponse, ContainerStatsResponse, ContainerSummary,
    ContainerTopResponse, ContainerWaitResponse, CreateImageInfo, EventMessage, ExecConfig, ExecInspectResponse,
    ImageDeleteResponseItem, ImageHistoryResponseItem, ImageInspect, ImageSummary, Network, NetworkConnectRequest,
    NetworkCreateRequest, NetworkCreateResponse, NetworkDisconnectRequest, SystemInfo, SystemVersion, Volume,
    VolumeCreateRequest, VolumeListResponse,
};
use bollard::query_parameters as q;
use bytes::Bytes;
use futures::StreamExt as _;

use super::{Body, Engine, EngineRef, Fut, Items};
use crate::metrics::Metrics;

/// An engine whose failed calls are counted into the server's metrics.
#[derive(Debug)]
pub struct Counted {
    inner: EngineRef,
    metrics: Arc<Metrics>,
}

impl Counted {
    /// `inner`, its failures counted into `metrics`.
    pub fn wrap(inner: EngineRef, metrics: Arc<Metrics>) -> EngineRef {
        Arc::new(Self { inner, metrics })
    }

    fn fut<'a, T: Send + 'a>(&'a self, op: &'static str, call: Fut<'a, T>) -> Fut<'a, T> {
        Box::pin(async move {
            let result = call.await;
            if let Err(e) = &result {
                count(&self.metrics, op, e);
            }
            result
        })
    }

    fn items<'a, T: Send + 'a>(&self, op: &'static str, items: Items<'a, T>) -> Items<'a, T> {
        let metrics = self.metrics.clone();
        items
            .inspect(move |item| {
                if let Err(e) = item {
                    count(&metrics, op, e);
                }
            })
            .boxed()
    }
}

fn count(metrics: &Metrics, op: &'static str, e: &Error) {
    match e {
        Error::DockerResponseServerError { status_code: 404, .. } | Error::DockerContainerWaitError { .. } => {}
        _ => metrics.engine_error(op),
    }
}

impl Engine for Counted {
    fn list_containers(&self, options: Option<q::ListContainersOptions>) -> Fut<'_, Vec<ContainerSummary>> {
        self.fut("list_containers", self.inner.list_containers(options))
    }
    fn create_container(
        &self,
        options: Option<q::CreateContainerOptions>,
        config: ContainerCreateBody,
    ) -> Fut<'_, ContainerCreateResponse> {
        self.fut("create_container", self.inner.create_container(options, config))
    }
    fn start_container<'a>(&'a self, name: &'a str, options: Option<q::StartContainerOptions>) -> Fut<'a, ()> {
        self.fut("start_container", self.inner.start_container(name, options))
    }
    fn remove_container<'a>(&'a self, name: &'a str, options: Option<q::RemoveContainerOptions>) -> Fut<'a, ()> {
        self.fut("remove_container", self.inner.remove_container(name, options))
    }
    fn inspect_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::InspectContainerOptions>,
    ) -> Fut<'a, ContainerInspectResponse> {
        self.fut("inspect_container", self.inner.inspect_container(name, options))
    }
    fn wait_container(
        &self,
        name: &str,
        options: Option<q::WaitContainerOptions>,
    ) -> Items<'static, ContainerWaitResponse> {
        self.items("wait_container", self.inner.wait_container(name, options))
    }
    fn attach_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::AttachContainerOptions>,
    ) -> Fut<'a, AttachContainerResults> {
        self.fut("attach_container", self.inner.attach_container(name, options))
    }
    fn stats(&self, name: &str, options: Option<q::StatsOptions>) -> Items<'static, ContainerStatsResponse> {
        self.items("stats", self.inner.stats(name, options))
    }
    fn top_processes<'a>(&'a self, name: &'a str, options: Option<q::TopOptions>) -> Fut<'a, ContainerTopResponse> {
        self.fut("top_processes", self.inner.top_processes(name, options))
    }
    fn upload_to_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::UploadToContainerOptions>,
        tar: Body,
    ) -> Fut<'a, ()> {
        self.fut("upload_to_container", self.inner.upload_to_container(name, options, tar))
    }
    fn download_from_container(
        &self,
        name: &str,
        options: Option<q::DownloadFromContainerOptions>,
    ) -> Items<'static, Bytes> {
        self.items("download_from_container", self.inner.download_from_container(name, options))
    }
    fn create_exec<'a>(&'a self, container: &'a str, config: ExecConfig) -> Fut<'a, CreateExecResults> {
        self.fut("create_exec", self.inner.create_exec(container, config))
    }
    fn start_exec<'a>(&'a self, exec_id: &'a str, config: Option<StartExecOptions>) -> Fut<'a, StartExecResults> {
        self.fut("start_exec", self.inner.start_exec(exec_id, config))
    }
    fn inspect_exec<'a>(&'a self, exec_id: &'a str) -> Fut<'a, ExecInspectResponse> {
        self.fut("inspect_exec", self.inner.inspect_exec(exec_id))
    }
    fn create_volume(&self, config: VolumeCreateRequest) -> Fut<'_, Volume> {
        self.fut("create_volume", self.inner.create_volume(config))
    }
    fn remove_volume<'a>(&'a self, name: &'a str, options: Option<q::RemoveVolumeOptions>) -> Fut<'a, ()> {
        self.fut("remove_volume", self.inner.remove_volume(name, options))
    }
    fn inspect_volume<'a>(&'a self, name: &'a str) -> Fut<'a, Volume> {
        self.fut("inspect_volume", self.inner.inspect_volume(name))
    }
    fn list_volumes(&self, options: Option<q::ListVolumesOptions>) -> Fut<'_, VolumeListResponse> {
        self.fut("list_volumes", self.inner.list_volumes(options))
    }
    fn create_network(&self, config: NetworkCreateRequest) -> Fut<'_, NetworkCreateResponse> {
        self.fut("create_network", self.inner.create_network(config))
    }
    fn remove_network<'a>(&'a self, name: &'a str) -> Fut<'a, ()> {
        self.fut("remove_network", self.inner.remove_network(name))
    }
    fn list_networks(&self, options: Option<q::ListNetworksOptions>) -> Fut<'_, Vec<Network>> {
        self.fut("list_networks", self.inner.list_networks(options))
    }
    fn connect_network<'a>(&'a self, name: &'a str, config: NetworkConnectRequest) -> Fut<'a, ()> {
        self.fut("connect_network", self.inner.connect_network(name, config))
    }
    fn disconnect_network<'a>(&'a self, name: &'a str, config: NetworkDisconnectRequest) -> Fut<'a, ()> {
        self.fut("disconnect_network", self.inner.disconnect_network(name, config))
    }
    fn inspect_image<'a>(&'a self, name: &'a str) -> Fut<'a, ImageInspect> {
        self.fut("inspect_image", self.inner.inspect_image(name))
    }
    fn list_images(&self, options: Option<q::ListImagesOptions>) -> Fut<'_, Vec<ImageSummary>> {
        self.fut("list_images", self.inner.list_images(options))
    }
    fn remove_image<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::RemoveImageOptions>,
        credentials: Option<DockerCredentials>,
    ) -> Fut<'a, Vec<ImageDeleteResponseItem>> {
        self.fut("remove_image", self.inner.remove_image(name, options, credentials))
    }
    fn image_history<'a>(&'a self, name: &'a str) -> Fut<'a, Vec<ImageHistoryResponseItem>> {
        self.fut("image_history", self.inner.image_history(name))
    }
    fn build_image(
        &self,
        options: q::BuildImageOptions,
        credentials: Option<HashMap<String, DockerCredentials>>,
        tar: Option<Body>,
    ) -> Items<'_, bollard::models::BuildInfo> {
        self.items("build_image", self.inner.build_image(options, credentials, tar))
    }
    fn create_image(
        &self,
        options: Option<q::CreateImageOptions>,
        root_fs: Option<Body>,
        credentials: Option<DockerCredentials>,
    ) -> Items<'static, CreateImageInfo> {
        self.items("create_image", self.inner.create_image(options, root_fs, credentials))
    }
    fn events(&self, options: Option<q::EventsOptions>) -> Items<'static, EventMessage> {
        self.items("events", self.inner.events(options))
    }
    fn info(&self) -> Fut<'_, SystemInfo> {
        self.fut("info", self.inner.info())
    }
    fn version(&self) -> Fut<'_, SystemVersion> {
        self.fut("version", self.inner.version())
    }
    fn ping(&self) -> Fut<'_, String> {
        self.fut("ping", self.inner.ping())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::docker::fake::FakeEngine;
    use crate::metrics::Bounds;

    fn errors(metrics: &Metrics, op: &str) -> Option<u64> {
        let text = metrics.encode();
        let prefix = format!("pyberth_engine_errors_total{{op=\"{op}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|n| n.trim().parse().expect("a count"))
    }

    #[tokio::test]
    async fn a_failed_call_is_counted_under_its_method() {
        let metrics = Arc::new(Metrics::new(Bounds::new([], [], false)));
        let engine = Counted::wrap(Arc::new(FakeEngine::with_images(&[])), metrics.clone());
        let net = || NetworkCreateRequest { name: "n1".into(), ..Default::default() };
        engine.create_network(net()).await.expect("a new network");
        assert_eq!(errors(&metrics, "create_network"), None, "a call that worked is no error");
        // The name is taken now: the engine answers 409.
        engine.create_network(net()).await.expect_err("a name taken");
        engine.create_network(net()).await.expect_err("a name taken");
        assert_eq!(errors(&metrics, "create_network"), Some(2));
        // A stream's failed item counts too (the fake engine cannot build).
        let built: Vec<_> = engine.build_image(q::BuildImageOptions::default(), None, None).collect().await;
        assert!(built.iter().any(|b| b.is_err()));
        assert_eq!(errors(&metrics, "build_image"), Some(1));
        // "Not there" is an answer, not a failure.
        engine.remove_container("nobody", None).await.expect_err("no such container");
        assert_eq!(errors(&metrics, "remove_container"), None);
        assert_eq!(errors(&metrics, "create_network"), Some(2), "other ops keep their own counts");
    }
}
