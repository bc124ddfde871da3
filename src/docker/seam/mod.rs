//! The engine seam: every call the owners make on a container engine, as one object-safe trait.
//!
//! The methods mirror bollard's own (names, option and model types: plain data), so a call
//! site reads as it did on `bollard::Docker`, and Docker implements it by delegation. Another
//! engine (Kubernetes pods through their exec API, docs/design.md D10) or the in-process fake
//! of the lib tests (`docker::fake`) sits behind the same trait. Owners hold an [`EngineRef`];
//! helpers take `&dyn Engine` (a `&bollard::Docker` coerces).
//!
//! The delegation to Docker is `by_docker.rs`; `counted.rs` counts any engine's failed calls.
//!
//! Errors stay bollard's: the owners already read its 404s and 409s, and a fake engine says
//! "no such container" the way Docker does.

mod by_docker;
mod counted;

pub use counted::Counted;

use std::collections::HashMap;
use std::sync::Arc;

use bollard::Docker;
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
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};

/// The engine as the owners hold it.
pub type EngineRef = Arc<dyn Engine>;

/// A result of an engine call.
pub type Fut<'a, T> = BoxFuture<'a, Result<T, Error>>;
/// A stream of an engine call.
pub type Items<'a, T> = BoxStream<'a, Result<T, Error>>;

/// The events of an engine to which nothing happens on its own (the fake; Kubernetes, whose
/// pods send no OOM events yet): a question about the past ends at once, a watch of the
/// future waits for ever.
pub fn no_events(options: Option<&q::EventsOptions>) -> Items<'static, EventMessage> {
    if options.is_some_and(|o| o.until.is_some()) {
        futures::stream::empty().boxed()
    } else {
        futures::stream::pending().boxed()
    }
}

/// The body of an upload or a build: whole, or streamed (bollard's own body type is private).
pub enum Body {
    /// All bytes at once.
    Full(Bytes),
    /// Bytes as they come; an error ends the upload.
    Stream(BoxStream<'static, std::io::Result<Bytes>>),
}

/// A whole body (bollard's `body_full`).
pub fn body_full(bytes: Bytes) -> Body {
    Body::Full(bytes)
}

/// A streamed body (bollard's `body_try_stream`).
pub fn body_try_stream(s: impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static) -> Body {
    Body::Stream(s.boxed())
}

impl Body {
    /// All of the body's bytes (an in-process engine reads uploads whole).
    pub async fn collect(self) -> std::io::Result<Vec<u8>> {
        match self {
            Body::Full(b) => Ok(b.to_vec()),
            Body::Stream(s) => {
                let chunks: Vec<Bytes> = s.try_collect().await?;
                Ok(chunks.concat())
            }
        }
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Body::Full(b) => write!(f, "Body::Full({} bytes)", b.len()),
            Body::Stream(_) => write!(f, "Body::Stream"),
        }
    }
}

