//! The installer: uv fetched from the index and used, pip when uv cannot be had, the download
//! cache shared between sets, wheels only by default with a named opt-in for sdists, clear
//! errors naming the requirement, and the ready `datascience` environment. Each test that
//! must see an install run gives its server a layer store of its own (`PrivateStore`); its
//! evidence is the installer's own output, which the server logs line by line.

use serde_json::json;

use crate::common::{PrivateStore, Server, docker, text};

/// The installer's lines in a server log, from the first that contains `from` on.
fn install_lines(log: &str, from: &str) -> Vec<String> {
    let lines: Vec<String> =
        log.lines().filter(|l| l.contains("pyberth::install")).map(|l| l.trim_end().to_owned()).collect();
    let start = lines.iter().position(|l| l.contains(from)).unwrap_or(lines.len());
    lines[start..].to_vec()
}

/// The count uv gives on its line `word N package(s)`, 0 when it has none.
fn uv_count(lines: &[String], word: &str) -> usize {
    lines
        .iter()
        .find_map(|l| {
            let at = l.find(&format!("{word} "))? + word.len() + 1;
            l[at..].split_whitespace().next()?.parse().ok()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn uv_installs_and_a_second_set_takes_the_shared_wheel_from_the_download_cache() {
    let (one, two) = ("tomli-w==1.0.0", ["pluggy==1.5.0", "tomli-w==1.0.0"]);
    let store = PrivateStore::new("inst-uv-cache");
    let s = Server::start("inst-uv-cache", &[store.env()]).await;
    let r = s.call("install_packages", json!({ "packages": [one], "session": "a" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(s.ok("a", "import tomli_w\ntomli_w.dumps({'a': 1})").await["result"], "'a = 1\\n'");
    let r = s.call("install_packages", json!({ "packages": two, "session": "b" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(s.ok("b", "import pluggy, tomli_w\npluggy.__name__").await["result"], "'pluggy'");
    let log = s.stop().await;

    let first = install_lines(&log, "installer for tomli-w==1.0.0:");
    assert!(first.iter().any(|l| l.contains("pyberth: installing with uv ")), "uv installs: {first:#?}");
    assert!(!first.iter().any(|l| l.contains("installing with pip")), "{first:#?}");
    // uv counts as prepared only what it had to fetch: tomli-w came from the cache.
    let second = install_lines(&log, "installer for pluggy==1.5.0 tomli-w==1.0.0:");
    assert_eq!(uv_count(&second, "Installed"), 2, "{second:#?}");
    assert!(uv_count(&second, "Prepared") < 2, "tomli-w must come from the download cache: {second:#?}");
}

/// The download cache is bounded: an install that leaves it above `--installer-cache-mb`
/// empties it (here 1 MiB, which Pygments alone passes), and installs go on. The
/// server asks for uv by another requirement, so its volume (and cache) is its own: emptying
/// the suite's shared cache would race the test that proves a cache hit.
#[tokio::test(flavor = "multi_thread")]
async fn the_download_cache_is_emptied_past_its_bound() {
    let set = "pygments==2.18.0";
    let store = PrivateStore::new("inst-cache-bound");
    let env = [("PYBERTH_INSTALLER_CACHE_MB", "1"), ("PYBERTH_INSTALLER_UV", "uv>=0.1"), store.env()];
    let s = Server::start("inst-cache-bound", &env).await;
    let r = s.call("install_packages", json!({ "packages": [set], "session": "c" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(s.ok("c", "import pygments\npygments.__version__").await["result"], "'2.18.0'");
    let log = s.stop().await;
    let lines = install_lines(&log, "installer for pygments==2.18.0:");
    assert!(
        lines.iter().any(|l| l.contains("the download cache holds") && l.contains("over its bound of 1 MiB: emptied")),
        "{lines:#?}"
    );
    remove_tool_volumes("uv>=0.1").await;
}

/// Removes the installer volumes of servers that fetch uv by `requirement` (a test's own).
async fn remove_tool_volumes(requirement: &str) {
    let label = format!("pyberth.installer-uv={requirement}");
    let filters = std::collections::HashMap::from([("label", vec![label.as_str()])]);
    let opts = bollard::query_parameters::ListVolumesOptionsBuilder::default().filters(&filters).build();
    let found = docker().await.list_volumes(Some(opts)).await.expect("volumes").volumes.unwrap_or_default();
    for v in found {
        let _ = docker().await.remove_volume(&v.name, None::<bollard::query_parameters::RemoveVolumeOptions>).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pip_installs_when_uv_cannot_be_had_and_says_why() {
    // A uv requirement the index has no wheel for: the fetch fails, pip takes over. Its tool
    // volume is its own (the requirement is in the key), so no other test sees the failure.
    let set = "pyparsing==3.1.2";
    let store = PrivateStore::new("inst-pip");
    let s = Server::start("inst-pip", &[("PYBERTH_INSTALLER_UV", "uv==0.0.999"), store.env()]).await;
    let r = s.call("install_packages", json!({ "packages": [set], "session": "p" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(s.ok("p", "import pyparsing\npyparsing.__version__").await["result"], "'3.1.2'");
    let log = s.stop().await;
    let lines = install_lines(&log, "installer for pyparsing==3.1.2:");
    let notice = lines.iter().find(|l| l.contains("installing with pip, not uv: ")).unwrap_or_else(|| {
        panic!("a notice names why pip installs: {lines:#?}");
    });
    assert!(notice.contains("uv==0.0.999"), "it names the uv it could not fetch: {notice}");
    // The tool volume of that requirement is this test's alone.
    remove_tool_volumes("uv==0.0.999").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_package_and_an_unsatisfiable_pin_are_clear_errors_naming_them() {
    let s = Server::start("inst-errors", &[]).await;
    let r = s.call("install_packages", json!({ "packages": ["pyberth-no-such-package-xyz"] })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("no such package on the index"), "{}", text(&r));
    assert!(text(&r).contains("pyberth-no-such-package-xyz (check the name)"), "names it: {}", text(&r));
    let r = s.call("install_packages", json!({ "packages": ["idna==999.0"] })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("no version of idna==999.0 on the index"), "{}", text(&r));
    // The session is still there and usable.
    assert_eq!(s.ok("default", "1 + 1").await["result"], "2");
    s.stop().await;
}

/// docopt 0.6.2 ships only an sdist on PyPI (and always will: the project is finished).
#[tokio::test(flavor = "multi_thread")]
async fn an_sdist_only_package_is_refused_by_default_naming_the_opt_in_and_built_when_allowed() {
    let set = "docopt==0.6.2";
    let store = PrivateStore::new("inst-sdist");
    let dir = std::env::temp_dir().join(format!("pyberth-inst-sdist-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("config.toml");
    std::fs::write(&config, "[environments.builds]\nallow_sdist = [\"docopt\"]\n").expect("config");
    let s = Server::start("inst-sdist", &[("PYBERTH_CONFIG", config.to_str().expect("utf-8 path")), store.env()]).await;

    // The default environment: wheels only.
    let r = s.call("install_packages", json!({ "packages": [set], "session": "plain" })).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    let t = text(&r);
    assert!(t.contains("docopt ships no wheel"), "names the package: {t}");
    assert!(t.contains("--allow-sdist docopt") && t.contains("allow_sdist = [\"docopt\"]"), "the opt-in: {t}");

    // An environment that allows it builds it, without the shared cache.
    let (r, sc) = s
        .run_with(json!({ "session": "built", "environment": "builds", "packages": [set],
            "code": "import docopt\ndocopt.__version__" }))
        .await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "'0.6.2'");
    let log = s.stop().await;
    let lines = install_lines(&log, "installer for docopt==0.6.2:");
    assert!(
        lines.iter().any(|l| l.contains("building from source is allowed for docopt")
            && l.contains("without the shared download cache")),
        "{lines:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The ready data-science environment, built on first use (once per machine: its layer is
/// kept, as an operator's would be).
#[tokio::test(flavor = "multi_thread")]
async fn the_datascience_environment_runs_pandas_and_returns_a_figure() {
    let s = Server::start("inst-datascience", &[("PYBERTH_INSTALL_TIMEOUT", "1200")]).await;
    let r = s.call("list_environments", json!({})).await;
    let sc = r.structured_content.clone().expect("structured");
    let ds = sc["environments"].as_array().and_then(|a| a.iter().find(|e| e["name"] == "datascience")).cloned();
    let ds = ds.unwrap_or_else(|| panic!("datascience listed: {sc}"));
    let packages: Vec<&str> = ds["packages"].as_array().expect("packages").iter().filter_map(|p| p.as_str()).collect();
    assert!(packages.iter().any(|p| p.starts_with("pandas==")), "with versions: {packages:?}");
    assert!(text(&r).contains("pandas=="), "{}", text(&r));

    let code = "import pandas, numpy, matplotlib\nimport matplotlib.pyplot as plt\n\
                df = pandas.DataFrame({'x': numpy.arange(5), 'y': numpy.arange(5) ** 2})\n\
                df.plot(x='x', y='y')\nint(df['y'].sum())";
    let (r, sc) =
        s.run_with(json!({ "session": "ds", "environment": "datascience", "code": code, "timeout_s": 300 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "30");
    assert_eq!(sc["images"], 1, "{sc}");
    let images: Vec<_> = r.content.iter().filter_map(|c| c.as_image()).collect();
    assert_eq!(images.len(), 1);
    assert_eq!(images[0].mime_type, "image/png");
    let code = "import scipy, sklearn, pyarrow, openpyxl, tabulate\nsklearn.__version__ != ''";
    assert_eq!(s.ok("ds", code).await["result"], "True");
    s.stop().await;
}

/// The networks of `instance`, by name.
async fn installer_networks(instance: &str) -> Vec<String> {
    let label = format!("pyberth.instance={instance}");
    let filters = std::collections::HashMap::from([("label", vec![label.as_str()])]);
    let opts = bollard::query_parameters::ListNetworksOptionsBuilder::default().filters(&filters).build();
    let nets = docker().await.list_networks(Some(opts)).await.expect("list networks");
    let mut names: Vec<String> = nets.into_iter().filter_map(|n| n.name).collect();
    names.sort();
    names
}

/// Installer networks are kept for the next install (docs/design.md D14), which opens a new
/// surface: two installs must never share one, since build code allowed by `allow_sdist`
/// could then reach another installer under way. Two installs at once get two networks; a
/// released one goes to the next install only, still reaching only the index; a network
/// whose install failed is never kept; shutdown removes what was kept.
#[tokio::test(flavor = "multi_thread")]
async fn an_installer_network_is_kept_for_the_next_install_and_never_shared() {
    use std::sync::Arc;
    let tag = crate::common::instance_name("inst-net-reuse");
    let cfg = crate::common::server_settings();
    let owner = pyberth::docker::container::Owner { instance: tag.clone(), host: "test".into() };
    let index = pyberth::packages::IndexSettings::from_config(&cfg).expect("index settings");
    let ca = cfg.ca_bundle().expect("a CA bundle on this host");
    let (engine, _) = pyberth::docker::connect(None).await.expect("engine");
    let manager = pyberth::egress::Manager::new(engine, owner, Arc::new(cfg.clone()), None)
        .with_executable(env!("CARGO_BIN_EXE_pyberth").into());
    let image = pyberth::docker::image::sandbox_tag();
    let a = manager.attach_installer("a", &image, &index).await.expect("installer network a");
    let b = manager.attach_installer("b", &image, &index).await.expect("installer network b");
    assert_ne!(a.network, b.network, "two installs under way share a network");
    let (a_name, b_name) = (a.network.clone(), b.network.clone());
    manager.release_installer(a).await;
    // The next install takes the released network, and while it holds it, another install
    // gets a network of its own (b is still held too).
    let c = manager.attach_installer("c", &image, &index).await.expect("installer network c");
    assert_eq!(c.network, a_name, "a released network is taken by the next install");
    let d = manager.attach_installer("d", &image, &index).await.expect("installer network d");
    assert!(d.network != a_name && d.network != b_name, "a held network is given again");
    // The kept network leads to the index only, as a new one does.
    let code = r#"
import socket, subprocess, sys, urllib.request
p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d", "/tmp/d",
                    "--cert", "/ca.pem", "six"], capture_output=True, text=True)
print("pip", p.returncode)
try:
    urllib.request.urlopen("http://example.com/", timeout=10)
    print("example reached")
except Exception as e:
    print("example refused", "403" in repr(e))
try:
    socket.create_connection(("172.17.0.1", 22), timeout=3).close()
    print("host connected")
except OSError:
    print("host failed")
"#;
    let mut cmd = std::process::Command::new("docker");
    cmd.args(["run", "--rm", "--network", &c.network, "--cap-drop", "ALL", "--user", "65534:65534"])
        .args(["--label", &format!("pyberth.instance={tag}"), "-v", &format!("{}:/ca.pem:ro", ca.display())])
        .args(["-e", "HOME=/tmp"]);
    for dns in &c.dns {
        cmd.args(["--dns", dns]);
    }
    for e in &c.env {
        cmd.args(["-e", e]);
    }
    let out = cmd.args([image.as_str(), "python3", "-c", code]).output().expect("docker run");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.contains("pip 0"), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("example refused True"), "{stdout}");
    assert!(stdout.contains("host failed"), "{stdout}");
    // What the proxy refused on a kept network is told to the install that caused it, not
    // to the next one.
    assert!(!manager.installer_refused(&c).await.is_empty(), "the refusal of example.com is recorded");
    manager.release_installer(c).await;
    let e = manager.attach_installer("e", &image, &index).await.expect("installer network e");
    assert_eq!(e.network, a_name);
    assert!(manager.installer_refused(&e).await.is_empty(), "a kept network carries the last install's refusals");
    // An install that failed removes its network (detach), never keeps it.
    manager.detach_installer(e).await;
    assert!(!installer_networks(&tag).await.contains(&a_name), "a detached network is removed");
    manager.release_installer(b).await;
    manager.release_installer(d).await;
    assert_eq!(installer_networks(&tag).await.len(), 2, "released networks are kept (at most two)");
    manager.shutdown().await;
    assert!(installer_networks(&tag).await.is_empty(), "shutdown removes the kept networks");
    crate::common::assert_cleaned_up(&tag).await;
}
