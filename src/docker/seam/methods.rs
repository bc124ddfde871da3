//! The engine's methods, listed once: `engine_methods!` holds the `Engine` trait as written,
//! and every piece of code that only restates its signatures is generated from that list.
//!
//! Why a macro: the trait's 33 methods used to be written out six times: the trait; three
//! wrappers that only forward (a shared `Arc<dyn Engine>`, the delegation to bollard, the
//! counting of failures), each differing from the trait in one expression a method; and the two
//! engines with real bodies. Now the trait and the three wrappers are this one list. The fake
//! and Kubernetes engines (`docker/fake/engine.rs`, `k8s/engine/seam.rs`) keep hand-written
//! impls, checked against the trait by the compiler: what they do differs method by method.
//!
//! To add a method: write it into the list below (its signature and doc); if it names a type
//! the list does not yet use, add the name to `types.rs`; write its bodies in the fake and the
//! Kubernetes engines (the compiler says where). The forwarders follow by themselves, unless
//! the method takes a [`Body`](super::Body) or wants a span of its own: then it gets an arm of
//! its own in `by_docker.rs`.

use super::types::*;

/// The one list of the engine's methods: the `Engine` trait exactly as declared. It hands the
/// trait's tokens to the macro `$then`, after `$pass` (what `$then` needs besides the list).
///
/// Every method reads `fn name(&self, arg: Type, ...) -> Fut<'_, T>;` or `-> Items<'_, T>;`
/// (a lifetime `<'a>` on the method and on `&'a self` allowed; the result is always `Fut` or
/// `Items`, because the forwarders box futures and streams differently).
macro_rules! engine_methods {
    ($then:ident $pass:tt) => {
        $then! { $pass
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
                fn start_container<'a>(
                    &'a self,
                    name: &'a str,
                    options: Option<q::StartContainerOptions>,
                ) -> Fut<'a, ()>;
                /// Removes a container.
                fn remove_container<'a>(
                    &'a self,
                    name: &'a str,
                    options: Option<q::RemoveContainerOptions>,
                ) -> Fut<'a, ()>;
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
                fn top_processes<'a>(
                    &'a self,
                    name: &'a str,
                    options: Option<q::TopOptions>,
                ) -> Fut<'a, ContainerTopResponse>;
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
                fn start_exec<'a>(
                    &'a self,
                    exec_id: &'a str,
                    config: Option<StartExecOptions>,
                ) -> Fut<'a, StartExecResults>;
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
                ) -> Items<'_, BuildInfo>;
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
        }
    };
}

/// A list's callback that emits the trait as written.
macro_rules! emit_trait {
    ({} $($trait:tt)*) => {
        $($trait)*
    };
}

engine_methods!(emit_trait {});

/// `forward_engine!(by => impl ... Engine for X)`: the impl of every listed method, each
/// method's body being `by!(self, name, Fut or Items, (its arguments))`. `by` is a small macro
/// of the caller's: the expression of one call, with arms of its own for the methods that
/// differ (e.g. `to_bollard!` in `by_docker.rs`). `self` reaches `by` as a token because a
/// macro's own `self` would not be the method's.
///
/// The trait's header is matched as written in the list: a change to its bounds is made in
/// both places (the compiler points here if not).
macro_rules! forward_engine {
    ($by:ident => $($head:tt)+) => {
        engine_methods!(forward_engine { $by; $($head)+ });
    };
    // The list comes back here, after the `{ by; impl header }` of the arm above.
    ({ $by:ident; $($head:tt)+ }
        $(#[$doc:meta])*
        pub trait Engine: Send + Sync + std::fmt::Debug {
            $(
                $(#[$attr:meta])*
                fn $name:ident $(<$lt:lifetime>)? (&$($slt:lifetime)? self $(, $arg:ident: $ty:ty)* $(,)?)
                    -> $kind:ident<$rlt:lifetime, $ret:ty>;
            )*
        }
    ) => {
        $($head)+ {
            $(
                fn $name $(<$lt>)? (&$($slt)? self $(, $arg: $ty)*) -> $kind<$rlt, $ret> {
                    $by!(self, $name, $kind, ($($arg),*))
                }
            )*
        }
    };
}
