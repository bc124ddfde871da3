//! Dependency layers: installs, cache hits, live installs, failures, the store's boundary, and
//! `pyberth layers`. A test that needs a cold set, counts installers or prunes uses a layer
//! store of its own (`PrivateStore`), so no other test, here or in another checkout on the
//! same engine, can have built its sets or lose them to its prune.

use std::collections::HashMap;

use bollard::query_parameters::EventsOptionsBuilder;
use futures::StreamExt;
use serde_json::json;

use crate::common::{PrivateStore, Server, containers_of, docker, state_dir, text};

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

/// The container a session runs in, as its code sees it (the hostname is the id's start).
async fn session_container(s: &Server, session: &str) -> bollard::models::ContainerInspectResponse {
    let host = s.ok(session, "import socket\nsocket.gethostname()").await["result"].as_str().expect("host").to_owned();
    docker().await.inspect_container(host.trim_matches('\''), None).await.expect("the session's container")
}

fn no_network_code() -> &'static str {
    "sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:])"
}

#[tokio::test(flavor = "multi_thread")]
async fn a_package_installs_once_and_later_sessions_reuse_the_layer() {
    let store = PrivateStore::new("six");
    // A warm pool of one: a session asking for a cached set is one of its containers.
    let s = Server::start("deps-six", &[store.env(), ("PYBERTH_POOL_SIZE", "1")]).await;
    let installers = Installers::watch(&s.instance).await;
    let r = s.call("install_packages", json!({ "packages": ["six"], "session": "first" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert!(installers.seen().await >= 1, "a cold set runs the installer");
    let sc = s.ok("first", "import six\nsix.__name__").await;
    assert_eq!(sc["result"], "'six'");
    assert_eq!(s.ok("first", no_network_code()).await["result"], "['lo']", "still offline after an install");

    // A second session asking for the same set: no installer runs, and its container is one
    // the pool had made before (the pool refilled after "first" took one).
    let before = installers.seen().await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let (r, sc) = s.run_with(json!({ "session": "second", "code": "import six\nsix.PY3", "packages": ["Six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "True");
    assert_eq!(installers.seen().await, before, "cache hit: no installer");
    let container = session_container(&s, "second").await;
    let label = container.config.and_then(|c| c.labels).and_then(|l| l.get("pyberth.session").cloned());
    assert!(label.as_deref().is_some_and(|l| l.starts_with("pool-")), "from the pool: {label:?}");
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
    let s = Server::start("deps-live", &[]).await;
    s.ok("live", "kept = 41").await;
    let r = s.call("install_packages", json!({ "packages": ["attrs"], "session": "live" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = s.ok("live", "import attrs\n(kept + 1, attrs.__name__)").await;
    assert_eq!(sc["result"], "(42, 'attrs')");
    // Child interpreters see the same packages.
    let code = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import attrs'], capture_output=True).returncode";
    assert_eq!(s.ok("live", code).await["result"], "0", "a subprocess imports it too");
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
    let store = PrivateStore::new("restart");
    let s = Server::start("deps-restart-1", &[store.env()]).await;
    let (r, _) = s.run_with(json!({ "session": "c", "code": "1", "packages": ["markupsafe"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    s.stop().await;
    let s = Server::start("deps-restart-2", &[store.env()]).await;
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
    let store = PrivateStore::new("desktop");
    let s = Server::start_like_a_desktop_client("deps-minimal-env", &[store.env()]).await;
    let r = s.call("get_environment", json!({})).await;
    let sc = r.structured_content.clone().expect("structured");
    let bundle = sc["ca_bundle"].as_str().unwrap_or_default().to_owned();
    assert!(!bundle.is_empty() && std::path::Path::new(&bundle).is_file(), "a system bundle is used: {sc}");
    assert!(text(&r).contains(&bundle), "and said: {}", text(&r));
    // A store of its own: the install really reaches the index.
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

/// Two sessions asking for one cold set at once: one installer, both import it.
#[tokio::test(flavor = "multi_thread")]
async fn concurrent_identical_installs_build_once() {
    let store = PrivateStore::new("concurrent");
    let s = Server::start("deps-concurrent", &[store.env()]).await;
    let installers = Installers::watch(&s.instance).await;
    let ask = |name: &'static str| {
        s.run_with(json!({ "session": name, "code": "import tomli\ntomli.__name__", "packages": ["tomli"] }))
    };
    let ((a, sa), (b, sb)) = tokio::join!(ask("a"), ask("b"));
    assert_eq!(a.is_error, Some(false), "{}", text(&a));
    assert_eq!(b.is_error, Some(false), "{}", text(&b));
    assert_eq!((sa["result"].as_str(), sb["result"].as_str()), (Some("'tomli'"), Some("'tomli'")));
    assert_eq!(installers.seen().await, 1, "one install for both");
    s.stop().await;
}

/// The store's boundary, from inside: a session cannot list which sets exist, guess one, find
/// names in its mount table, nor write into the store; the set it asked for it reads.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_cannot_list_guess_or_write_the_layer_store() {
    let store = PrivateStore::new("attack");
    let s = Server::start("deps-attack", &[store.env()]).await;
    // Another caller's set: "victim" asks for tomli; its directory name is what an attacker wants.
    let (r, _) = s.run_with(json!({ "session": "victim", "code": "import tomli", "packages": ["tomli"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let dir = s.ok("victim", "import tomli, os\nos.path.dirname(os.path.dirname(tomli.__file__))").await["result"]
        .as_str()
        .expect("path")
        .trim_matches('\'')
        .to_owned();
    assert!(dir.starts_with("/opt/pyberth/layers/") && dir.ends_with("/site"), "{dir}");
    let name = dir.trim_start_matches("/opt/pyberth/layers/").trim_end_matches("/site").to_owned();
    assert_eq!(name.len(), 32, "{name}");

    let attack = r#"
import os, glob, itertools
out = {}
try:
    out["list"] = os.listdir("/opt/pyberth/layers")
except OSError as e:
    out["list"] = type(e).__name__
out["glob"] = glob.glob("/opt/pyberth/layers/*")
# Names an attacker could try: short hex, keys-like strings, the usual suspects.
tries = ["0" * 32, "six", "tomli", "site", ".tmp-", "meta.json"] + ["%02x" % i for i in range(256)]
out["guessed"] = [t for t in tries if os.path.exists("/opt/pyberth/layers/" + t)]
out["mountinfo"] = open("/proc/self/mountinfo").read()
try:
    open("/opt/pyberth/layers/planted", "w").write("x")
    out["write"] = "written"
except OSError as e:
    out["write"] = type(e).__name__
try:
    os.mkdir("/opt/pyberth/layers/planted")
    out["mkdir"] = "made"
except OSError as e:
    out["mkdir"] = type(e).__name__
out
"#;
    let sc = s.ok("attacker", attack).await;
    let result = sc["result"].as_str().expect("result").to_owned();
    assert!(result.contains("'list': 'PermissionError'"), "the store's root cannot be listed: {result}");
    assert!(result.contains("'glob': []"), "{result}");
    assert!(result.contains("'guessed': []"), "{result}");
    assert!(!result.contains(&name), "the set's name appears nowhere: {result}");
    assert!(result.contains("'write': 'PermissionError'") || result.contains("'write': 'OSError'"), "{result}");
    assert!(!result.contains("'mkdir': 'made'"), "{result}");
    // The mount is read-only even for a writable name.
    let sc = s.ok("attacker", &format!("import os\nos.access('{dir}', os.W_OK)")).await;
    assert_eq!(sc["result"], "False");
    // The metadata of a set is root's alone, even for the session that asked for it.
    let sc =
        s.ok("victim", &format!("import os\nos.access('{}/meta.json', os.R_OK)", dir.trim_end_matches("/site"))).await;
    assert_eq!(sc["result"], "False");
    s.stop().await;
}

/// `pyberth layers list` and `prune` on a store: prune removes least recently used sets no
/// session holds, keeps the one a live session uses, and a server's --layer-cache-mb prunes
/// by itself after an install. A store of its own: nothing else on the engine is pruned.
#[tokio::test(flavor = "multi_thread")]
async fn layers_list_and_prune_work_on_the_store_and_spare_sets_in_use() {
    let store = PrivateStore::new("prune");
    let pyberth = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
            .args(args)
            .env("PYBERTH_STATE_DIR", state_dir())
            .env(store.env().0, store.env().1)
            .output()
            .expect("pyberth")
    };
    let s = Server::start("deps-prune", &[store.env()]).await;
    for (session, package) in [("gone", "tomli"), ("kept", "iniconfig")] {
        let (r, _) = s.run_with(json!({ "session": session, "code": "1", "packages": [package] })).await;
        assert_eq!(r.is_error, Some(false), "{}", text(&r));
    }
    let r = s.call("close_session", json!({ "session": "gone" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));

    let out = pyberth(&["layers", "list"]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Vec<&str>> = stdout.lines().map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows.iter().all(|r| r.len() == 3 && r[0].len() == 20 && r[1].ends_with("kB")), "{stdout}");

    let out = pyberth(&["layers", "prune"]);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("(tomli)") && !stderr.contains("(iniconfig)"), "the set in use stays: {stderr}");
    let listed = String::from_utf8_lossy(&pyberth(&["layers", "list"]).stdout).into_owned();
    assert!(listed.contains("iniconfig") && !listed.contains("tomli"), "{listed}");
    // The session still imports its set.
    assert_eq!(s.ok("kept", "import iniconfig\niniconfig.__name__").await["result"], "'iniconfig'");
    s.stop().await;

    // A server that keeps no cache (0) prunes what no session uses after its next install.
    let s = Server::start("deps-prune-2", &[store.env(), ("PYBERTH_LAYER_CACHE_MB", "0")]).await;
    let (r, _) = s.run_with(json!({ "session": "x", "code": "1", "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let listed = String::from_utf8_lossy(&pyberth(&["layers", "list"]).stdout).into_owned();
    assert!(listed.contains("six") && !listed.contains("iniconfig"), "{listed}");
    s.stop().await;
}

/// An sdist whose build writes straight into the install target: a symlink out of the tree,
/// a setuid executable, a fifo (a device node needs CAP_MKNOD, which the installer lacks; the
/// re-packer drops devices as fifos, `tree.rs` unit tests). The stored set has none of them.
const HOSTILE_SETUP: &str = r##"
import os
from setuptools import setup
# The build runs in the installer, which can write the install target: plant what a hostile
# tree could hold (pip --target leaves files already there alone).
site = "/workspace/site"
os.makedirs(site, exist_ok=True)
for name, make in [
    ("evil_link", lambda p: os.symlink("/etc/passwd", p)),
    ("evil_rel", lambda p: os.symlink("../../../../etc", p)),
    ("evil_fifo", os.mkfifo),
]:
    try:
        make(os.path.join(site, name))
    except OSError:
        pass
p = os.path.join(site, "evil_suid")
try:
    with open(p, "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(p, 0o6777)
except OSError:
    pass
# Build code runs with the installer's network: it must reach nothing but the proxy, neither
# the index directly (bypassing the proxy) nor the host through the bridge's gateway.
import errno, socket, urllib.parse
def probe(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, "timeout") if e.errno else "timeout"
index = urllib.parse.urlsplit(os.environ.get("PIP_INDEX_URL", "https://127.0.0.1:9/"))
net = {"index": probe(index.hostname, index.port or 443), "host": probe("172.17.0.1", 1)}
with open(os.path.join(site, "planted_marker.py"), "w") as f:
    f.write("PLANTED = True\nNET = %r\n" % (net,))
setup(name="pyberth-hostile", version="1.0", py_modules=["pyberth_hostile"])
"##;

/// A package index of the test's own: a container on the default network serving one sdist
/// over HTTPS (pip ignores plain HTTP hosts) with a certificate made here and added to the CA
/// bundle the server is given; everything else (setuptools for the build) comes from the real
/// index as an extra index.
struct LocalIndex {
    id: String,
    url: String,
    bundle: std::path::PathBuf,
}

const SERVE_PY: &str = r#"import functools, http.server, os, ssl, time
while not os.path.exists("/tmp/idx/ready"):
    time.sleep(0.05)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/tmp/idx/cert.pem", "/tmp/idx/key.pem")
h = functools.partial(http.server.SimpleHTTPRequestHandler, directory="/tmp/idx")
s = http.server.ThreadingHTTPServer(("0.0.0.0", 8443), h)
s.socket = ctx.wrap_socket(s.socket, server_side=True)
s.serve_forever()
"#;

impl LocalIndex {
    async fn start(instance: &str) -> LocalIndex {
        use bollard::models::ContainerCreateBody;
        use bollard::query_parameters::{CreateContainerOptionsBuilder, UploadToContainerOptionsBuilder};
        let mut sdist = tar::Builder::new(Vec::new());
        for (name, body) in [
            ("pyberth_hostile-1.0/setup.py", HOSTILE_SETUP.as_bytes()),
            ("pyberth_hostile-1.0/pyberth_hostile.py", b"VALUE = 42\n".as_slice()),
            (
                "pyberth_hostile-1.0/PKG-INFO",
                b"Metadata-Version: 1.0\nName: pyberth-hostile\nVersion: 1.0\n".as_slice(),
            ),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(body.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            sdist.append_data(&mut h, name, body).expect("sdist");
        }
        let mut gz = flate2_free_gzip(&sdist.into_inner().expect("sdist"));
        let page = "<html><body><a href=\"../../files/pyberth_hostile-1.0.tar.gz\">pyberth_hostile-1.0.tar.gz</a></body></html>";
        let mut site = tar::Builder::new(Vec::new());
        for (name, body) in [
            ("idx/simple/pyberth-hostile/index.html", page.as_bytes().to_vec()),
            ("idx/files/pyberth_hostile-1.0.tar.gz", std::mem::take(&mut gz)),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(body.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            site.append_data(&mut h, name, &body[..]).expect("index");
        }
        let docker = docker().await;
        let image = pyberth::docker::image::tag_for(&crate::common::server_settings());
        let labels = HashMap::from([
            ("pyberth.managed".to_owned(), "1".to_owned()),
            ("pyberth.instance".to_owned(), instance.to_owned()),
            ("pyberth.host".to_owned(), "test".to_owned()),
        ]);
        let body = ContainerCreateBody {
            image: Some(image),
            cmd: Some(["python3", "-c", SERVE_PY].map(str::to_owned).to_vec()),
            labels: Some(labels),
            ..Default::default()
        };
        let name = format!("{instance}-index");
        let opts = CreateContainerOptionsBuilder::default().name(&name).build();
        let id = docker.create_container(Some(opts), body).await.expect("index container").id;
        let opts = UploadToContainerOptionsBuilder::default().path("/tmp").build();
        docker
            .upload_to_container(&id, Some(opts), bollard::body_full(site.into_inner().expect("tar").into()))
            .await
            .expect("upload");
        docker.start_container(&id, None).await.expect("start");
        let ip = docker
            .inspect_container(&id, None)
            .await
            .expect("inspect")
            .network_settings
            .and_then(|n| n.networks)
            .and_then(|n| n.get("bridge").and_then(|b| b.ip_address.clone()))
            .filter(|ip| !ip.is_empty())
            .expect("an address on the default network");
        // A certificate for that address, then the go-ahead.
        let dir = std::env::temp_dir().join(format!("{instance}-tls"));
        std::fs::create_dir_all(&dir).expect("tls dir");
        let made = std::process::Command::new("openssl")
            .args(["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=pyberth-test-index"])
            .arg("-addext")
            .arg(format!("subjectAltName=IP:{ip}"))
            .arg("-keyout")
            .arg(dir.join("key.pem"))
            .arg("-out")
            .arg(dir.join("cert.pem"))
            .output()
            .expect("openssl");
        assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
        let cert = std::fs::read(dir.join("cert.pem")).expect("cert");
        let mut tls = tar::Builder::new(Vec::new());
        for (name, body) in [
            ("idx/cert.pem", cert.clone()),
            ("idx/key.pem", std::fs::read(dir.join("key.pem")).expect("key")),
            ("idx/ready", Vec::new()),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(body.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            tls.append_data(&mut h, name, &body[..]).expect("tls");
        }
        let opts = UploadToContainerOptionsBuilder::default().path("/tmp").build();
        docker
            .upload_to_container(&id, Some(opts), bollard::body_full(tls.into_inner().expect("tar").into()))
            .await
            .expect("upload");
        let mut bundle = std::fs::read("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
        bundle.extend_from_slice(&cert);
        let bundle_path = dir.join("bundle.pem");
        std::fs::write(&bundle_path, bundle).expect("bundle");
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        LocalIndex { id, url: format!("https://{ip}:8443/simple"), bundle: bundle_path }
    }

    async fn stop(self) {
        if let Some(dir) = self.bundle.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
        let opts = bollard::query_parameters::RemoveContainerOptionsBuilder::default().force(true).build();
        let _ = docker().await.remove_container(&self.id, Some(opts)).await;
    }
}

/// A gzip stream with stored (uncompressed) deflate blocks: pip reads `.tar.gz` only, and the
/// crate has no compressor; a stored block needs none.
fn flate2_free_gzip(data: &[u8]) -> Vec<u8> {
    let mut out = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
    let chunks: Vec<&[u8]> = if data.is_empty() { vec![&[][..]] } else { data.chunks(65535).collect() };
    for (i, chunk) in chunks.iter().enumerate() {
        out.push(u8::from(i + 1 == chunks.len()));
        let len = u16::try_from(chunk.len()).expect("chunk");
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&(!len).to_le_bytes());
        out.extend_from_slice(chunk);
    }
    out.extend_from_slice(&crc32(data).to_le_bytes());
    out.extend_from_slice(&u32::try_from(data.len()).expect("size").to_le_bytes());
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in data {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_package_tree_is_stored_sanitized() {
    let store = PrivateStore::new("hostile");
    let instance = crate::common::instance_name("deps-hostile");
    let index = LocalIndex::start(&instance).await;
    let bundle = index.bundle.to_string_lossy().into_owned();
    let env = [
        store.env(),
        ("PYBERTH_INDEX_URL", index.url.as_str()),
        ("PYBERTH_EXTRA_INDEX_URL", "https://pypi.org/simple"),
        ("PYBERTH_CA_BUNDLE", bundle.as_str()),
        // The test's self-signed certificate is its own CA, which pip accepts and uv's webpki
        // refuses (CaUsedAsEndEntity): the subject here is the tree, not TLS.
        ("PYBERTH_INSTALLER_UV", "none"),
        // It is an sdist: its build code plants the hostile tree.
        ("PYBERTH_ALLOW_SDIST", "pyberth-hostile"),
    ];
    let s = Server::start_as(&instance, &env).await;
    let (r, sc) = s.run_with(json!({ "session": "h", "code": "import pyberth_hostile\npyberth_hostile.VALUE", "packages": ["pyberth-hostile"] })).await;
    let message = text(&r);
    index.stop().await;
    assert_eq!(r.is_error, Some(false), "{message}");
    assert_eq!(sc["result"], "42");
    let check = r#"
import os, pyberth_hostile
site = os.path.dirname(pyberth_hostile.__file__)
out = {n: os.path.lexists(os.path.join(site, n)) for n in ("evil_link", "evil_rel", "evil_fifo")}
p = os.path.join(site, "evil_suid")
out["suid_mode"] = oct(os.stat(p).st_mode & 0o7777) if os.path.exists(p) else None
out["owner"] = os.stat(pyberth_hostile.__file__).st_uid
import planted_marker
out["planted"] = planted_marker.PLANTED
out["net"] = planted_marker.NET
out
"#;
    let result = s.ok("h", check).await["result"].as_str().expect("result").to_owned();
    // The build did plant its files (a regular one is kept), and what is hostile is gone.
    let want = ["'planted': True", "'evil_link': False", "'evil_rel': False", "'evil_fifo': False", "'owner': 0"];
    for w in want {
        assert!(result.contains(w), "{w}: {result}");
    }
    assert!(result.contains("'suid_mode': '0o755'"), "setuid and setgid stripped, not writable: {result}");
    // The build's own network: no way round the proxy to the index, no route to the host
    // (ECONNREFUSED from the gateway would mean the host answered).
    assert!(!result.contains("'index': 'connected'"), "the build reached the index past the proxy: {result}");
    assert!(
        !result.contains("'host': 'connected'") && !result.contains("'host': 'ECONNREFUSED'"),
        "the build reached the host: {result}"
    );
    assert!(result.contains("'net': {"), "the build probed its network: {result}");
    s.stop().await;
}
