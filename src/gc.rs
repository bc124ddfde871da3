//! `pyberth gc`: lists, and with `--yes` removes, orphans now (docs/design.md D12, "Orphans"):
//! containers, volumes and egress networks carrying our labels whose server is dead by the
//! rule of D9 (its lock free, or its heartbeat stopped for `--grace-s`, by default
//! `--leftover-grace-s`), unless a record in this state dir names that server (its sessions
//! wait there for the next server to adopt or wake). Live servers' resources, and those of
//! servers nothing proves dead, are left alone.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use crate::app::Host;
use crate::config::SandboxConfig;
use crate::docker::container::{self, short};
use crate::docker::{LABEL_INSTANCE, LABEL_SESSION};
use crate::durable::ledger::Ledger;
use crate::instance::Key;

/// What to collect.
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// Remove them (without it, only list).
    #[arg(long)]
    pub yes: bool,
    /// How long a server's heartbeat must have been stopped (seconds; default
    /// --leftover-grace-s). 0: any stopped heartbeat.
    #[arg(long)]
    pub grace_s: Option<u64>,
    /// Only this server instance's orphans.
    #[arg(long)]
    pub only_instance: Option<String>,
}

/// What `gc` found (and removed, with `--yes`), as the lines it prints.
pub async fn run(cfg: &SandboxConfig, args: &GcArgs) -> anyhow::Result<String> {
    let yes = args.yes;
    let host = Host::open(cfg).await?;
    let docker = &host.docker;
    // A short-lived instance of its own: its lock proves nothing of anyone else.
    let me = host.instance(None)?;
    let recorded = Ledger::new(host.state_dir.clone(), true).recorded_instances();
    let found = container::inventory(docker).await?;
    let sweeper = me.sweeper(args.grace_s.map_or(cfg.leftover_grace(), Duration::from_secs));
    let (dead, doubt) = sweeper.dead(docker, &found).await;
    let only = |i: &String| args.only_instance.as_ref().is_none_or(|o| o == i);
    let dead: HashSet<Key> = dead.into_iter().filter(|(i, _)| !recorded.contains(i) && only(i)).collect();
    let of_dead = |l: &HashMap<String, String>| sweeper.owner_of(l).is_some_and(|k| dead.contains(&k));
    let what = if yes { "removed" } else { "orphan" };
    let mut out = String::new();
    let (mut containers, mut volumes) = (0, 0);
    for c in found.containers.iter().filter(|c| of_dead(&c.labels)) {
        if !yes || container::remove_leftover_container(docker, &c.id).await {
            containers += 1;
            let state = if c.running { "running" } else { "stopped" };
            let _ = writeln!(out, "{what} container {} ({state}) {}", short(&c.id), describe(&c.labels));
        }
    }
    for (name, labels) in found.volumes.iter().filter(|(_, l)| of_dead(l)) {
        if !yes || container::remove_leftover_volume(docker, name).await {
            volumes += 1;
            let _ = writeln!(out, "{what} volume {name} {}", describe(labels));
        }
    }
    let networks = if yes {
        let pick = |l: &HashMap<String, String>| of_dead(l);
        crate::egress::sweep_networks(docker, &pick).await
    } else {
        0
    };
    let labels = found.containers.iter().map(|c| &c.labels).chain(found.volumes.iter().map(|(_, l)| l));
    if labels.filter(|l| l.get(LABEL_INSTANCE).is_some_and(|i| recorded.contains(i) && only(i))).count() > 0 {
        let _ = writeln!(out, "kept: sessions recorded in {} for its next server", host.state_dir.display());
    }
    if let Some(after) = doubt {
        let _ = writeln!(
            out,
            "in doubt (heartbeat stopped within the grace), left alone: look again in {} s",
            after.as_secs() + 1
        );
    }
    let _ = if yes {
        writeln!(out, "removed {containers} containers, {volumes} volumes, {networks} networks")
    } else {
        writeln!(
            out,
            "{containers} containers and {volumes} volumes (and their networks) to remove: run `pyberth gc --yes`"
        )
    };
    Ok(out)
}

/// What a leaving server leaves on the engine of `instances` (its own and those it adopted):
/// containers (its sandboxes, running until their tethers stop them, then removed by the
/// engine) and volumes (workspaces, tmpfs copies, snapshots, heartbeat marks), which stay.
pub async fn left_by(
    docker: &dyn crate::docker::Engine,
    instances: &[String],
) -> Result<(usize, usize), crate::docker::Error> {
    let found = container::inventory(docker).await?;
    let of = |l: &HashMap<String, String>| {
        let i = l.get(LABEL_INSTANCE).or_else(|| l.get(crate::docker::heartbeat::LABEL_HEARTBEAT));
        i.is_some_and(|i| instances.contains(i))
    };
    let sandboxes = found.containers.iter().filter(|c| c.labels.contains_key(LABEL_SESSION));
    let containers = sandboxes.filter(|c| of(&c.labels)).count();
    let volumes = found.volumes.iter().filter(|(_, l)| of(l)).count();
    Ok((containers, volumes))
}

/// The instance and session a resource's labels name.
fn describe(labels: &HashMap<String, String>) -> String {
    let instance = labels.get(LABEL_INSTANCE).or_else(|| labels.get(crate::docker::heartbeat::LABEL_HEARTBEAT));
    let session = labels.get(LABEL_SESSION).map(|s| format!(" session {s}")).unwrap_or_default();
    format!("(instance {}{session})", instance.map_or("?", String::as_str))
}
