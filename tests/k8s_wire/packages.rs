//! Package installs on the Kubernetes engine: the installer a pod of its own whose only way out
//! is the egress proxy pod (allowing the index hosts), the installed set stored by a writer pod
//! into the layer store's claim, and sessions mounting the claim's `sets/` read-only. The
//! simulator's claim is a folder of this test's; its NetworkPolicies a Docker `internal`
//! network (as in `egress.rs`).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::{Arc, Mutex};

use serde_json::json;

use super::apiserver::{OnDelete, Options, Sim};
use super::docker;
use super::serve::{Served, node_containers, pods, text};

/// Label on the network this test makes.
const LABEL_TEST: &str = "pyberth-test.k8s-packages";

fn docker_cli(args: &[&str]) -> String {
    let out = std::process::Command::new("docker").args(args).output().expect("docker");
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The test's egress network and claim folder, removed when dropped.
struct World {
    network: String,
    claim: std::path::PathBuf,
}

impl World {
    /// Its network (on a subnet of its own) and its claim folder (root's, 0755) made; with the
    /// address of the proxy's Service on the network.
    fn make(tag: &str) -> (World, String) {
        let pid = std::process::id();
        let world = World {
            network: format!("pyberth-test-k8s-{tag}-{pid}"),
            claim: std::env::temp_dir().join(format!("pyberth-k8s-{tag}-claim-{pid}")),
        };
        let service_ip = super::egress::egress_network(&world.network, LABEL_TEST);
        std::fs::create_dir_all(&world.claim).expect("claim folder");
        std::fs::set_permissions(&world.claim, std::fs::Permissions::from_mode(0o755)).expect("mode");
        (world, service_ip)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker").args(["network", "rm", &self.network]).output();
        let _ = std::fs::remove_dir_all(&self.claim);
    }
}

/// What the proxy at `proxy` answers a CONNECT to the index from the address Docker frees
/// first on `network` (a deleted pod's): the intruder's address, then the proxy's status line.
fn intruder(network: &str, proxy: &str) -> (String, String) {
    let code = format!(
        "import socket\nprint(socket.gethostbyname(socket.gethostname()))\n\
         s = socket.create_connection(({proxy:?}, 3128), timeout=10)\n\
         s.sendall(b'CONNECT pypi.org:443 HTTP/1.1\\r\\nHost: pypi.org:443\\r\\n\\r\\n')\n\
         print(s.recv(200).split(b'\\r\\n')[0].decode())"
    );
    let image = pyberth::docker::image::sandbox_tag();
    let run = ["run", "--rm", "--network", network, "--label", LABEL_TEST, "--cap-drop", "ALL", "--user", "65534"];
    let out = docker_cli(&[&run[..], &[image.as_str(), "python3", "-c", &code][..]].concat());
    let (ip, status) = out.split_once('\n').unwrap_or((&out, ""));
    (ip.trim().to_owned(), status.trim().to_owned())
}

async fn run(s: &Served, session: &str, code: &str) -> String {
    let sc = s.ok("run_python", json!({ "session": session, "code": code })).await;
    format!("{}{}", sc["stdout"].as_str().unwrap_or_default(), sc["stderr"].as_str().unwrap_or_default())
}

/// A first install runs an installer pod through the proxy and stores the set on the claim;
/// the session imports it at once; a second session gets it from the store without an
/// installer. A session cannot list the store, nor write to it. Attack view: the installer's
/// address leaves the proxy before its pod is deleted, so the next pod given that address
/// (the test's container, on the deletion) reaches nothing through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn installs_run_in_a_pod_through_the_proxy_into_the_claims_store() {
    let tag = std::process::id();
    let (world, service_ip) = World::make("packages");
    let armed: Arc<Mutex<Option<String>>> = Arc::default();
    let seen: Arc<Mutex<Vec<(String, String, String)>>> = Arc::default();
    let deleted: Arc<Mutex<Vec<String>>> = Arc::default();
    let hook = {
        let (armed, seen, network) = (armed.clone(), seen.clone(), world.network.clone());
        let deleted = deleted.clone();
        OnDelete(Arc::new(move |name: &str, ip: Option<&str>| {
            deleted.lock().expect("deleted").push(name.to_owned());
            let proxy = armed.lock().expect("armed").clone();
            if let (Some(proxy), Some(ip), true) = (proxy, ip, name.contains("-install-")) {
                let (got, status) = intruder(&network, &proxy);
                seen.lock().expect("seen").push((ip.to_owned(), got, status));
            }
        }))
    };
    let opts = Options {
        egress_network: Some(world.network.clone()),
        service_ips: vec![service_ip],
        proxy_exe: Some(env!("CARGO_BIN_EXE_pyberth").into()),
        claims: [("pyberth-layers".to_owned(), world.claim.clone())].into(),
        // The volume applies fsGroup: the server makes `sets/` itself.
        fs_group: true,
        on_delete: Some(hook),
        ..Default::default()
    };
    let sim = Sim::start(opts, docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-packages-{tag}"));
    let extra = format!(
        "pool_size = 0\nk8s_layer_claim = \"pyberth-layers\"\nk8s_egress_image = {:?}\n",
        pyberth::docker::image::sandbox_tag()
    );
    let s = Served::start_tables(&sim, &dir, "packages", &extra, "").await;
    assert_eq!(run(&s, "a", "x = 41\nprint(x)").await.trim(), "41");
    // The proxy pod is made by the first install; the hook needs its address once it is there.
    let watcher = {
        let (armed, state) = (armed.clone(), sim.state.clone());
        tokio::spawn(async move {
            for _ in 0..600 {
                let found = {
                    let pods = state.pods.lock().expect("pods");
                    pods.iter()
                        .find(|(n, _)| n.contains("-egress-"))
                        .and_then(|(_, p)| p.pod.status.as_ref()?.pod_ip.clone())
                };
                if let Some(ip) = found {
                    *armed.lock().expect("armed") = Some(ip);
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        })
    };
    let r = s.call("install_packages", json!({ "session": "a", "packages": ["six"] })).await;
    watcher.abort();
    assert_eq!(r.is_error, Some(false), "{}\n{}", text(&r), s.log());
    let sc = r.structured_content.clone().unwrap_or_default();
    assert_eq!(sc["cached"], json!(false), "a first install: {sc}");
    let got = run(&s, "a", "import six\nprint(x + 1, six.__file__.startswith('/opt/pyberth/layers/'))").await;
    assert_eq!(got.trim(), "42 True", "installed and importable, state kept: {got}\n{}", s.log());

    // A second set: the installer network kept from the first install is bound to the new
    // installer pod's address (and unbound again before it goes).
    let r = s.call("install_packages", json!({ "session": "a", "packages": ["idna"] })).await;
    assert_eq!(r.is_error, Some(false), "{}\n{}", text(&r), s.log());
    let got = run(&s, "a", "import idna\nprint(idna.encode('b\\u00fccher.de'))").await;
    assert_eq!(got.trim(), "b'xn--bcher-kva.de'", "{got}");

    // The installers' addresses left the proxy before their pods: the next pod given one gets a 403.
    *armed.lock().expect("armed") = None;
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen.len(), 2, "two installer pods deleted with an address: {seen:?}");
    for (was, got, status) in seen {
        assert_eq!(got, was, "the intruder got another address than the installer's");
        assert!(status.starts_with("HTTP/1.1 40"), "the installer's policy outlived its pod: {status}");
    }

    // The store, from inside: neither listable nor writable; on the claim, `sets/` is the
    // store uid's, 0711, with one set.
    let probe = "import os\nfor f in (lambda: os.listdir('/opt/pyberth/layers'), \
                 lambda: open(os.path.dirname(os.path.dirname(six.__file__)) + '/x', 'w')):\n    \
                 try:\n        f(); print('yes')\n    except OSError as e:\n        print(type(e).__name__)";
    let got = run(&s, "a", &format!("import six\n{probe}")).await;
    let said: Vec<&str> = got.split_whitespace().collect();
    assert!(said.len() == 2 && said[0] == "PermissionError" && said[1].ends_with("Error"), "{got}");
    let sets = world.claim.join("sets");
    let meta = std::fs::metadata(&sets).expect("sets/ on the claim");
    assert_eq!((meta.uid(), meta.permissions().mode() & 0o777), (pyberth::k8s::pod::STORE_UID, 0o711));
    let stored: Vec<_> = std::fs::read_dir(&sets).expect("read sets").flatten().collect();
    assert_eq!(stored.len(), 2, "two sets: {stored:?}");

    // A second session: from the store, no installer (its pod would have been deleted by now).
    let installers =
        |d: &Arc<Mutex<Vec<String>>>| d.lock().expect("deleted").iter().filter(|n| n.contains("-install-")).count();
    let before = installers(&deleted);
    assert!(before >= 1, "the first install ran an installer pod: {:?}", deleted.lock().expect("deleted"));
    let r = s.call("install_packages", json!({ "session": "b", "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.clone().unwrap_or_default();
    assert_eq!(sc["cached"], json!(true), "a new session's set from the store says so: {sc}");
    assert_eq!(run(&s, "b", "import six\nprint(six.PY3)").await.trim(), "True");
    assert_eq!(installers(&deleted), before, "no installer for a stored set");
    assert!(!pods(&sim).iter().any(|p| p.contains("-install-") || p.contains("-store-")), "{:?}", pods(&sim));

    s.stop().await;
    assert!(pods(&sim).is_empty(), "pods left: {:?}", pods(&sim));
    assert_eq!(node_containers(&sim).await, 0, "containers left on the node");
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}

/// A claim whose volume applies no fsGroup (most ReadWriteMany drivers) and whose root the
/// store uid cannot write: the set-up fails once, the server says so, sessions run without the
/// store and an install says what to do. The operator does it (`sets/`, the store uid's,
/// 0711); the next server installs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_the_store_cannot_use_is_said_and_sessions_run_without_it() {
    let tag = std::process::id();
    let (world, service_ip) = World::make("nofsg");
    let opts = Options {
        egress_network: Some(world.network.clone()),
        service_ips: vec![service_ip],
        proxy_exe: Some(env!("CARGO_BIN_EXE_pyberth").into()),
        claims: [("pyberth-layers".to_owned(), world.claim.clone())].into(),
        ..Default::default()
    };
    let sim = Sim::start(opts, docker()).await;
    let dir = std::env::temp_dir().join(format!("pyberth-k8s-nofsg-{tag}"));
    let extra = format!(
        "pool_size = 0\nk8s_layer_claim = \"pyberth-layers\"\nk8s_egress_image = {:?}\n",
        pyberth::docker::image::sandbox_tag()
    );
    let s = Served::start_tables(&sim, &dir, "nofsg", &extra, "").await;
    let got = run(&s, "a", "import os\nx = 1\nprint(os.path.ismount('/opt/pyberth/layers'))").await;
    assert_eq!(got.trim(), "False", "the session runs, without the store: {got}\n{}", s.log());
    let r = s.call("install_packages", json!({ "session": "a", "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    let said = text(&r);
    assert!(said.contains("unusable") && said.contains("owned by uid 65533, mode 0711"), "{said}");
    assert_eq!(run(&s, "a", "print(x)").await.trim(), "1", "the session and its state survive");
    assert!(!world.claim.join("sets").exists(), "nothing made on a claim the store uid cannot write");
    s.stop().await;

    // The operator's remedy, then a new server: installs work.
    let sets = world.claim.join("sets");
    std::fs::create_dir(&sets).expect("sets/");
    let store_uid = pyberth::k8s::pod::STORE_UID;
    std::os::unix::fs::chown(&sets, Some(store_uid), Some(store_uid)).expect("chown");
    std::fs::set_permissions(&sets, std::fs::Permissions::from_mode(0o711)).expect("mode");
    let s = Served::start_tables(&sim, &dir, "nofsg2", &extra, "").await;
    let r = s.call("install_packages", json!({ "session": "b", "packages": ["six"] })).await;
    assert_eq!(r.is_error, Some(false), "{}\n{}", text(&r), s.log());
    assert_eq!(run(&s, "b", "import six\nprint(six.PY3)").await.trim(), "True");
    s.stop().await;
    assert!(pods(&sim).is_empty(), "pods left: {:?}", pods(&sim));
    let _ = std::fs::remove_dir_all(&dir);
    sim.stop().await;
}
