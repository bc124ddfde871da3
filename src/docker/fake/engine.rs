//! The fake engine's answers to each call of the seam, as Docker answers them.

use bollard::models::{ContainerConfig, ContainerState, ContainerStateStatusEnum, ContainerSummaryStateEnum};
use futures::StreamExt;

use super::{Ctr, Exec, FakeEngine, Net, Vol, no_such, status};
use crate::docker::seam::types::*;
use crate::docker::seam::{Engine, matches_labels, once, ready};

fn volume_model(name: &str, v: &Vol) -> Volume {
    Volume { name: name.to_owned(), driver: "local".into(), labels: v.labels.clone(), ..Default::default() }
}

fn summary(name: &str, c: &Ctr) -> ContainerSummary {
    ContainerSummary {
        id: Some(name.to_owned()),
        names: Some(vec![format!("/{name}")]),
        image: Some(c.image.clone()),
        labels: Some(c.labels.clone()),
        state: Some(if c.running { ContainerSummaryStateEnum::RUNNING } else { ContainerSummaryStateEnum::EXITED }),
        ..Default::default()
    }
}

fn unsupported<T: Send + 'static>(what: &str) -> Items<'static, T> {
    once(Err(status(500, format!("the fake engine cannot {what}"))))
}

impl Engine for FakeEngine {
    fn list_containers(&self, options: Option<q::ListContainersOptions>) -> Fut<'_, Vec<ContainerSummary>> {
        let (all, filters) = options.map(|o| (o.all, o.filters)).unwrap_or_default();
        let w = self.world();
        let found = w
            .containers
            .iter()
            .filter(|(_, c)| (all || c.running) && matches_labels(&c.labels, filters.as_ref()))
            .map(|(n, c)| summary(n, c))
            .collect();
        ready(Ok(found))
    }
    fn create_container(
        &self,
        options: Option<q::CreateContainerOptions>,
        config: ContainerCreateBody,
    ) -> Fut<'_, ContainerCreateResponse> {
        let made = self.create_container_now(options.and_then(|o| o.name), config);
        ready(made.map(|id| ContainerCreateResponse { id, warnings: Vec::new() }))
    }
    fn start_container<'a>(&'a self, name: &'a str, _: Option<q::StartContainerOptions>) -> Fut<'a, ()> {
        if let Some(takes) = self.world().start_takes {
            return Box::pin(async move {
                {
                    let mut w = self.world();
                    w.starting += 1;
                    w.most_starting = w.most_starting.max(w.starting);
                }
                tokio::time::sleep(takes).await;
                let mut w = self.world();
                w.starting -= 1;
                match w.containers.get_mut(name) {
                    Some(c) => {
                        c.running = true;
                        Ok(())
                    }
                    None => Err(no_such("container", name)),
                }
            });
        }
        let mut w = self.world();
        ready(match w.containers.get_mut(name) {
            Some(c) => {
                c.running = true;
                Ok(())
            }
            None => Err(no_such("container", name)),
        })
    }
    fn remove_container<'a>(&'a self, name: &'a str, options: Option<q::RemoveContainerOptions>) -> Fut<'a, ()> {
        let force = options.is_some_and(|o| o.force);
        let mut w = self.world();
        let r = match w.containers.get(name) {
            None => Err(no_such("container", name)),
            Some(c) if c.running && !force => Err(status(409, format!("container {name} is running: stop it first"))),
            Some(_) => {
                if let Some(probe) = w.on_remove.0.clone() {
                    probe(name);
                }
                w.kill(name);
                w.containers.remove(name);
                Ok(())
            }
        };
        ready(r)
    }
    fn inspect_container<'a>(
        &'a self,
        name: &'a str,
        _: Option<q::InspectContainerOptions>,
    ) -> Fut<'a, ContainerInspectResponse> {
        let w = self.world();
        let r = w.containers.get(name).map(|c| ContainerInspectResponse {
            id: Some(name.to_owned()),
            name: Some(format!("/{name}")),
            image: Some(c.image.clone()),
            state: Some(ContainerState {
                running: Some(c.running),
                status: Some(if c.running {
                    ContainerStateStatusEnum::RUNNING
                } else {
                    ContainerStateStatusEnum::EXITED
                }),
                ..Default::default()
            }),
            config: Some(ContainerConfig {
                labels: Some(c.labels.clone()),
                image: Some(c.image.clone()),
                ..Default::default()
            }),
            ..Default::default()
        });
        ready(r.ok_or_else(|| no_such("container", name)))
    }
    fn wait_container(&self, name: &str, _: Option<q::WaitContainerOptions>) -> Items<'static, ContainerWaitResponse> {
        let mut w = self.world();
        let r = match w.containers.get_mut(name) {
            Some(c) => {
                c.running = false;
                Ok(ContainerWaitResponse { status_code: 0, error: None })
            }
            None => Err(no_such("container", name)),
        };
        once(r)
    }
    fn attach_container<'a>(
        &'a self,
        name: &'a str,
        _: Option<q::AttachContainerOptions>,
    ) -> Fut<'a, AttachContainerResults> {
        let found = self.world().containers.contains_key(name);
        ready(if found {
            Ok(AttachContainerResults { output: futures::stream::empty().boxed(), input: Box::pin(tokio::io::sink()) })
        } else {
            Err(no_such("container", name))
        })
    }
    /// Counted; a running container's CPU time reads 0 (code that uses none).
    fn stats(&self, name: &str, _: Option<q::StatsOptions>) -> Items<'static, ContainerStatsResponse> {
        let mut w = self.world();
        w.stats_calls += 1;
        if !w.containers.get(name).is_some_and(|c| c.running) {
            return futures::stream::empty().boxed();
        }
        let usage = bollard::models::ContainerCpuUsage { total_usage: Some(0), ..Default::default() };
        let cpu = bollard::models::ContainerCpuStats { cpu_usage: Some(usage), ..Default::default() };
        let memory = bollard::models::ContainerMemoryStats { usage: w.idle_bytes, ..Default::default() };
        let stats = ContainerStatsResponse { cpu_stats: Some(cpu), memory_stats: Some(memory), ..Default::default() };
        futures::stream::iter([Ok(stats)]).boxed()
    }
    fn top_processes<'a>(&'a self, _: &'a str, _: Option<q::TopOptions>) -> Fut<'a, ContainerTopResponse> {
        ready(Err(status(500, "the fake engine has no processes to list".into())))
    }
    fn upload_to_container<'a>(
        &'a self,
        name: &'a str,
        options: Option<q::UploadToContainerOptions>,
        tar: Body,
    ) -> Fut<'a, ()> {
        Box::pin(async move {
            let tar = tar.collect().await.map_err(|e| status(400, format!("upload: {e}")))?;
            let path = options.map(|o| o.path).unwrap_or_default();
            self.upload_now(name, &path, &tar)
        })
    }
    fn download_from_container(
        &self,
        name: &str,
        options: Option<q::DownloadFromContainerOptions>,
    ) -> Items<'static, Bytes> {
        let path = options.map(|o| o.path).unwrap_or_default();
        once(self.download_now(name, &path))
    }
    fn create_exec<'a>(&'a self, container: &'a str, config: ExecConfig) -> Fut<'a, CreateExecResults> {
        let mut w = self.world();
        let r = match w.containers.get(container) {
            None => Err(no_such("container", container)),
            Some(c) if !c.running => Err(status(409, format!("Container {container} is not running"))),
            Some(_) => {
                let id = format!("exec-{}", w.next());
                let exec = Exec { container: container.to_owned(), cmd: config.cmd.unwrap_or_default() };
                w.execs.insert(id.clone(), exec);
                Ok(CreateExecResults { id })
            }
        };
        ready(r)
    }
    fn start_exec<'a>(&'a self, exec_id: &'a str, _: Option<StartExecOptions>) -> Fut<'a, StartExecResults> {
        ready(self.start_exec_now(exec_id))
    }
    fn inspect_exec<'a>(&'a self, exec_id: &'a str) -> Fut<'a, ExecInspectResponse> {
        let known = self.world().execs.contains_key(exec_id);
        ready(if known {
            Ok(ExecInspectResponse {
                id: Some(exec_id.to_owned()),
                running: Some(false),
                exit_code: Some(0),
                ..Default::default()
            })
        } else {
            Err(no_such("exec instance", exec_id))
        })
    }
    fn create_volume(&self, config: VolumeCreateRequest) -> Fut<'_, Volume> {
        let mut w = self.world();
        let name = match config.name {
            Some(n) => n,
            None => format!("fake-volume-{}", w.next()),
        };
        let v = w
            .volumes
            .entry(name.clone())
            .or_insert_with(|| Vol { labels: config.labels.unwrap_or_default(), ..Default::default() });
        ready(Ok(volume_model(&name, v)))
    }
    fn remove_volume<'a>(&'a self, name: &'a str, _: Option<q::RemoveVolumeOptions>) -> Fut<'a, ()> {
        ready(self.remove_volume_now(name))
    }
    fn inspect_volume<'a>(&'a self, name: &'a str) -> Fut<'a, Volume> {
        let w = self.world();
        ready(w.volumes.get(name).map(|v| volume_model(name, v)).ok_or_else(|| no_such("volume", name)))
    }
    fn list_volumes(&self, options: Option<q::ListVolumesOptions>) -> Fut<'_, VolumeListResponse> {
        let filters = options.and_then(|o| o.filters);
        let w = self.world();
        let volumes = w
            .volumes
            .iter()
            .filter(|(_, v)| matches_labels(&v.labels, filters.as_ref()))
            .map(|(n, v)| volume_model(n, v))
            .collect();
        ready(Ok(VolumeListResponse { volumes: Some(volumes), warnings: None }))
    }
    fn create_network(&self, config: NetworkCreateRequest) -> Fut<'_, NetworkCreateResponse> {
        let mut w = self.world();
        if w.networks.contains_key(&config.name) {
            return ready(Err(status(409, format!("network with name {} already exists", config.name))));
        }
        w.networks.insert(config.name.clone(), Net { labels: config.labels.unwrap_or_default() });
        ready(Ok(NetworkCreateResponse { id: config.name, warning: String::new() }))
    }
    fn remove_network<'a>(&'a self, name: &'a str) -> Fut<'a, ()> {
        let mut w = self.world();
        let r = if !w.networks.contains_key(name) {
            Err(no_such("network", name))
        } else if w.containers.values().any(|c| c.networks.contains(name)) {
            Err(status(403, format!("error while removing network: network {name} has active endpoints")))
        } else {
            w.networks.remove(name);
            Ok(())
        };
        ready(r)
    }
    fn list_networks(&self, options: Option<q::ListNetworksOptions>) -> Fut<'_, Vec<Network>> {
        let filters = options.and_then(|o| o.filters);
        let w = self.world();
        let nets = w
            .networks
            .iter()
            .filter(|(_, n)| matches_labels(&n.labels, filters.as_ref()))
            .map(|(name, n)| Network {
                name: Some(name.clone()),
                id: Some(name.clone()),
                labels: Some(n.labels.clone()),
                ..Default::default()
            })
            .collect();
        ready(Ok(nets))
    }
    fn connect_network<'a>(&'a self, name: &'a str, config: NetworkConnectRequest) -> Fut<'a, ()> {
        let mut w = self.world();
        let known = w.networks.contains_key(name);
        let r = match w.containers.get_mut(&config.container) {
            Some(c) if known => {
                c.networks.insert(name.to_owned());
                Ok(())
            }
            Some(_) => Err(no_such("network", name)),
            None => Err(no_such("container", &config.container)),
        };
        ready(r)
    }
    fn disconnect_network<'a>(&'a self, name: &'a str, config: NetworkDisconnectRequest) -> Fut<'a, ()> {
        let mut w = self.world();
        let removed = w.containers.get_mut(&config.container).is_some_and(|c| c.networks.remove(name));
        let r = if removed { Ok(()) } else { Err(no_such("endpoint", &config.container)) };
        ready(r)
    }
    fn inspect_image<'a>(&'a self, name: &'a str) -> Fut<'a, ImageInspect> {
        let known = self.world().images.contains(name);
        ready(if known {
            Ok(ImageInspect {
                id: Some(format!("sha256:fake-{name}")),
                repo_tags: Some(vec![name.to_owned()]),
                ..Default::default()
            })
        } else {
            Err(no_such("image", name))
        })
    }
    fn list_images(&self, _: Option<q::ListImagesOptions>) -> Fut<'_, Vec<ImageSummary>> {
        let w = self.world();
        let images = w
            .images
            .iter()
            .map(|i| ImageSummary { id: format!("sha256:fake-{i}"), repo_tags: vec![i.clone()], ..Default::default() })
            .collect();
        ready(Ok(images))
    }
    fn remove_image<'a>(
        &'a self,
        name: &'a str,
        _: Option<q::RemoveImageOptions>,
        _: Option<DockerCredentials>,
    ) -> Fut<'a, Vec<ImageDeleteResponseItem>> {
        let removed = self.world().images.remove(name);
        ready(if removed { Ok(Vec::new()) } else { Err(no_such("image", name)) })
    }
    fn image_history<'a>(&'a self, name: &'a str) -> Fut<'a, Vec<ImageHistoryResponseItem>> {
        let known = self.world().images.contains(name);
        ready(if known { Ok(Vec::new()) } else { Err(no_such("image", name)) })
    }
    fn build_image(
        &self,
        _: q::BuildImageOptions,
        _: Option<HashMap<String, DockerCredentials>>,
        _: Option<Body>,
    ) -> Items<'_, bollard::models::BuildInfo> {
        unsupported("build images")
    }
    fn create_image(
        &self,
        _: Option<q::CreateImageOptions>,
        _: Option<Body>,
        _: Option<DockerCredentials>,
    ) -> Items<'static, CreateImageInfo> {
        unsupported("pull images")
    }
    fn events(&self, options: Option<q::EventsOptions>) -> Items<'static, EventMessage> {
        crate::docker::seam::no_events(options.as_ref())
    }
    fn info(&self) -> Fut<'_, SystemInfo> {
        ready(Ok(SystemInfo::default()))
    }
    fn version(&self) -> Fut<'_, SystemVersion> {
        ready(Ok(SystemVersion { version: Some("fake".into()), ..Default::default() }))
    }
    fn ping(&self) -> Fut<'_, String> {
        ready(Ok("OK".into()))
    }
}
