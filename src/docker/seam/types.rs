//! The names the engine's method signatures use (`methods.rs`), in one place: the files that
//! expand the method list, and the engines that implement it by hand (the fake, Kubernetes),
//! import them with one glob, so a method that names a new type adds it here and nowhere else.
//! Imports nothing of ours: any file may import it without making a cycle.

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{StreamExt as _, TryStreamExt as _};

pub(crate) use std::collections::HashMap;

pub(crate) use bollard::auth::DockerCredentials;
pub(crate) use bollard::container::AttachContainerResults;
pub(crate) use bollard::errors::Error;
pub(crate) use bollard::exec::{CreateExecResults, StartExecOptions, StartExecResults};
pub(crate) use bollard::models::{
    BuildInfo, ContainerCreateBody, ContainerCreateResponse, ContainerInspectResponse, ContainerStatsResponse,
    ContainerSummary, ContainerTopResponse, ContainerWaitResponse, CreateImageInfo, EventMessage, ExecConfig,
    ExecInspectResponse, ImageDeleteResponseItem, ImageHistoryResponseItem, ImageInspect, ImageSummary, Network,
    NetworkConnectRequest, NetworkCreateRequest, NetworkCreateResponse, NetworkDisconnectRequest, SystemInfo,
    SystemVersion, Volume, VolumeCreateRequest, VolumeListResponse,
};
pub(crate) use bollard::query_parameters as q;
pub(crate) use bytes::Bytes;

/// A result of an engine call.
pub type Fut<'a, T> = BoxFuture<'a, Result<T, Error>>;
/// A stream of an engine call.
pub type Items<'a, T> = BoxStream<'a, Result<T, Error>>;

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
    /// The body's bytes as they come (an engine that passes them on never holds them whole).
    pub fn into_stream(self) -> BoxStream<'static, std::io::Result<Bytes>> {
        match self {
            Body::Full(b) => futures::stream::iter([Ok(b)]).boxed(),
            Body::Stream(s) => s,
        }
    }

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
