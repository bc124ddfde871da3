//! `pyberth run`, the CI runner: exit codes, streams, projects in, reports out.

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

use crate::common::{assert_cleaned_up, instance_name, state_dir};

/// Runs `pyberth run ARGS` in `cwd` (stdin from `input`), returning its output and instance.
async fn pyberth_run(tag: &str, cwd: &Path, args: &[&str], input: Option<&str>) -> (Output, String) {
    pyberth_run_with(tag, cwd, args, input, &[]).await
}

/// [`pyberth_run`] with environment variables of its own (e.g. `PYBERTH_CONFIG`).
pub(crate) async fn pyberth_run_with(
    tag: &str,
    cwd: &Path,
    args: &[&str],
    input: Option<&str>,
    envs: &[(&str, &str)],
) -> (Output, String) {
    let instance = instance_name(tag);
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"));
    cmd.arg("run")
        .args(args)
        .envs(envs.iter().copied())
        .current_dir(cwd)
        .env("PYBERTH_INSTANCE", &instance)
        .env("PYBERTH_STATE_DIR", state_dir())
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().expect("spawn pyberth run");
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt as _;
        stdin.write_all(input.unwrap_or_default().as_bytes()).await.expect("stdin");
    }
    let out = tokio::time::timeout(std::time::Duration::from_secs(300), child.wait_with_output())
        .await
        .expect("pyberth run finished in time")
        .expect("pyberth run output");
    // It has exited, so its lock is stale if it is still there: it sometimes is, after a
    // program's non-zero exit (its Instance outlives the run). Stale locks pile up otherwise.
    let _ = std::fs::remove_file(state_dir().join(format!("{instance}.lock")));
    (out, instance)
}

pub(crate) fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pyberth-cli-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