/// Every engine call the owners make. Object-safe: owners hold `Arc<dyn Engine>`.
pub trait Engine: Send + Sync + std::fmt::Debug {
    // Containers.
    /// Containers, filtered.
    fn list_containers(&self, options: Option<q::ListContainersOptions>) -> Fut<'_, Vec<ContainerSummary>>;
    /// Creates a container (not started).
    fn create_container(
        &self,
        options: Option<q::CreateContainerOptions>,
        config: ContainerCreateBody,
    ) -> Fut<'_, ContainerCreateResponse>;
    /// Starts a container.
    fn start_container<'a>(&'a self, name: &'a str, options: Option<q::StartContainerOptions>) -> Fut<'a, ()>;
    /// Removes a container.
    fn remove_container<'a>(&'a self, name: &'a str, options: Option<q::RemoveContainerOptions>) -> Fut<'a, ()>;
    /// Inspects a container.
    fn inspect_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::InspectContainerOptions>,
    ) -> Fut<'a, ContainerInspectResponse>;
    /// Waits for a container to stop.
    fn wait_container(
        &self,
        name: &str,
        options: Option<q::WaitContainerOptions>,
    ) -> Items<'static, ContainerWaitResponse>;
    /// Attaches to a container's stdio.
    fn attach_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::AttachContainerOptions>,
    ) -> Fut<'a, AttachContainerResults>;
    /// A container's resource use.
    fn stats(&self, name: &str, options: Option<q::StatsOptions>) -> Items<'static, ContainerStatsResponse>;
    /// A container's processes, as `ps` on the engine's host lists them (the bench's memory
    /// breakdown).
    fn top_processes<'a>(&'a self, name: &'a str, options: Option<q::TopOptions>) -> Fut<'a, ContainerTopResponse>;
    /// Unpacks a tar into a container's filesystem.
    fn upload_to_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::UploadToContainerOptions>,
        tar: Body,
    ) -> Fut<'a, ()>;
    /// A tar of a path in a container's filesystem.
    fn download_from_container(
        &self,
        name: &str,
        options: Option<q::DownloadFromContainerOptions>,
    ) -> Items<'static, Bytes>;

    // Execs.
    /// Creates an exec in a running container.
    fn create_exec<'a>(&'a self, container: &'a str, config: ExecConfig) -> Fut<'a, CreateExecResults>;
    /// Starts an exec, attached or detached.
    fn start_exec<'a>(&'a self, exec_id: &'a str, config: Option<StartExecOptions>) -> Fut<'a, StartExecResults>;
    /// Inspects an exec (its exit code).
    fn inspect_exec<'a>(&'a self, exec_id: &'a str) -> Fut<'a, ExecInspectResponse>;

    // Volumes.
    /// Creates a volume; one of that name already there is answered as it is.
    fn create_volume(&self, config: VolumeCreateRequest) -> Fut<'_, Volume>;
    /// Removes a volume.
    fn remove_volume<'a>(&'a self, name: &'a str, options: Option<q::RemoveVolumeOptions>) -> Fut<'a, ()>;
    /// Inspects a volume.
    fn inspect_volume<'a>(&'a self, name: &'a str) -> Fut<'a, Volume>;
    /// Volumes, filtered.
    fn list_volumes(&self, options: Option<q::ListVolumesOptions>) -> Fut<'_, VolumeListResponse>;

    // Networks.
    /// Creates a network.
    fn create_network(&self, config: NetworkCreateRequest) -> Fut<'_, NetworkCreateResponse>;
    /// Removes a network.
    fn remove_network<'a>(&'a self, name: &'a str) -> Fut<'a, ()>;
    /// Networks, filtered.
    fn list_networks(&self, options: Option<q::ListNetworksOptions>) -> Fut<'_, Vec<Network>>;
    /// Puts a container on a network.
    fn connect_network<'a>(&'a self, name: &'a str, config: NetworkConnectRequest) -> Fut<'a, ()>;
    /// Takes a container off a network.
    fn disconnect_network<'a>(&'a self, name: &'a str, config: NetworkDisconnectRequest) -> Fut<'a, ()>;

    // Images.
    /// Inspects an image.
    fn inspect_image<'a>(&'a self, name: &'a str) -> Fut<'a, ImageInspect>;
    /// Images, filtered.
    fn list_images(&self, options: Option<q::ListImagesOptions>) -> Fut<'_, Vec<ImageSummary>>;
    /// Removes an image.
    fn remove_image<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::RemoveImageOptions>,
        credentials: Option<DockerCredentials>,
    ) -> Fut<'a, Vec<ImageDeleteResponseItem>>;
    /// An image's layers, newest first.
    fn image_history<'a>(&'a self, name: &'a str) -> Fut<'a, Vec<ImageHistoryResponseItem>>;
    /// Builds an image from a context tar.
    fn build_image(
        &self,
        options: q::BuildImageOptions,
        credentials: Option<HashMap<String, DockerCredentials>>,
        tar: Option<Body>,
    ) -> Items<'_, bollard::models::BuildInfo>;
    /// Pulls (or, with a body, imports) an image.
    fn create_image(
        &self,
        options: Option<q::CreateImageOptions>,
        root_fs: Option<Body>,
        credentials: Option<DockerCredentials>,
    ) -> Items<'static, CreateImageInfo>;

    // The engine.
    /// Events, filtered.
    fn events(&self, options: Option<q::EventsOptions>) -> Items<'static, EventMessage>;
    /// The engine's facts.
    fn info(&self) -> Fut<'_, SystemInfo>;
    /// The engine's version.
    fn version(&self) -> Fut<'_, SystemVersion>;
    /// Whether the engine answers.
    fn ping(&self) -> Fut<'_, String>;
}

