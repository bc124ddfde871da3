//! `bollard::Docker` behind the engine seam: every method delegates to bollard's own.

use std::collections::HashMap;

use bollard::Docker;
use bollard::auth::DockerCredentials;
use bollard::container::AttachContainerResults;
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
use futures::StreamExt;

use tracing::Instrument as _;

use super::{Body, Engine, Fut, Items};
use crate::telemetry::engine_span;

/// Docker, by delegation to bollard.
impl Engine for Docker {
    fn list_containers(&self, options: Option<q::ListContainersOptions>) -> Fut<'_, Vec<ContainerSummary>> {
        Box::pin(Docker::list_containers(self, options))
    }
    fn create_container(
        &self,
        options: Option<q::CreateContainerOptions>,
        config: ContainerCreateBody,
    ) -> Fut<'_, ContainerCreateResponse> {
        Box::pin(Docker::create_container(self, options, config).instrument(engine_span("docker create_container")))
    }
    fn start_container<'a>(&'a self, name: &'a str, options: Option<q::StartContainerOptions>) -> Fut<'a, ()> {
        Box::pin(Docker::start_container(self, name, options))
    }
    fn remove_container<'a>(&'a self, name: &'a str, options: Option<q::RemoveContainerOptions>) -> Fut<'a, ()> {
        Box::pin(Docker::remove_container(self, name, options))
    }
    fn inspect_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::InspectContainerOptions>,
    ) -> Fut<'a, ContainerInspectResponse> {
        Box::pin(Docker::inspect_container(self, name, options))
    }
    fn wait_container(
        &self,
        name: &str,
        options: Option<q::WaitContainerOptions>,
    ) -> Items<'static, ContainerWaitResponse> {
        Docker::wait_container(self, name, options).boxed()
    }
    fn attach_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::AttachContainerOptions>,
    ) -> Fut<'a, AttachContainerResults> {
        Box::pin(Docker::attach_container(self, name, options))
    }
    fn stats(&self, name: &str, options: Option<q::StatsOptions>) -> Items<'static, ContainerStatsResponse> {
        Docker::stats(self, name, options).boxed()
    }
    fn top_processes<'a>(&'a self, name: &'a str, options: Option<q::TopOptions>) -> Fut<'a, ContainerTopResponse> {
        Box::pin(Docker::top_processes(self, name, options))
    }
    fn upload_to_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::UploadToContainerOptions>,
        tar: Body,
    ) -> Fut<'a, ()> {
        Box::pin(async move {
            match tar {
                Body::Full(b) => Docker::upload_to_container(self, name, options, bollard::body_full(b)).await,
                Body::Stream(s) => Docker::upload_to_container(self, name, options, bollard::body_try_stream(s)).await,
            }
        })
    }
    fn download_from_container(
        &self,
        name: &str,
        options: Option<q::DownloadFromContainerOptions>,
    ) -> Items<'static, Bytes> {
        Docker::download_from_container(self, name, options).boxed()
    }
    fn create_exec<'a>(&'a self, container: &'a str, config: ExecConfig) -> Fut<'a, CreateExecResults> {
        Box::pin(Docker::create_exec(self, container, config).instrument(engine_span("docker create_exec")))
    }
    fn start_exec<'a>(&'a self, exec_id: &'a str, config: Option<StartExecOptions>) -> Fut<'a, StartExecResults> {
        Box::pin(Docker::start_exec(self, exec_id, config).instrument(engine_span("docker start_exec")))
    }
    fn inspect_exec<'a>(&'a self, exec_id: &'a str) -> Fut<'a, ExecInspectResponse> {
        Box::pin(Docker::inspect_exec(self, exec_id))
    }
    fn create_volume(&self, config: VolumeCreateRequest) -> Fut<'_, Volume> {
        Box::pin(Docker::create_volume(self, config))
    }
    fn remove_volume<'a>(&'a self, name: &'a str, options: Option<q::RemoveVolumeOptions>) -> Fut<'a, ()> {
        Box::pin(Docker::remove_volume(self, name, options))
    }
    fn inspect_volume<'a>(&'a self, name: &'a str) -> Fut<'a, Volume> {
        Box::pin(Docker::inspect_volume(self, name))
    }
    fn list_volumes(&self, options: Option<q::ListVolumesOptions>) -> Fut<'_, VolumeListResponse> {
        Box::pin(Docker::list_volumes(self, options))
    }
    fn create_network(&self, config: NetworkCreateRequest) -> Fut<'_, NetworkCreateResponse> {
        Box::pin(Docker::create_network(self, config))
    }
    fn remove_network<'a>(&'a self, name: &'a str) -> Fut<'a, ()> {
        Box::pin(Docker::remove_network(self, name))
    }
    fn list_networks(&self, options: Option<q::ListNetworksOptions>) -> Fut<'_, Vec<Network>> {
        Box::pin(Docker::list_networks(self, options))
    }
    fn connect_network<'a>(&'a self, name: &'a str, config: NetworkConnectRequest) -> Fut<'a, ()> {
        Box::pin(Docker::connect_network(self, name, config))
    }
    fn disconnect_network<'a>(&'a self, name: &'a str, config: NetworkDisconnectRequest) -> Fut<'a, ()> {
        Box::pin(Docker::disconnect_network(self, name, config))
    }
    fn inspect_image<'a>(&'a self, name: &'a str) -> Fut<'a, ImageInspect> {
        Box::pin(Docker::inspect_image(self, name))
    }
    fn list_images(&self, options: Option<q::ListImagesOptions>) -> Fut<'_, Vec<ImageSummary>> {
        Box::pin(Docker::list_images(self, options))
    }
    fn remove_image<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::RemoveImageOptions>,
        credentials: Option<DockerCredentials>,
    ) -> Fut<'a, Vec<ImageDeleteResponseItem>> {
        Box::pin(Docker::remove_image(self, name, options, credentials))
    }
    fn image_history<'a>(&'a self, name: &'a str) -> Fut<'a, Vec<ImageHistoryResponseItem>> {
        Box::pin(Docker::image_history(self, name))
    }
    fn build_image(
        &self,
        options: q::BuildImageOptions,
        credentials: Option<HashMap<String, DockerCredentials>>,
        tar: Option<Body>,
    ) -> Items<'_, bollard::models::BuildInfo> {
        match tar {
            None => Docker::build_image(self, options, credentials, None).boxed(),
            Some(Body::Full(b)) => Docker::build_image(self, options, credentials, Some(bollard::body_full(b))).boxed(),
            Some(Body::Stream(s)) => {
                Docker::build_image(self, options, credentials, Some(bollard::body_try_stream(s))).boxed()
            }
        }
    }
    fn create_image(
        &self,
        options: Option<q::CreateImageOptions>,
        root_fs: Option<Body>,
        credentials: Option<DockerCredentials>,
    ) -> Items<'static, CreateImageInfo> {
        match root_fs {
            None => Docker::create_image(self, options, None, credentials).boxed(),
            Some(Body::Full(b)) => {
                Docker::create_image(self, options, Some(bollard::body_full(b)), credentials).boxed()
            }
            Some(Body::Stream(s)) => {
                Docker::create_image(self, options, Some(bollard::body_try_stream(s)), credentials).boxed()
            }
        }
    }
    fn events(&self, options: Option<q::EventsOptions>) -> Items<'static, EventMessage> {
        Docker::events(self, options).boxed()
    }
    fn info(&self) -> Fut<'_, SystemInfo> {
        Box::pin(Docker::info(self))
    }
    fn version(&self) -> Fut<'_, SystemVersion> {
        Box::pin(Docker::version(self))
    }
    fn ping(&self) -> Fut<'_, String> {
        Box::pin(Docker::ping(self))
    }
}
