//! Out-of-memory kills on Kubernetes, for the owners' one question: was a process of this
//! container killed by the OOM killer (`docker::container::oom_since`, an `oom` event of one
//! container between two times)? No event stream says it there; two records do:
//!
//! - the kubelet's: the container's state or last state `terminated`, reason `OOMKilled` (the
//!   whole container killed, as cgroup v2 nodes do since Kubernetes 1.28: one kill ends all);
//! - the kernel's: the `oom_kill` count of the container's memory cgroup (`memory.events` on
//!   cgroup v2, `memory.oom_control` on v1), read by an exec of `cat` in the pod, for a kill
//!   of one process in a container that lives on. A kill counts once: the count last seen is
//!   kept per container.
//!
//! The count is read from inside the pod by a process of the code's uid, so code could forge
//! it (through that process' `/proc` entries, on a node whose ptrace scope allows it). What
//! it gains is its own result called out of memory, or not: no limit and no other session.

use std::time::Duration;

use bollard::models::{EventActor, EventMessage, EventMessageTypeEnum};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use tokio::io::AsyncReadExt as _;

use super::KubeEngine;
use crate::docker::seam::types::{Items, q};

/// The cgroup files that count OOM kills (v2, v1); `cat` prints whichever is there.
const COUNTERS: [&str; 2] = ["/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"];
/// Most bytes of `cat`'s output read.
const MAX_OUTPUT: u64 = 4096;
/// How long the read may take.
const LIMIT: Duration = Duration::from_secs(4);

/// Whether the kubelet says a container of `pod` was killed out of memory.
pub(super) fn kubelet_says_oom(pod: &Pod) -> bool {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    statuses.into_iter().flatten().any(|c| {
        let now = c.state.as_ref().and_then(|s| s.terminated.as_ref());
        let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
        [now, last].into_iter().flatten().any(|t| t.reason.as_deref() == Some("OOMKilled"))
    })
}

/// The `oom_kill` count in the text of those files (a line `oom_kill N`).
pub(super) fn oom_kills(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
}

impl KubeEngine {
    /// The events asked for: an `oom` event of the one container asked about when it had an
    /// OOM kill not told before; nothing else ever happens (`no_events`).
    pub(super) fn oom_events(&self, options: Option<q::EventsOptions>) -> Items<'static, EventMessage> {
        let asked = options.as_ref().filter(|o| o.until.is_some()).and_then(|o| {
            let f = o.filters.as_ref()?;
            let container = f.get("container")?.first()?.clone();
            f.get("event")?.iter().any(|e| e == "oom").then_some(container)
        });
        let Some(container) = asked else { return crate::docker::seam::no_events(options.as_ref()) };
        let engine = self.clone();
        futures::stream::once(async move {
            let killed = tokio::time::timeout(LIMIT, engine.oom_killed(&container)).await.unwrap_or(false);
            killed.then(|| EventMessage {
                typ: Some(EventMessageTypeEnum::CONTAINER),
                action: Some("oom".into()),
                actor: Some(EventActor { id: Some(container), attributes: None }),
                ..Default::default()
            })
        })
        .filter_map(|e| std::future::ready(e.map(Ok)))
        .boxed()
    }

    /// Whether `container` had an OOM kill not told before.
    async fn oom_killed(&self, container: &str) -> bool {
        let Ok(pod) = self.pod_of(container).await else { return false };
        let Ok(Some(p)) = self.cluster.get_pod(&pod).await else { return false };
        if kubelet_says_oom(&p) {
            return true;
        }
        let Some(count) = self.oom_count(&pod).await else { return false };
        let last = self.records().oom_seen.insert(container.to_owned(), count).unwrap_or(0);
        count > last
    }

    /// The `oom_kill` count of `pod`'s memory cgroup, read in the pod.
    async fn oom_count(&self, pod: &str) -> Option<u64> {
        let mut args = vec!["cat"];
        args.extend(COUNTERS);
        let exec = self.cluster.exec(pod, &args, false).await.ok()?;
        let mut out = Vec::new();
        exec.stdout.take(MAX_OUTPUT).read_to_end(&mut out).await.ok()?;
        oom_kills(&String::from_utf8_lossy(&out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ContainerState, ContainerStateTerminated, ContainerStatus, PodStatus};

    #[test]
    fn counts_read_from_either_cgroup_version() {
        let v2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n";
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n";
        assert_eq!((oom_kills(v2), oom_kills(v1)), (Some(2), Some(5)));
        assert_eq!(oom_kills("oom_kill_disable 0\nunder_oom 0\n"), None, "an old kernel without the count");
        assert_eq!(oom_kills("oom_kill x\n"), None);
    }

    #[test]
    fn the_kubelets_oomkilled_is_read_from_state_or_last_state() {
        let terminated = |reason: &str| ContainerState {
            terminated: Some(ContainerStateTerminated {
                reason: Some(reason.into()),
                exit_code: 137,
                ..Default::default()
            }),
            ..Default::default()
        };
        let pod = |state: Option<ContainerState>, last: Option<ContainerState>| Pod {
            status: Some(PodStatus {
                container_statuses: Some(vec![ContainerStatus { state, last_state: last, ..Default::default() }]),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(kubelet_says_oom(&pod(Some(terminated("OOMKilled")), None)));
        assert!(kubelet_says_oom(&pod(None, Some(terminated("OOMKilled")))));
        assert!(!kubelet_says_oom(&pod(Some(terminated("Error")), None)));
        assert!(!kubelet_says_oom(&Pod::default()));
    }
}