pub(crate) fn streams(o: &Output) -> (String, String) {
    (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn exit_codes_and_streams_are_the_programs() {
    let dir = scratch("codes");
    std::fs::write(
        dir.join("t.py"),
        "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)\nsys.exit(int(sys.argv[1]))\n",
    )
    .expect("script");
    for code in [0, 3] {
        let arg = code.to_string();
        let (o, instance) = pyberth_run("code", &dir, &["t.py", "--", &arg], None).await;
        let (out, err) = streams(&o);
        assert_eq!(o.status.code(), Some(code), "stderr: {err}");
        assert_eq!(out, "to stdout\n");
        let (program, ours) = err.split_at(err.rfind("[pyberth]").expect("pyberth's closing line"));
        assert_eq!(program, "to stderr\n", "nothing else of pyberth's own on a clean run");
        assert!(ours.starts_with(&format!("[pyberth] exit {code} (")), "{ours}");
        assert_cleaned_up(&instance).await;
    }
    // A script from stdin; an uncaught exception is status 1 with its traceback on stderr.
    let (o, _) = pyberth_run("stdin", &dir, &["-"], Some("print('piped')\nraise ValueError('bad')\n")).await;
    let (out, err) = streams(&o);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(out, "piped\n");
    assert!(err.contains("ValueError: bad"), "{err}");

    let (o, instance) =
        pyberth_run("timeout", &dir, &["--timeout", "1", "-"], Some("import time\ntime.sleep(30)")).await;
    assert_eq!(o.status.code(), Some(124), "timeout: {}", streams(&o).1);
    assert!(streams(&o).1.contains("timeout"), "{}", streams(&o).1);
    assert_cleaned_up(&instance).await;

    let hog = "x = ' ' * (400 << 20)\nprint(len(x))";
    let (o, _) = pyberth_run("oom", &dir, &["--memory-mb", "200", "-"], Some(hog)).await;
    assert_eq!(o.status.code(), Some(137), "oom: {}", streams(&o).1);
    assert!(streams(&o).1.contains("out of memory"), "{}", streams(&o).1);

    let (o, _) = pyberth_run("notfound", &dir, &["--", "no-such-tool", "x"], None).await;
    assert_eq!(o.status.code(), Some(127));
    assert!(streams(&o).1.contains("no-such-tool"), "{}", streams(&o).1);

    let (o, instance) = pyberth_run("usage", &dir, &["missing.py"], None).await;
    assert_eq!(o.status.code(), Some(2));
    assert!(streams(&o).1.contains("missing.py"), "{}", streams(&o).1);
    assert!(crate::common::containers_of(&instance).await.is_empty(), "no container for a bad invocation");
    let (o, _) = pyberth_run("badenv", &dir, &["--env", "LD_PRELOAD=/x.so", "t.py"], None).await;
    assert_eq!(o.status.code(), Some(2), "{}", streams(&o).1);
    // Bad invocations, all 2 and all before any container: a server's flag, a missing project,
    // an unknown environment.
    for (tag, args, says) in [
        ("srvflag", &["--timeout-s", "1", "t.py"][..], "--timeout"),
        ("noproj", &["--project", "/nonexistent", "t.py"][..], "no such directory"),
        ("noenv", &["--environment", "nosuch", "t.py"][..], "nosuch"),
    ] {
        let (o, instance) = pyberth_run(tag, &dir, args, None).await;
        let err = streams(&o).1;
        assert_eq!(o.status.code(), Some(2), "{tag}: {err}");
        assert!(err.contains(says), "{tag}: {err}");
        assert!(crate::common::containers_of(&instance).await.is_empty(), "{tag}: no container");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn json_reports_the_result_and_env_reaches_the_program() {
    let dir = scratch("json");
    let code = "import os, sys\nprint(os.environ['GREETING'])\nsys.exit(4)";
    let (o, instance) = pyberth_run("json", &dir, &["--json", "--env", "GREETING=hi", "-"], Some(code)).await;
    assert_eq!(o.status.code(), Some(4));
    let v: Value = serde_json::from_slice(&o.stdout).expect("one JSON document on stdout");
    assert_eq!(v["status"], "error");
    assert_eq!(v["exit_code"], 4);
    assert_eq!(v["stdout"], "hi\n");
    assert!(v["duration_ms"].as_f64().is_some_and(|d| d > 0.0));
    assert!(v["peak_memory_kb"].as_u64().is_some());
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_project_runs_its_pytest_suite_and_the_report_comes_back() {
    let dir = scratch("project");
    let project = dir.join("proj");
    std::fs::create_dir_all(project.join("tests")).expect("mkdir");
    std::fs::create_dir_all(project.join(".git")).expect("mkdir");
    std::fs::write(project.join(".git/HEAD"), "ref: refs/heads/main\n").expect("git");
    std::fs::write(project.join("calc.py"), "def add(a, b):\n    return a + b\n").expect("calc");
    std::fs::write(
        project.join("tests/test_calc.py"),
        "import os\nfrom calc import add\n\ndef test_add():\n    assert add(2, 2) == 4\n\n\
         def test_no_git():\n    assert not os.path.exists('.git')\n\n\
         def test_broken():\n    assert add(1, 1) == 3\n",
    )
    .expect("tests");
    let out = dir.join("out");
    let args = [
        "--with",
        "pytest",
        "--project",
        "proj",
        "--output",
        "out",
        "--",
        "python",
        "-m",
        "pytest",
        "-q",
        "--junitxml=reports/junit.xml",
    ];
    let (o, instance) = pyberth_run("pytest", &dir, &args, None).await;
    let (stdout, stderr) = streams(&o);
    assert_eq!(o.status.code(), Some(1), "pytest's own status for a failing test; stderr: {stderr}");
    assert!(stdout.contains("1 failed, 2 passed"), "{stdout}");
    let junit = std::fs::read_to_string(out.join("reports/junit.xml")).expect("the JUnit report came back");
    assert!(junit.contains("testsuite") && junit.contains("test_broken"), "{junit}");
    assert!(!out.join("calc.py").exists(), "only files the run made come back");
    assert!(!out.join("tests").join("__pycache__").exists(), "caches stay behind");
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The attack of a prompt-injected model's code on a checkout: with `--project . --output .`,
/// it writes `.git/config` with a `core.fsmonitor` command (run by the host's next
/// `git status`), overwrites a `Makefile` it was never given, and a workflow. None of it may
/// land; what came back is listed, and control bytes in names are escaped.
#[tokio::test(flavor = "multi_thread")]
async fn the_copy_back_never_writes_vcs_metadata_nor_over_files_it_was_not_given() {
    let dir = scratch("gitattack");
    let repo = dir.join("repo");
    std::fs::create_dir_all(&repo).expect("mkdir");
    let git = |args: &[&str]| std::process::Command::new("git").arg("-C").arg(&repo).args(args).output();
    let have_git = git(&["init", "-q"]).is_ok_and(|o| o.status.success());
    if !have_git {
        std::fs::create_dir_all(repo.join(".git")).expect("mkdir .git");
        std::fs::write(repo.join(".git/config"), "[core]\n").expect("config");
    }
    let config_before = std::fs::read(repo.join(".git/config")).expect("config");
    std::fs::write(repo.join("app.py"), "print('app')\n").expect("app");
    let marker = dir.join("pwned");
    let evil = format!(
        "import os\nos.makedirs('.git/hooks', exist_ok=True)\n\
         open('.git/config', 'w').write('[core]\\n\\tfsmonitor = \"touch {m}; false\"\\n')\n\
         open('.git/hooks/pre-commit', 'w').write('#!/bin/sh\\ntouch {m}\\n')\n\
         open('Makefile', 'w').write('all:\\n\\ttouch {m}\\n')\n\
         os.makedirs('.github/workflows', exist_ok=True)\n\
         open('.github/workflows/ci.yml', 'w').write('on: push')\n\
         open('app.py', 'a').write('# changed\\n')\n\
         open('result.txt', 'w').write('42')\n\
         open('odd\\x1b]0;title\\x07.txt', 'w').write('x')\n",
        m = marker.display()
    );
    std::fs::write(dir.join("evil.py"), evil).expect("script");
    // Uploaded with the project, so a changed input: only --output-exclude keeps it.
    std::fs::write(repo.join("Makefile"), "all:\n\techo host\n").expect("makefile");
    let args = [
        "--project",
        "repo",
        "--output",
        "repo",
        "--output-exclude",
        ".github",
        "--output-exclude",
        "Makefile",
        "evil.py",
    ];
    let (o, instance) = pyberth_run("gitattack", &dir, &args, None).await;
    let (_, stderr) = streams(&o);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    assert_eq!(std::fs::read(repo.join(".git/config")).expect("config"), config_before, ".git/config untouched");
    assert!(!repo.join(".git/hooks/pre-commit").exists(), "no hook came back");
    assert!(!repo.join(".github").exists(), "--output-exclude held the workflow back");
    assert_eq!(std::fs::read_to_string(repo.join("result.txt")).expect("result"), "42");
    assert!(std::fs::read_to_string(repo.join("app.py")).expect("app").contains("# changed"), "an input may change");
    if have_git {
        let _ = git(&["status", "--porcelain"]);
    }
    assert!(!marker.exists(), "no command of the sandbox's ran on the host");
    assert!(std::fs::read_to_string(repo.join("Makefile")).expect("makefile").contains("echo host"));
    assert!(stderr.contains("copied back"), "{stderr}");
    assert!(stderr.contains("not copied back: .git/config (version-control metadata"), "{stderr}");
    assert!(stderr.contains("not copied back: .github/workflows/ci.yml (matches --output-exclude)"), "{stderr}");
    assert!(!stderr.contains('\x1b'), "names are escaped: {stderr:?}");
    assert_cleaned_up(&instance).await;

    // An output directory apart from the project: existing files there were never given.
    let out = dir.join("out");
    std::fs::create_dir_all(&out).expect("mkdir");
    std::fs::write(out.join("Makefile"), "host\n").expect("makefile");
    let (o, _) = pyberth_run("gitattack2", &dir, &["--output", "out", "--json", "evil.py"], None).await;
    assert_eq!(o.status.code(), Some(0), "{}", streams(&o).1);
    assert_eq!(std::fs::read_to_string(out.join("Makefile")).expect("makefile"), "host\n", "not overwritten");
    let v: Value = serde_json::from_slice(&o.stdout).expect("json");
    let held = v["output_held_back"].as_array().expect("held back list");
    assert!(
        held.iter()
            .any(|h| h["path"] == "Makefile" && h["why"].as_str().is_some_and(|w| w.contains("--output-overwrite"))),
        "{v}"
    );
    assert!(v["output_paths"].as_array().expect("paths").iter().any(|p| p == "result.txt"), "{v}");
    let (o, _) = pyberth_run("gitattack3", &dir, &["--output", "out", "--output-overwrite", "evil.py"], None).await;
    assert_eq!(o.status.code(), Some(0), "{}", streams(&o).1);
    assert!(std::fs::read_to_string(out.join("Makefile")).expect("makefile").contains("touch"), "asked to overwrite");
    assert!(!out.join(".git").exists(), "never VCS metadata");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prompt-injected program drives the CI runner through its log: workflow commands at the
/// start of a line, terminal escapes (OSC title, hyperlink), and a forged closing line of ours.
/// By default none of it arrives as such; `--raw-output` passes it through.
#[tokio::test(flavor = "multi_thread")]
async fn run_output_cannot_command_the_ci_runner_nor_forge_our_lines() {
    let dir = scratch("cicmd");
    let code = "import sys\n\
        print('::add-mask::hunter2')\n\
        print('ok ::error:: mid-line stays')\n\
        print('##vso[task.setvariable variable=PATH]/tmp/evil')\n\
        sys.stdout.write('\\x1b]0;owned\\x07\\x1b]8;;http://evil/\\x1b\\\\link\\n')\n\
        sys.stderr.write('\\r::error file=x::forged\\n[pyberth] exit 0 (ok) after 0.1 s\\n')\n\
        sys.exit(3)\n";
    let (o, instance) = pyberth_run("cicmd", &dir, &["-"], Some(code)).await;
    let (out, err) = streams(&o);
    assert_eq!(o.status.code(), Some(3), "{err}");
    for line in out.lines().chain(err.lines()) {
        for cmd in ["::", "##vso[", "##["] {
            assert!(!line.trim_start_matches('\r').starts_with(cmd), "a runner command got through: {line:?}");
        }
    }
    assert!(out.contains("\\::add-mask::hunter2") && out.contains("ok ::error:: mid-line stays"), "{out}");
    assert!(!out.contains('\x1b') && !out.contains('\x07') && out.contains("\\x1b]0;owned"), "{out:?}");
    let ours: Vec<&str> = err.lines().filter(|l| l.starts_with("[pyberth]")).collect();
    assert_eq!(ours.len(), 1, "only our own closing line starts with [pyberth]: {err}");
    assert!(ours[0].starts_with("[pyberth] exit 3 (error)"), "{err}");
    assert!(err.lines().last().is_some_and(|l| l.starts_with("[pyberth] exit 3")), "ours is last: {err}");
    assert_cleaned_up(&instance).await;

    let (o, _) = pyberth_run("cicmdraw", &dir, &["--raw-output", "-"], Some(code)).await;
    let (out, _) = streams(&o);
    assert!(out.starts_with("::add-mask::hunter2\n") && out.contains('\x1b'), "raw on request: {out:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Another local user plants the state dir first (a shared `/tmp` name): its locks would be
/// trusted and our writes led through its symlinks. pyberth refuses it, before any container.
#[tokio::test(flavor = "multi_thread")]
async fn a_state_dir_others_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = scratch("statedir");
    let planted = dir.join("state");
    std::fs::create_dir_all(&planted).expect("mkdir");
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let instance = instance_name("statedir");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pyberth"))
        .args(["run", "-"])
        .current_dir(&dir)
        .env("PYBERTH_INSTANCE", &instance)
        .env("PYBERTH_STATE_DIR", &planted)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("pyberth run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("refusing the state dir") && err.contains("others may write"), "{err}");
    assert!(crate::common::containers_of(&instance).await.is_empty(), "no container was made");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Empty files cost no bytes: a run that makes thousands of them must still hit a bound on the
/// way back, not flood the host directory.
#[tokio::test(flavor = "multi_thread")]
async fn the_copy_back_is_bounded_in_files_not_only_bytes() {
    let dir = scratch("manyfiles");
    let code = "import os\nos.makedirs('o', exist_ok=True)\nfor i in range(500):\n    open(f'o/{i}', 'w').close()\n";
    let args = ["--output", "out", "--transfer-max-files", "100", "-"];
    let (o, instance) = pyberth_run("manyfiles", &dir, &args, Some(code)).await;
    let (_, err) = streams(&o);
    assert_eq!(o.status.code(), Some(125), "{err}");
    assert!(err.contains("more than 100 output files") && err.contains("--transfer-max-files"), "{err}");
    let landed = std::fs::read_dir(dir.join("out/o")).map(|d| d.count()).unwrap_or(0);
    assert!(landed <= 100, "{landed} files landed");
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CI log shows the installer's lines as they come; the failure then says why once, and
/// speaks of what happened here (nothing was installed), not of a session the user never had.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_install_is_said_once_in_the_user_s_terms() {
    let dir = scratch("badinstall");
    let args = ["--with", "pyberth-no-such-package-4c1d", "-"];
    let (o, instance) = pyberth_run("badinstall", &dir, &args, Some("print(1)")).await;
    let (_, err) = streams(&o);
    assert_eq!(o.status.code(), Some(125), "{err}");
    assert_eq!(err.matches("install failed").count(), 1, "{err}");
    assert!(err.contains("no such package") && !err.contains("session"), "{err}");
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Links the program made out of the workspace are never followed on the way back: the
/// workspace is packed by the agent as the program's own uid, links stay links and are not
/// copied, and nothing of `/etc` (not even what only root may read) reaches the host.
#[tokio::test(flavor = "multi_thread")]
async fn the_copy_back_follows_no_link_out_of_the_workspace() {
    let dir = scratch("links");
    let code = "import os\nos.symlink('/etc', 'etc_link')\nos.symlink('/etc/shadow', 'shadow_link')\n\
                os.makedirs('res')\nopen('res/ok.txt', 'w').write('ok')\nos.symlink('/etc', 'res/etc_link')\n";
    let (o, instance) = pyberth_run("links", &dir, &["--output", "out", "-"], Some(code)).await;
    let (_, err) = streams(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(std::fs::read_to_string(dir.join("out/res/ok.txt")).expect("the result"), "ok");
    for link in ["etc_link", "shadow_link", "res/etc_link"] {
        assert!(std::fs::symlink_metadata(dir.join("out").join(link)).is_err(), "{link} is not copied");
    }
    let mut stack = vec![dir.join("out")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read out").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let body = std::fs::read(&p).unwrap_or_default();
                assert!(!String::from_utf8_lossy(&body).contains("root:"), "{} came from /etc", p.display());
            }
        }
    }
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A git directory under another name (issue 27, Low 4): `bare/` with `HEAD`, a `config` whose
/// `core.fsmonitor` is a command, `objects/` and `refs/`. Copied back, a host `git status`
/// inside it runs the command. Held back by what it holds, not by its name.
#[tokio::test(flavor = "multi_thread")]
async fn the_copy_back_holds_back_a_git_directory_under_any_name() {
    let dir = scratch("baregit");
    let code = "import os\nfor d in ('bare/objects/info', 'bare/refs/heads', 'deep/x/hooked/objects', 'deep/x/hooked/refs'):\n    \
                os.makedirs(d)\n\
                for root in ('bare', 'deep/x/hooked'):\n    \
                open(root + '/HEAD', 'w').write('ref: refs/heads/main\\n')\n    \
                open(root + '/config', 'w').write('[core]\\n\\tbare = true\\n\\tfsmonitor = touch PWNED\\n')\n    \
                open(root + '/objects/info/x' if root == 'bare' else root + '/objects/x', 'w').write('x')\n    \
                open(root + '/refs/heads/main' if root == 'bare' else root + '/refs/x', 'w').write('x')\n\
                open('result.txt', 'w').write('ok')\n";
    let (o, instance) = pyberth_run("baregit", &dir, &["--output", "out", "--json", "-"], Some(code)).await;
    let (out, err) = streams(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert_eq!(std::fs::read_to_string(dir.join("out/result.txt")).expect("the result"), "ok");
    assert!(!dir.join("out/bare").exists(), "a bare repository came back");
    assert!(!dir.join("out/deep/x/hooked").exists(), "a nested bare repository came back");
    let v: Value = serde_json::from_str(out.trim()).expect("json");
    let held = v["output_held_back"].as_array().expect("held back list");
    assert!(
        held.iter()
            .any(|h| h["path"] == "bare/config" && h["why"].as_str().is_some_and(|w| w.contains("version-control"))),
        "{v}"
    );
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Copy-back is all or nothing (issue 27, Low 5): with a host file in the way of one result,
/// no other result is written, and the program's own exit status is told beside the error.
#[tokio::test(flavor = "multi_thread")]
async fn a_copy_back_that_cannot_finish_writes_nothing_and_tells_the_programs_status() {
    let dir = scratch("allornothing");
    std::fs::create_dir_all(dir.join("out")).expect("out");
    std::fs::write(dir.join("out/m"), "host file in the way of m/").expect("in the way");
    let code = "import os, sys\nopen('a.txt', 'w').write('a')\nos.makedirs('m')\nopen('m/x.txt', 'w').write('x')\n\
                open('z.txt', 'w').write('z')\nsys.exit(3)\n";
    let (o, instance) = pyberth_run("allornothing", &dir, &["--output", "out", "-"], Some(code)).await;
    let (_, err) = streams(&o);
    assert_eq!(o.status.code(), Some(125), "{err}");
    assert!(err.contains("in the way"), "{err}");
    assert!(err.contains("the program exited 3"), "the program's own status is told: {err}");
    let refusal = err.lines().find(|l| l.contains("in the way")).unwrap_or_default();
    assert!(
        refusal.contains("nothing was copied back") && refusal.contains("is as it was"),
        "what was kept, and why, in one line: {refusal}"
    );
    for f in ["a.txt", "z.txt"] {
        assert!(!dir.join("out").join(f).exists(), "{f} was written though the copy back failed");
    }
    let left: Vec<_> = std::fs::read_dir(dir.join("out")).expect("out").flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, [std::ffi::OsString::from("m")], "nothing else, no staging left behind");
    assert_cleaned_up(&instance).await;
    let _ = std::fs::remove_dir_all(&dir);
}