/// A shared engine is an engine: `&Arc<dyn Engine>` passes where `&dyn Engine` is asked.
impl<T: Engine + ?Sized> Engine for Arc<T> {
    fn list_containers(&self, options: Option<q::ListContainersOptions>) -> Fut<'_, Vec<ContainerSummary>> {
        (**self).list_containers(options)
    }
    fn create_container(
        &self,
        options: Option<q::CreateContainerOptions>,
        config: ContainerCreateBody,
    ) -> Fut<'_, ContainerCreateResponse> {
        (**self).create_container(options, config)
    }
    fn start_container<'a>(&'a self, name: &'a str, options: Option<q::StartContainerOptions>) -> Fut<'a, ()> {
        (**self).start_container(name, options)
    }
    fn remove_container<'a>(&'a self, name: &'a str, options: Option<q::RemoveContainerOptions>) -> Fut<'a, ()> {
        (**self).remove_container(name, options)
    }
    fn inspect_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::InspectContainerOptions>,
    ) -> Fut<'a, ContainerInspectResponse> {
        (**self).inspect_container(name, options)
    }
    fn wait_container(
        &self,
        name: &str,
        options: Option<q::WaitContainerOptions>,
    ) -> Items<'static, ContainerWaitResponse> {
        (**self).wait_container(name, options)
    }
    fn attach_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::AttachContainerOptions>,
    ) -> Fut<'a, AttachContainerResults> {
        (**self).attach_container(name, options)
    }
    fn stats(&self, name: &str, options: Option<q::StatsOptions>) -> Items<'static, ContainerStatsResponse> {
        (**self).stats(name, options)
    }
    fn top_processes<'a>(&'a self, name: &'a str, options: Option<q::TopOptions>) -> Fut<'a, ContainerTopResponse> {
        (**self).top_processes(name, options)
    }
    fn upload_to_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::UploadToContainerOptions>,
        tar: Body,
    ) -> Fut<'a, ()> {
        (**self).upload_to_container(name, options, tar)
    }
    fn download_from_container(
        &self,
        name: &str,
        options: Option<q::DownloadFromContainerOptions>,
    ) -> Items<'static, Bytes> {
        (**self).download_from_container(name, options)
    }
    fn create_exec<'a>(&'a self, container: &'a str, config: ExecConfig) -> Fut<'a, CreateExecResults> {
        (**self).create_exec(container, config)
    }
    fn start_exec<'a>(&'a self, exec_id: &'a str, config: Option<StartExecOptions>) -> Fut<'a, StartExecResults> {
        (**self).start_exec(exec_id, config)
    }
    fn inspect_exec<'a>(&'a self, exec_id: &'a str) -> Fut<'a, ExecInspectResponse> {
        (**self).inspect_exec(exec_id)
    }
    fn create_volume(&self, config: VolumeCreateRequest) -> Fut<'_, Volume> {
        (**self).create_volume(config)
    }
    fn remove_volume<'a>(&'a self, name: &'a str, options: Option<q::RemoveVolumeOptions>) -> Fut<'a, ()> {
        (**self).remove_volume(name, options)
    }
    fn inspect_volume<'a>(&'a self, name: &'a str) -> Fut<'a, Volume> {
        (**self).inspect_volume(name)
    }
    fn list_volumes(&self, options: Option<q::ListVolumesOptions>) -> Fut<'_, VolumeListResponse> {
        (**self).list_volumes(options)
    }
    fn create_network(&self, config: NetworkCreateRequest) -> Fut<'_, NetworkCreateResponse> {
        (**self).create_network(config)
    }
    fn remove_network<'a>(&'a self, name: &'a str) -> Fut<'a, ()> {
        (**self).remove_network(name)
    }
    fn list_networks(&self, options: Option<q::ListNetworksOptions>) -> Fut<'_, Vec<Network>> {
        (**self).list_networks(options)
    }
    fn connect_network<'a>(&'a self, name: &'a str, config: NetworkConnectRequest) -> Fut<'a, ()> {
        (**self).connect_network(name, config)
    }
    fn disconnect_network<'a>(&'a self, name: &'a str, config: NetworkDisconnectRequest) -> Fut<'a, ()> {
        (**self).disconnect_network(name, config)
    }
    fn inspect_image<'a>(&'a self, name: &'a str) -> Fut<'a, ImageInspect> {
        (**self).inspect_image(name)
    }
    fn list_images(&self, options: Option<q::ListImagesOptions>) -> Fut<'_, Vec<ImageSummary>> {
        (**self).list_images(options)
    }
    fn remove_image<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::RemoveImageOptions>,
        credentials: Option<DockerCredentials>,
    ) -> Fut<'a, Vec<ImageDeleteResponseItem>> {
        (**self).remove_image(name, options, credentials)
    }
    fn image_history<'a>(&'a self, name: &'a str) -> Fut<'a, Vec<ImageHistoryResponseItem>> {
        (**self).image_history(name)
    }
    fn build_image(
        &self,
        options: q::BuildImageOptions,
        credentials: Option<HashMap<String, DockerCredentials>>,
        tar: Option<Body>,
    ) -> Items<'_, bollard::models::BuildInfo> {
        (**self).build_image(options, credentials, tar)
    }
    fn create_image(
        &self,
        options: Option<q::CreateImageOptions>,
        root_fs: Option<Body>,
        credentials: Option<DockerCredentials>,
    ) -> Items<'static, CreateImageInfo> {
        (**self).create_image(options, root_fs, credentials)
    }
    fn events(&self, options: Option<q::EventsOptions>) -> Items<'static, EventMessage> {
        (**self).events(options)
    }
    fn info(&self) -> Fut<'_, SystemInfo> {
        (**self).info()
    }
    fn version(&self) -> Fut<'_, SystemVersion> {
        (**self).version()
    }
    fn ping(&self) -> Fut<'_, String> {
        (**self).ping()
    }
}

/// What an owner accepts as its engine: a shared one, or a Docker client (wrapped).
pub trait IntoEngine {
    /// The engine, shared.
    fn into_engine(self) -> EngineRef;
}

impl IntoEngine for Docker {
    fn into_engine(self) -> EngineRef {
        Arc::new(self)
    }
}

impl IntoEngine for EngineRef {
    fn into_engine(self) -> EngineRef {
        self
    }
}
