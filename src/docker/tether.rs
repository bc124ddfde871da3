//! The tether of a sandbox to its server (docs/design.md D12, "Orphans"): nothing runs
//! forever without an owner.
//!
//! Each started sandbox gets one more attached exec, as PID 1's uid (never the code's), whose
//! only process reads its stdin until end of file. The server holds that stdin for as long as
//! it holds the container. When the server goes (a stop that leaves sessions, `kill -9`, its
//! container removed by `docker compose down -v`), the engine closes the stdin; the process
//! waits out the grace plus a margin, and then, unless a newer server tethered the container
//! meanwhile (another such process of PID 1's uid runs), signals PID 1, which stops the
//! container: no CPU, no memory. The engine then removes it (`AutoRemove`); its workspace
//! volume and keep volume stay. The keeper inside (same grace, `images/python/keeper.py`) has
//! by then had the agent save its state into the workspace, where the next server's restore
//! finds it, on a new container made on those volumes. The code's uid can neither signal this
//! process nor start another of PID 1's uid (no setuid binaries), so it cannot keep an orphan
//! alive.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::docker::Engine;
use bollard::exec::{CreateExecOptions, StartExecOptions, StartExecResults};
use bollard::models::{Mount, MountType, VolumeCreateRequest};

use super::Error;
use super::exec::{Input, Output};
use super::{ENV, INIT_USER, WORKSPACE};

/// How long after the keeper's save the container stops: room for the save to end.
pub const MARGIN: Duration = Duration::from_secs(10);
/// The container variable that tells the keeper the grace, in seconds.
pub const ORPHAN_ENV: &str = "PYBERTH_ORPHAN_AFTER_S";
/// Marks a tether among PID 1's processes (`$0` of the script).
const TAG: &str = "pyberth-tether";
/// Where a tmpfs workspace is copied before the container stops (a tmpfs is gone once it
/// stops): a disk volume whose root is PID 1's uid's, 0711 (the image makes the directory;
/// a new volume takes its owner and mode), so the code cannot fill it while the server lives.
pub const KEEP: &str = "/opt/pyberth/keep";
/// Waits for end of file, then the grace; then, unless another tether (of PID 1's uid, so
/// not one the code made) holds the container now, copies a tmpfs workspace to [`KEEP`] (the
/// keeper made it readable) and stops the container. A new tether first empties [`KEEP`]: the
/// server copied it back before. In `sh`: a Python here would cost the sandbox some 5 MiB of
/// its memory limit for as long as it runs.
const SCRIPT: &str = r#"k=/opt/pyberth/keep
[ -d "$k" ] && rm -rf "$k/ws" "$k/done"
cat >/dev/null
sleep "$1"
me=$(id -u)
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  if [ "$p" = 1 ] || [ "$p" = "$$" ]; then continue; fi
  [ "$(stat -c %u "$d" 2>/dev/null)" = "$me" ] || continue
  case " $(tr '\0' ' ' < "$d/cmdline" 2>/dev/null)" in *" $0 "*) exit 0;; esac
done
if [ -d "$k" ] && grep -q " /workspace tmpfs " /proc/mounts && mkdir "$k/ws"; then
  tar -C /workspace -cSf - . 2>/dev/null | tar -C "$k/ws" -xf - 2>/dev/null
  : > "$k/done"
fi
kill -TERM 1
"#;
/// Run as the code's uid in a new container on a left session's volumes, before its tether:
/// what the tether kept goes back into the (new, empty) tmpfs workspace.
pub const COPY_BACK: &str = r#"k=/opt/pyberth/keep
if [ -f "$k/done" ]; then tar -C "$k/ws" -cSf - . | tar -C /workspace -xf -; fi
true
"#;

/// How the volume of [`KEEP`] is named: its workspace volume's name and this.
pub const KEEP_SUFFIX: &str = "-keep";

/// The volume that holds a tmpfs workspace's copy, beside the workspace volume `volume`.
pub fn keep_volume(volume: &str) -> String {
    format!("{volume}{KEEP_SUFFIX}")
}

/// Creates the volume of [`KEEP`] beside the workspace volume `volume`, and its mount.
pub async fn add_keep(
    docker: &dyn Engine,
    volume: &str,
    labels: &HashMap<String, String>,
    mounts: &mut Vec<Mount>,
) -> Result<(), Error> {
    let keep = keep_volume(volume);
    let request = VolumeCreateRequest { name: Some(keep.clone()), labels: Some(labels.clone()), ..Default::default() };
    docker.create_volume(request).await?;
    mounts.push(Mount {
        target: Some(KEEP.into()),
        source: Some(keep),
        typ: Some(MountType::VOLUME),
        ..Default::default()
    });
    Ok(())
}

/// A held tether: its connection, open while this value lives.
struct Held {
    _input: Input,
    _output: Output,
}

/// Every tether this process holds, by container id. Process-wide on purpose: a tether must
/// live exactly as long as this server process holds the container, whoever made it.
fn held() -> &'static Mutex<HashMap<String, Held>> {
    static HELD: OnceLock<Mutex<HashMap<String, Held>>> = OnceLock::new();
    HELD.get_or_init(Mutex::default)
}

/// Tethers a running container to this server: it stops `after` plus [`MARGIN`] after this
/// server lets go of it (or dies). A tether held already is replaced.
pub async fn hold(docker: &dyn Engine, container: &str, after: Duration) -> Result<(), Error> {
    let wait = (after + MARGIN).as_secs().to_string();
    let cmd = vec!["sh", "-c", SCRIPT, TAG, wait.as_str()];
    let opts = CreateExecOptions {
        cmd: Some(cmd),
        attach_stdin: Some(true),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        tty: Some(false),
        working_dir: Some(WORKSPACE),
        user: Some(INIT_USER),
        privileged: Some(false),
        env: Some(ENV.to_vec()),
        ..Default::default()
    };
    let created = docker.create_exec(container, opts.into()).await?;
    let start = StartExecOptions { detach: false, tty: false, output_capacity: None };
    match docker.start_exec(&created.id, Some(start)).await? {
        StartExecResults::Attached { output, input } => {
            let mut all = held().lock().unwrap_or_else(|e| e.into_inner());
            all.insert(container.to_owned(), Held { _input: input, _output: output });
            Ok(())
        }
        StartExecResults::Detached => Err(Error::NotAttached),
    }
}

/// Lets go of a container's tether (it is being removed, or left on purpose).
pub fn release(container: &str) {
    held().lock().unwrap_or_else(|e| e.into_inner()).remove(container);
}
