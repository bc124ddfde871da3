//! Environments: Python versions side by side, an operator's environment with packages and a
//! read-only folder, and the errors that keep choices honest.

use std::time::Duration;

use serde_json::json;

use crate::common::{Server, docker, server_settings, state_dir, text};

#[tokio::test(flavor = "multi_thread")]
async fn two_python_versions_run_side_by_side() {
    let s = Server::start("pyversions", &[]).await;
    let version = "import sys\n'%d.%d' % sys.version_info[:2]";
    let (r, old) = s.run_with(json!({ "session": "old", "environment": "python3.11", "code": version })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let (r, new) = s.run_with(json!({ "session": "new", "environment": "python3.13", "code": version })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(old["result"], "'3.11'");
    assert_eq!(new["result"], "'3.13'");

    let env = s.call("get_environment", json!({ "session": "new" })).await;
    let sc = env.structured_content.expect("structured");
    assert_eq!(sc["environment"], "python3.13");
    assert!(sc["python"].as_str().is_some_and(|p| p.starts_with("3.13")), "{sc}");
    assert_eq!(sc["network"], "none");
    assert_eq!(sc["limits"]["memory_mb"], 512);
    assert!(sc["packages_installed"].as_u64().is_some(), "{sc}");

    // A session keeps its environment; asking for another says what to do.
    let (r, _) = s.run_with(json!({ "session": "new", "environment": "python3.11", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("keeps its environment") && text(&r).contains("close_session"), "{}", text(&r));
    // Naming the environment it has is fine.
    let (r, _) = s.run_with(json!({ "session": "new", "environment": "python3.13", "code": "1" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    // An unknown name on an existing session says it does not exist, not that sessions keep theirs.
    let (r, _) = s.run_with(json!({ "session": "new", "environment": "cobol", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("cobol") && !text(&r).contains("keeps its environment"), "{}", text(&r));
    let (r, _) = s.run_with(json!({ "session": "other", "environment": "cobol", "code": "1" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("python3.13") && text(&r).contains("list_environments"), "{}", text(&r));
    let listed = s.call("list_sessions", json!({})).await.structured_content.expect("sc");
    assert!(listed["sessions"].as_array().is_some_and(|l| l.iter().all(|x| x["session"] != "other")));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_environment_brings_packages_and_a_read_only_folder() {
    let dir = state_dir().join(format!("env-{}", std::process::id()));
    let data = dir.join("dataset");
    std::fs::create_dir_all(&data).expect("dir");
    std::fs::write(data.join("hello.txt"), "from the host").expect("data");
    let config = dir.join("pyberth.toml");
    std::fs::write(
        &config,
        format!(
            "[environments.science]\ndescription = \"with toml and the dataset\"\npackages = [\"toml\"]\n\
             memory_mb = 640\nmounts = [{{ host = \"{}\", path = \"/data\" }}]\n",
            data.display()
        ),
    )
    .expect("config");
    let config = config.to_string_lossy().into_owned();
    // toml, not six: deps.rs builds that layer, and removes it.
    let s = Server::start("science", &[("PYBERTH_CONFIG", &config)]).await;

    let listed = s.call("list_environments", json!({})).await.structured_content.expect("sc");
    let envs = listed["environments"].as_array().expect("list");
    let science = envs.iter().find(|e| e["name"] == "science").expect("science listed");
    assert_eq!(science["packages"], json!(["toml"]));
    assert_eq!(science["mounts"][0]["path"], "/data");
    assert!(envs.iter().any(|e| e["name"] == "python3.13") && envs.iter().any(|e| e["name"] == "default"));

    let code = "import toml\nprint(toml.__name__)\nopen('/data/hello.txt').read()";
    let (r, sc) = s.run_with(json!({ "session": "lab", "environment": "science", "code": code })).await;
    assert_eq!(r.is_error, Some(false), "no install step needed: {}", text(&r));
    assert_eq!(sc["result"], "'from the host'");
    let (r, _) = s.run_with(json!({ "session": "lab", "code": "open('/data/new.txt', 'w')" })).await;
    assert!(text(&r).contains("Read-only file system"), "{}", text(&r));
    assert!(!data.join("new.txt").exists());
    let env = s.call("get_environment", json!({ "session": "lab" })).await.structured_content.expect("sc");
    assert_eq!(env["limits"]["memory_mb"], 640, "the environment's limit applies");
    assert_eq!(env["mounts"][0]["read_only"], true);
    // Sessions of other environments see no folder and no package.
    let sc = s
        .ok("plain", "import os, importlib.util\n(os.path.exists('/data'), importlib.util.find_spec('toml') is None)")
        .await;
    assert_eq!(sc["result"], "(False, True)");
    s.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mount_that_does_not_exist_stops_the_server_naming_the_entry() {
    let dir = state_dir().join(format!("badenv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let config = dir.join("pyberth.toml");
    std::fs::write(&config, "[environments.broken]\nmounts = [{ host = \"/no/such/folder\", path = \"/data\" }]\n")
        .expect("config");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("PYBERTH_STATE_DIR", state_dir())
        .stdin(std::process::Stdio::null())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out).await.expect("exits").expect("output");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("environments.broken.mounts") && err.contains("/no/such/folder"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The tags of the images the sandbox image `tag` was built on.
async fn ancestors(tag: &str) -> Vec<String> {
    let history = docker().await.image_history(tag).await.expect("the image exists");
    history.into_iter().skip(1).flat_map(|step| step.tags).collect()
}

/// Where no registry answers, the default environment runs Debian's Python (3.11 on
/// bookworm), not python:3.12-slim: list_environments must not tell a model it has 3.12.
/// Its description names both cases, and the one the built image took is read from the
/// engine by `description_as_built`.
#[tokio::test(flavor = "multi_thread")]
async fn the_default_environment_is_described_as_what_it_runs() {
    let s = Server::start("describe-default", &[]).await;
    let sc = s.ok("default", "import sys\n'%d.%d' % sys.version_info[:2]").await;
    let python = sc["result"].as_str().expect("a version").trim_matches('\'').to_owned();
    let listed = s.call("list_environments", json!({})).await;
    let envs = listed.structured_content.clone().expect("sc");
    let default = envs["environments"].as_array().expect("list").iter().find(|e| e["name"] == "default").cloned();
    let description = default.expect("default listed")["description"].as_str().expect("text").to_owned();
    assert!(text(&listed).contains(&description), "the text says the same: {}", text(&listed));
    assert!(description.contains(&format!("Python {python}")), "it runs {python}: {description}");
    s.stop().await;

    let cfg = server_settings();
    let envs = pyberth::environment::Environments::from_config(&cfg).expect("environments");
    let env = envs.get(Some("default")).expect("default");
    let built = pyberth::environment::description_as_built(&docker().await, &env).await;
    assert_eq!(built, description, "list_environments says what the built image runs");
    let offline = format!("pyberth-base:{}", cfg.fallback_release);
    let tag = pyberth::docker::image::tag_for(&env.cfg);
    if ancestors(&tag).await.contains(&offline) {
        assert!(built.contains(&format!("Python {python} (the offline base {offline}")), "{built}");
        assert!(!built.contains("where a registry answers"), "one case, the one that runs: {built}");
    } else {
        assert!(built.contains(&format!("Python {python} from {}", cfg.base_image)), "{built}");
    }
}
