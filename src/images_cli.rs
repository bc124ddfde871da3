//! The `image` and `layers` commands' work: building environments' images (and their
//! packages' layers), and what the layer-store commands need from the engine.

use anyhow::Context as _;
use pyberth::config::SandboxConfig;
use pyberth::docker::container::Sandboxing;
use pyberth::docker::image;
use pyberth::environment::Environments;
use pyberth::instance::Instance;
use pyberth::packages as layers;
use pyberth::sandbox::Blueprint;

use super::envs;
use pyberth::app::Host;

/// `pyberth image build`: each environment's image asked for, and an environment's packages
/// as the layer its first session would otherwise install.
pub(crate) async fn image_build(
    cfg: SandboxConfig,
    force: bool,
    all: bool,
    environment: Option<&str>,
) -> anyhow::Result<()> {
    let host = Host::open(&cfg).await?;
    let envs = Environments::from_config(&cfg).map_err(anyhow::Error::msg)?;
    let docker = host.docker.clone();
    let progress = |line: &str| eprintln!("{line}");
    let targets: Vec<_> =
        if all { envs.all().cloned().collect() } else { vec![envs.get(environment).map_err(envs::hint)?] };
    let mut instance = None;
    for env in targets {
        let tag = image::tag_for(&env.cfg);
        if force || !image::exists(&docker, &tag).await? {
            eprintln!("environment {}: building {tag}", env.name);
            image::build(&docker, &env.cfg, &tag, &progress).await?;
        } else {
            eprintln!("environment {}: {tag} is up to date", env.name);
        }
        // `--all` stays offline-capable: packages come from the index, so only for an
        // environment named on its own.
        if env.packages.is_empty() || all {
            continue;
        }
        // Its packages too, as the layer its first session would otherwise install
        // (`datascience`): the installer's containers carry a live instance's labels.
        let owner = match &instance {
            Some(i) => i,
            None => instance.insert(host.instance(None)?),
        };
        let base = image::ensure(&docker, &env.cfg, &progress).await?;
        let index = layers::IndexSettings::from_config(&env.cfg).context("cannot read the CA bundle")?;
        // No engine check here: the installer gets the runtime as configured, as before.
        let sandboxing = Sandboxing { runtime: env.cfg.runtime.clone(), ..Default::default() };
        let blueprint = Blueprint::new(env.cfg.clone(), &sandboxing, &env.mounts, None);
        let egress = pyberth::egress::Manager::new(
            docker.clone(),
            owner.owner.clone(),
            env.cfg.clone(),
            index.ca_bundle.clone(),
        );
        let layer =
            layers::ensure(&docker, &blueprint, &owner.owner, &base, &env.packages, &index, &egress, &progress).await;
        layers::settle().await;
        egress.shutdown().await;
        let layer = layer.with_context(|| format!("environment {}: its packages could not be installed", env.name))?;
        let state = if layer.cached { "is up to date" } else { "is built" };
        eprintln!("environment {}: layer {} ({}) {state}", env.name, layer.key, env.packages.join(" "));
    }
    Ok(())
}

/// What `pyberth layers` needs: the engine, an image to run the store's reader and writer
/// containers with (the sandbox image), an identity for their labels, and the state dir.
pub(crate) async fn layer_store_access(
    cfg: &SandboxConfig,
) -> anyhow::Result<(pyberth::docker::EngineRef, String, Instance, std::path::PathBuf)> {
    let host = Host::open(cfg).await?;
    let progress = |line: &str| eprintln!("{line}");
    let img = image::ensure(&host.docker, cfg, &progress).await?;
    let instance = host.instance(None)?;
    Ok((host.docker, img, instance, host.state_dir))
}

/// Bytes as `docker images` shows them: decimal units, one decimal (84.7 kB, 1.2 MB).
pub(crate) fn human_size(bytes: i64) -> String {
    let b = u64::try_from(bytes).unwrap_or(0);
    match b {
        0..1_000 => format!("{b} B"),
        1_000..1_000_000 => format!("{}.{} kB", b / 1_000, b % 1_000 / 100),
        1_000_000..1_000_000_000 => format!("{}.{} MB", b / 1_000_000, b % 1_000_000 / 100_000),
        _ => format!("{}.{} GB", b / 1_000_000_000, b % 1_000_000_000 / 100_000_000),
    }
}

#[cfg(test)]
mod tests {
    use super::human_size;

    #[test]
    fn sizes_read_as_docker_shows_them() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(-5), "0 B");
        assert_eq!(human_size(999), "999 B");
        assert_eq!(human_size(84_700), "84.7 kB");
        assert_eq!(human_size(168_438_101), "168.4 MB");
        assert_eq!(human_size(2_500_000_000), "2.5 GB");
    }
}
