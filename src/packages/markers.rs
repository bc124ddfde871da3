//! Environment markers evaluated as pip will on the image: one short-lived container, no network.

use std::time::Duration;

use crate::docker::Engine;

use super::Error;
use super::job::{Job, labels, run_job};
use crate::docker::container::{self, Owner};
use crate::docker::identity::{self};
use crate::docker::next_serial;

/// Evaluates each marker with pip's own `packaging` (the standalone one when pip has none).
/// Prints one JSON array: true, false, or null where a marker could not be evaluated.
pub(super) const MARKERS_PY: &str = r#"import json, sys
try:
    from pip._vendor.packaging.markers import Marker
except ImportError:
    from packaging.markers import Marker
out = []
for m in sys.argv[1:]:
    try:
        out.append(bool(Marker(m).evaluate()))
    except Exception:
        out.append(None)
print(json.dumps(out))
"#;

/// Evaluates PEP 508 environment markers (`python_version < '3'`) with the interpreter of
/// `image`, exactly as pip will when it installs on that image: in one short-lived container
/// with the sandbox's hardening, no network and no volume. `Some(false)` is a marker pip
/// would skip its requirement for; `None`, one it could not evaluate (pip then decides).
pub async fn evaluate_markers(
    docker: &dyn Engine,
    blueprint: &crate::sandbox::Blueprint,
    owner: &Owner,
    image: &str,
    markers: &[String],
) -> Result<Vec<Option<bool>>, Error> {
    let cfg = &*blueprint.cfg;
    let uid = identity::pick(docker, cfg.uid_range).await?;
    let name = format!("pyberth-{}-markers-{}", owner.instance, next_serial());
    let cmd = ["python3", "-I", "-c", MARKERS_PY].iter().map(|s| (*s).to_owned()).chain(markers.iter().cloned());
    let job = Job {
        name: &name,
        image,
        cmd: cmd.collect(),
        env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(), "LANG=C.UTF-8".into()],
        uid,
        labels: labels(owner, uid),
        network: None,
        mounts: Vec::new(),
        uploads: Vec::new(),
        timeout: Duration::from_secs(60),
        timeout_error: Error::Failed("the marker check did not finish within 60 s".into()),
        on_line: &|_| {},
        wheels_only: false,
    };
    let result = async {
        let finished = run_job(docker, &blueprint.spec, job).await?;
        container::remove_container(docker, &finished.id).await;
        let line = String::from_utf8_lossy(&finished.stdout);
        let verdicts: Option<Vec<Option<bool>>> = serde_json::from_str(line.trim()).ok();
        match verdicts {
            Some(v) if finished.code == 0 && v.len() == markers.len() => Ok(v),
            _ => Err(Error::Failed(format!(
                "the marker check failed (exit {}): {}",
                finished.code,
                finished.tail.join("\n").trim()
            ))),
        }
    }
    .await;
    identity::release(uid);
    result
}
