//! The default state dir (issue 27, Low 7): where `pyberth run` keeps its state when told
//! nothing, and that another local user cannot stop it by making that place first.

use std::path::Path;
use std::process::Output;

use crate::cli::{scratch, streams};
use crate::common::{assert_cleaned_up, instance_name};

/// Another local user makes `$TMPDIR/pyberth-<uid>` first (issue 27, Low 7). Without
/// `XDG_RUNTIME_DIR`, a default start used it and refused (rightly) to go on: the default is
/// now under the user's own cache directory, which no other user can make first.
#[tokio::test(flavor = "multi_thread")]
async fn a_planted_shared_state_dir_does_not_stop_a_default_start() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = scratch("plantedtmp");
    let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).expect("uid");
    let planted = dir.join(format!("tmp/pyberth-{uid}"));
    std::fs::create_dir_all(&planted).expect("mkdir");
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    if uid == 0 {
        // As root, make it another user's outright.
        std::os::unix::fs::chown(&planted, Some(65534), Some(65534)).expect("chown");
    }
    let home = dir.join("home");
    std::fs::create_dir_all(&home).expect("home");
    let (out, instance) = default_start(&dir, &home, "plantedtmp").await;
    let (stdout, err) = streams(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(stdout.trim(), "ran");
    let state = home.join(".cache/pyberth");
    let meta = std::fs::metadata(&state).expect("the state dir is under the user's cache");
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    assert!(err.contains(&state.display().to_string()), "the log says where the state is: {err}");
    assert_cleaned_up(&instance).await;

    // A home where no cache can be made (a system user's): the shared temp dir, as before.
    std::fs::remove_dir_all(&planted).expect("unplant");
    let file_home = dir.join("not-a-dir");
    std::fs::write(&file_home, "").expect("file");
    let (out, instance) = default_start(&dir, &file_home, "plantedtmp2").await;
    let (_, err) = streams(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(planted.is_dir() && err.contains("cannot be made"), "{err}");
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// `pyberth run -` with `print('ran')`, with no state dir given, no XDG_RUNTIME_DIR, TMPDIR
/// under `dir` and HOME `home`.
async fn default_start(dir: &Path, home: &Path, tag: &str) -> (Output, String) {
    let instance = instance_name(tag);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"));
    cmd.args(["run", "-"])
        .current_dir(dir)
        .env("PYBERTH_INSTANCE", &instance)
        .env_remove("PYBERTH_STATE_DIR")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("XDG_CACHE_HOME")
        .env("TMPDIR", dir.join("tmp"))
        .env("HOME", home)
        .env("RUST_LOG", "pyberth=info")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().expect("spawn pyberth run");
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt as _;
        stdin.write_all(b"print('ran')").await.expect("stdin");
    }
    let out = tokio::time::timeout(std::time::Duration::from_secs(300), child.wait_with_output())
        .await
        .expect("in time")
        .expect("output");
    (out, instance)
}
