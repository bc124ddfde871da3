//! Issue 28, items 4 to 7: notebook habits, small wording, caches out of the workspace, and
//! the tool surface a client lists.

use serde_json::json;

use crate::common::{Server, text};

#[tokio::test(flavor = "multi_thread")]
async fn notebook_lines_work_or_say_what_to_do() {
    let s = Server::start("habits-notebook", &[]).await;
    let code = "%pip install six\n%matplotlib inline\nimport six\n!echo from-the-shell\nsix.__name__";
    let (r, sc) = s.run_with(json!({ "code": code, "timeout_s": 120 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["result"], "'six'");
    let said = text(&r);
    assert!(said.contains("from-the-shell"), "{said}");
    assert!(said.contains("installed through the package tool"), "{said}");
    let r = s.call("run_python", json!({ "code": "%pip install -r requirements.txt" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("install_packages"), "{}", text(&r));

    let (r, _) = s.run("default", "input('name? ')").await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("input() has no stdin"), "{}", text(&r));

    let (r, _) =
        s.run("default", "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=5)").await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("this session is offline") && text(&r).contains("egress"), "{}", text(&r));
    let pip = "import subprocess, sys\n\
               r = subprocess.run([sys.executable, '-m', 'pip', 'install', '--retries', '0', 'tomli'])\n\
               assert r.returncode == 0, 'pip failed'";
    let (r, _) = s.run("default", pip).await;
    assert_eq!(r.is_error, Some(true));
    assert!(
        text(&r).contains("pip in the code cannot install") && text(&r).contains("install_packages"),
        "{}",
        text(&r)
    );

    let tools = s.client().list_all_tools().await.expect("tools");
    let run = tools.iter().find(|t| t.name == "run_python").expect("run_python");
    assert!(run.description.as_deref().unwrap_or_default().contains("come back as images"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn small_wording_reads_right() {
    let s = Server::start("habits-wording", &[]).await;
    s.ok("default", "open('a.txt', 'w').write('a')").await;
    let r = s.call("read_file", json!({ "path": "." })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("is the workspace itself"), "{}", text(&r));
    let r = s.call("install_packages", json!({ "packages": ["numpy; rm -rf /"] })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("not a valid requirement"), "{}", text(&r));
    let r = s.call("list_files", json!({})).await;
    assert!(text(&r).starts_with("kind\tbytes\tallocated\tpath\n"), "{}", text(&r));
    let r = s.call("snapshot_session", json!({ "name": "one" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let r = s.call("list_snapshots", json!({})).await;
    assert!(text(&r).starts_with("1 snapshot\n"), "{}", text(&r));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn caches_stay_out_of_the_workspace() {
    let s = Server::start("habits-caches", &[]).await;
    // Where matplotlib, pip and XDG-minded libraries put their caches: their own lookup rules.
    let code = "import os\n\
                cache = os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache')\n\
                mpl = os.environ.get('MPLCONFIGDIR') or os.path.expanduser('~/.config/matplotlib')\n\
                pip = os.environ.get('PIP_CACHE_DIR') or os.path.join(cache, 'pip')\n\
                for d in (os.path.join(cache, 'lib'), mpl, pip):\n    \
                    os.makedirs(d, exist_ok=True)\n    \
                    open(os.path.join(d, 'cache.json'), 'w').write('{}')\n\
                (cache, mpl, pip)";
    let sc = s.ok("default", code).await;
    let dirs = sc["result"].as_str().expect("result");
    assert!(!dirs.contains("/workspace"), "{dirs}");
    let r = s.call("list_files", json!({ "recursive": true })).await;
    let entries = r.structured_content.expect("structured")["entries"].clone();
    assert_eq!(entries, json!([]), "nothing of the caches in the workspace");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_core_profile_lists_a_handful_of_tools() {
    let all = Server::start("habits-tools-all", &[]).await;
    let core = Server::start("habits-tools-core", &[("PYBERTH_TOOLS", "core")]).await;
    let mut sizes = Vec::new();
    for s in [&all, &core] {
        let tools = s.client().list_all_tools().await.expect("tools");
        let descriptions: usize = tools.iter().map(|t| t.description.as_deref().unwrap_or_default().len()).sum();
        let whole: usize = tools.iter().map(|t| serde_json::to_string(t).map(|j| j.len()).unwrap_or(0)).sum();
        // Measured for docs/output.md: characters / 4 as tokens.
        eprintln!("tools: {}, description tokens ~{}, whole definitions ~{}", tools.len(), descriptions / 4, whole / 4);
        sizes.push((tools.len(), whole));
        let mut names: Vec<String> = tools.iter().map(|t| t.name.to_string()).collect();
        names.sort();
        if s.instance == core.instance {
            let mut want: Vec<String> = pyberth::CORE_TOOLS.iter().map(|n| (*n).to_owned()).collect();
            want.sort();
            assert_eq!(names, want);
        }
    }
    assert!(sizes[0].0 > 20 && sizes[1].0 == 8, "{sizes:?}");
    assert!(sizes[1].1 * 2 < sizes[0].1, "core costs less than half of all: {sizes:?}");
    // A tool outside the profile is not there to call.
    let r = core.client().call_tool(rmcp::model::CallToolRequestParams::new("list_sessions")).await;
    assert!(r.is_err(), "{r:?}");
    all.stop().await;
    core.stop().await;
}
