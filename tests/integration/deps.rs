//! Dependency layers: installs, cache hits, live installs, failures, and `pyberth layers`.
//! Each test installs requirement sets no other test asks for, and removes the layers it made
//! (`OwnLayers`): two tests building one set at once leave an untagged image behind, and one
//! removing a layer another is about to use fails that one.

use std::collections::HashMap;

use bollard::query_parameters::{BuildImageOptionsBuilder, EventsOptionsBuilder, RemoveImageOptionsBuilder};
use futures::StreamExt;
use pyberth::docker::layers::{IndexSettings, layer_key};
use serde_json::json;

use crate::common::{OwnLayers, Server, containers_of, docker, server_settings, state_dir, text};

/// Counts the installer containers an instance creates from now on. A live subscription, not a
/// replay: this engine keeps only its last few hundred events, fewer than a loaded suite makes
/// while one install runs.
struct Installers {
    count: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Installers {
    async fn watch(instance: &str) -> Installers {
        let instance_label = format!("pyberth.instance={instance}");
        let filters = HashMap::from([
            ("type", vec!["container"]),
            ("event", vec!["create"]),
            ("label", vec!["pyberth.installer=1", instance_label.as_str()]),
        ]);
        let opts = EventsOptionsBuilder::default().filters(&filters).build();
        let mut events = docker().await.events(Some(opts));
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = count.clone();
        let task = tokio::spawn(async move {
            while let Some(Ok(_)) = events.next().await {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        });
        // The subscription is made on the task's first poll: give it that before the action.
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        Installers { count, task }
    }

    /// How many so far, after the engine had a moment to deliver the last ones.
    async fn seen(&self) -> usize {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        self.count.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Installers {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Removes the cached layer a server with `index` settings finds for `requirements` (one,
/// canonical) on the sandbox image `base`, so an install must run: that one tag, computed as
/// the server computes it, never a layer of another sandbox image or another checkout's
/// test; not forced, so not one a container uses either.
async fn forget_layer(requirements: &str, base: &str, index: &IndexSettings) {
    let Ok(image) = docker().await.inspect_image(base).await else { return };
    let key = layer_key(&image.id.unwrap_or_else(|| base.to_owned()), &[requirements.to_owned()], index);
    let opts = RemoveImageOptionsBuilder::default().build();
    let _ = docker().await.remove_image(&format!("pyberth-layer:{key}"), Some(opts), None).await;
}

fn no_network_code() -> &'static str {
    "sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:])"
}

#[tokio::test(flavor = "multi_thread")]
async fn a_package_installs_once_and_later_sessions_reuse_the_layer() {
    let cfg = server_settings();
    let index = IndexSettings::from_config(&cfg).expect("index settings");
    forget_layer("six", &pyberth::docker::image::tag_for(&cfg), &index).await;
    let _layers = OwnLayers::new(&["six"]);
    let s = Server::start("deps-six", &[]).await;
    let installers = Installers::watch(&s.instance).await;
    let r = s.call("install_packages", json!({ "packages": ["six"], "session": "first" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert!(installers.seen().await >= 1, "a cold set runs the installer");
    let sc = s.ok("first", "import six\nsix.__name__").await;
    assert_eq!(sc["result"], "'six'");
    assert_eq!(s.ok("first", no_network_code()).await["result"], "['lo']", "still offline after an install");

    // A second session asking for the same set starts from the layer: no installer runs.
    let before = installers.seen().await;
    let (r, sc) = s.run_with(json!({ "session": "second", "code": "import six\nsix.PY3", "packages": ["Six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "True");
    assert_eq!(installers.seen().await, before, "cache hit: no installer");
    assert_eq!(s.ok("second", no_network_code()).await["result"], "['lo']");

    let r = s.call("list_packages", json!({ "session": "second", "names": ["six", "no-such-thing"] })).await;
    let sc = r.structured_content.expect("sc");
    assert_eq!(sc["packages"][0]["name"], "six");
    assert_eq!(sc["missing"], json!(["no-such-thing"]));
    assert_eq!(sc["requirements"], json!(["six"]));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_live_session_gains_packages_and_keeps_its_variables() {
    let _layers = OwnLayers::new(&["attrs"]);
    let s = Server::start("deps-live", &[]).await;
    s.ok("live", "kept = 41").await;
    let r = s.call("install_packages", json!({ "packages": ["attrs"], "session": "live" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = s.ok("live", "import attrs\n(kept + 1, attrs.__name__)").await;
    assert_eq!(sc["result"], "(42, 'attrs')");
    // Asking again is a no-op.
    let r = s.call("install_packages", json!({ "packages": ["attrs"], "session": "live" })).await;
    let sc = r.structured_content.expect("sc");
    assert_eq!(sc["installed"], json!([]));
    assert_eq!(sc["already_installed"], json!(["attrs"]));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_and_unknown_packages_are_tool_errors_and_the_session_survives() {
    let s = Server::start("deps-bad", &[]).await;
    for (bad, want) in [
        (json!(["-e ."]), "installer options"),
        (json!(["pkg @ https://example.com/p.whl"]), "URLs"),
        (json!(["../local"]), "local paths"),
        (json!(["six\n--index-url=http://x"]), "control characters"),
        (json!(["six==1", "six==2"]), "different constraints"),
        (json!([]), "packages is empty"),
    ] {
        let r = s.call("install_packages", json!({ "packages": bad })).await;
        assert_eq!(r.is_error, Some(true));
        assert!(text(&r).contains(want), "{bad}: {}", text(&r));
    }
    assert!(containers_of(&s.instance).await.is_empty(), "refused before any container");

    s.ok("default", "v = 'alive'").await;
    let r = s.call("install_packages", json!({ "packages": ["pyberth-no-such-package-zzz"] })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("no such package"), "{}", text(&r));
    assert_eq!(s.ok("default", "v").await["result"], "'alive'");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn layers_survive_a_restart_and_compiled_extensions_work() {
    let _layers = OwnLayers::new(&["markupsafe"]);
    let s = Server::start("deps-restart-1", &[]).await;
    let (r, _) = s.run_with(json!({ "session": "c", "code": "1", "packages": ["markupsafe"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.stop().await;
    let s = Server::start("deps-restart-2", &[]).await;
    let installers = Installers::watch(&s.instance).await;
    // MarkupSafe's wheel carries a C extension, _speedups.
    let code = "from markupsafe import _speedups, escape\nstr(escape('<a>'))";
    let (r, sc) = s.run_with(json!({ "session": "c", "code": code, "packages": ["MarkupSafe"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "'&lt;a&gt;'");
    assert_eq!(installers.seen().await, 0, "the layer outlived the first server");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn inline_script_metadata_declares_dependencies() {
    let _layers = OwnLayers::new(&["iniconfig"]);
    let s = Server::start("deps-pep723", &[]).await;
    let code = "# /// script\n# dependencies = [\"iniconfig\"]\n# ///\nimport iniconfig\niniconfig.__name__";
    let sc = s.ok("default", code).await;
    assert_eq!(sc["result"], "'iniconfig'");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_index_is_said_plainly() {
    // Port 9 on the installer's own loopback: the connection is refused at once.
    let s = Server::start("deps-noindex", &[("PYBERTH_INDEX_URL", "http://127.0.0.1:9/simple")]).await;
    let r = s.call("install_packages", json!({ "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("could not be reached"), "{}", text(&r));
    assert!(text(&r).contains("http://127.0.0.1:9/simple"), "names the index: {}", text(&r));
    s.stop().await;
}

/// A desktop client starts the server with almost no environment: no `SSL_CERT_FILE`, no
/// `PIP_CERT`. Installs must still work behind a TLS-intercepting proxy, through the host's
/// system CA bundle, and get_environment says which bundle is used.
#[tokio::test(flavor = "multi_thread")]
async fn installs_work_with_the_environment_a_desktop_client_passes() {
    let _layers = OwnLayers::new(&["iniconfig==2.0.0"]);
    let s = Server::start_like_a_desktop_client("deps-minimal-env", &[]).await;
    let r = s.call("get_environment", json!({})).await;
    let sc = r.structured_content.clone().expect("structured");
    let bundle = sc["ca_bundle"].as_str().unwrap_or_default().to_owned();
    assert!(!bundle.is_empty() && std::path::Path::new(&bundle).is_file(), "a system bundle is used: {sc}");
    assert!(text(&r).contains(&bundle), "and said: {}", text(&r));
    // A set no other test asks for, its cached layer removed: the install really reaches the index.
    // Started without the test's environment: the default settings, the default image.
    let (base, index) = (pyberth::docker::image::sandbox_tag(), IndexSettings::default());
    forget_layer("iniconfig==2.0.0", &base, &index).await;
    let r = s.call("install_packages", json!({ "packages": ["iniconfig==2.0.0"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = s.ok("default", "import iniconfig\niniconfig.__name__").await;
    assert_eq!(sc["result"], "'iniconfig'");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_requirement_whose_marker_is_false_here_is_skipped_not_installed() {
    // (idna: no other test asks for it, so no test races this one for its layer.)
    // pip ignores a requirement whose environment marker is false; saying "installed" (and
    // recording it in the session) would be a lie the model then acts on.
    let never = "idna; python_version < '3'";
    // tomli, not iniconfig: inline_script_metadata_declares_dependencies builds that one.
    let _layers = OwnLayers::new(&["tomli", "idna; python_version >= '3'"]);
    let s = Server::start("deps-marker", &[]).await;
    let r = s.call("install_packages", json!({ "packages": [never], "session": "m" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.clone().expect("sc");
    assert_eq!(sc["installed"], json!([]), "{}", text(&r));
    assert_eq!(sc["skipped"], json!([never]), "{}", text(&r));
    assert!(text(&r).contains("marker false in this environment"), "{}", text(&r));
    let r = s.call("list_packages", json!({ "session": "m", "names": ["idna"] })).await;
    let sc = r.structured_content.expect("sc");
    assert_eq!(sc["requirements"], json!([]), "the session does not record a skipped requirement");
    assert_eq!(sc["missing"], json!(["idna"]));

    // Beside a requirement that applies, in a live session: one installed, one skipped.
    let r = s.call("install_packages", json!({ "packages": ["tomli", never], "session": "m" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.clone().expect("sc");
    assert_eq!(sc["installed"], json!(["tomli"]), "{}", text(&r));
    assert_eq!(sc["skipped"], json!([never]), "{}", text(&r));
    assert_eq!(s.ok("m", "import tomli\ntomli.__name__").await["result"], "'tomli'");

    // A true marker installs as before.
    let r = s.call("install_packages", json!({ "packages": ["idna; python_version >= '3'"], "session": "m" })).await;
    let sc = r.structured_content.clone().expect("sc");
    assert_eq!(sc["installed"], json!(["idna; python_version >= '3'"]), "{}", text(&r));
    assert_eq!(sc["skipped"], json!([]), "{}", text(&r));

    // run_python creating a session says so too, and never claims the package is ready.
    let (r, _) = s.run_with(json!({ "session": "n", "code": "1", "packages": [never] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert!(text(&r).contains("marker false in this environment"), "{}", text(&r));
    assert!(!text(&r).contains("packages ready"), "{}", text(&r));
    s.stop().await;
}

/// Builds a stand-in layer as `docker/layers.rs` does (labels through the build) on `base`:
/// one `size`-byte file, so its own size is known.
async fn stand_in_layer(base: &str, tag: &str, requirements: &str, size: usize, fill: u8) -> String {
    let dockerfile = format!("FROM {base}\nCOPY blob /opt/pyberth/site/blob\n");
    let mut ar = tar::Builder::new(Vec::new());
    for (name, data) in [("Dockerfile", dockerfile.into_bytes()), ("blob", vec![fill; size])] {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        ar.append_data(&mut h, name, &data[..]).expect("context");
    }
    let context = ar.into_inner().expect("context");
    let labels = HashMap::from([
        ("pyberth.image", "layer".to_owned()),
        ("pyberth.requirements", requirements.to_owned()),
        ("pyberth.base", base.to_owned()),
    ]);
    let opts = BuildImageOptionsBuilder::default().dockerfile("Dockerfile").t(tag).labels(&labels).rm(true).build();
    let docker = docker().await;
    let mut build = docker.build_image(opts, None, Some(bollard::body_full(context.into())));
    while let Some(step) = build.next().await {
        let step = step.expect("build");
        assert!(step.error_detail.is_none(), "build failed: {:?}", step.error_detail);
    }
    docker.inspect_image(tag).await.expect("built").id.expect("id")
}

/// `pyberth layers list` shows what each layer adds to the sandbox image, not the whole image
/// every layer shares (~170 MB each, so a list of small packages read as gigabytes), and
/// never an untagged row: an image whose tag a later build of the same set took is counted on
/// stderr, where prune is named, not listed as a layer.
#[tokio::test(flavor = "multi_thread")]
async fn layers_list_shows_each_layers_own_size_and_no_untagged_rows() {
    let pyberth = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
            .args(args)
            .env("PYBERTH_STATE_DIR", state_dir())
            .output()
            .expect("pyberth")
    };
    let built = pyberth(&["image", "build"]);
    assert!(built.status.success(), "{}", String::from_utf8_lossy(&built.stderr));
    let base = String::from_utf8_lossy(&pyberth(&["image", "tag"]).stdout).trim().to_owned();
    let set = format!("pyberth-list-test-{}", std::process::id());
    let _layers = OwnLayers::new(&[&set]);
    let tag = format!("pyberth-layer:list-test-{}", std::process::id());
    // Two builds of one tag: the first is left untagged.
    let lost = stand_in_layer(&base, &tag, &set, 300_000, b'a').await;
    let kept = stand_in_layer(&base, &tag, &set, 200_000, b'b').await;
    assert_ne!(lost, kept);

    let out = pyberth(&["layers", "list"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<Vec<&str>> = stdout.lines().map(|l| l.split('\t').collect()).collect();
    for row in &rows {
        assert_eq!(row.len(), 3, "tag, own size, requirements: {row:?}");
        assert!(row[0].starts_with("pyberth-layer:"), "a row without a tag: {row:?}");
    }
    assert!(!stdout.contains("<none>") && !stdout.contains(&lost), "the untagged image is not listed: {stdout}");
    assert!(stderr.contains("untagged layer image") && stderr.contains("prune"), "{stderr}");
    let ours: Vec<&Vec<&str>> = rows.iter().filter(|r| r[2] == set).collect();
    assert_eq!(ours.len(), 1, "{stdout}");
    assert_eq!(ours[0][0], tag);

    // Its own size: the image's size less its base's, as `docker images` would print it.
    let size = |image: String| async move { docker().await.inspect_image(&image).await.expect("inspect").size };
    let own = size(tag.clone()).await.expect("size") - size(base.clone()).await.expect("size");
    assert!((200_000..260_000).contains(&own), "the stand-in adds its one file: {own} bytes");
    let (value, unit) = ours[0][1].split_once(' ').expect("a size and its unit");
    assert_eq!(unit, "kB", "{}", ours[0][1]);
    let (whole, tenth) = value.split_once('.').expect("one decimal");
    let shown: i64 = whole.parse::<i64>().expect("kB") * 1000 + tenth.parse::<i64>().expect("tenths") * 100;
    assert!(shown <= own && own < shown + 100, "shown {} for {own} bytes", ours[0][1]);
}
