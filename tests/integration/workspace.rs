use base64::Engine as _;
use rmcp::model::ReadResourceRequestParams;
use serde_json::{Value, json};

use crate::common::{Server, text};

pub(crate) fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

async fn ok_call(s: &Server, tool: &'static str, args: Value) -> Value {
    let r = s.call(tool, args.clone()).await;
    assert_eq!(r.is_error, Some(false), "{tool} {args}: {}", text(&r));
    r.structured_content.unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread")]
async fn create_append_read_and_run_a_file() {
    let s = Server::start("ws-files", &[]).await;
    ok_call(&s, "write_file", json!({ "path": "app/main.py", "content": "import sys\n" })).await;
    let sc =
        ok_call(&s, "write_file", json!({ "path": "app/main.py", "content": "print(sys.argv[1:])\n", "append": true }))
            .await;
    assert_eq!(sc["size"], 31);
    let sc = ok_call(&s, "read_file", json!({ "path": "app/main.py" })).await;
    assert_eq!(sc["content"], "import sys\nprint(sys.argv[1:])\n");
    assert_eq!(sc["eof"], true);
    let sc = ok_call(&s, "run_file", json!({ "path": "app/main.py", "args": ["a", "b c"] })).await;
    assert_eq!(sc["stdout"], "['a', 'b c']\n");
    assert_eq!(sc["exit_code"], 0);

    ok_call(
        &s,
        "write_file",
        json!({ "path": "fail.py", "content": "import sys\nprint('x', file=sys.stderr)\nsys.exit(3)" }),
    )
    .await;
    let r = s.call("run_file", json!({ "path": "fail.py" })).await;
    assert_eq!(r.is_error, Some(true));
    let sc = r.structured_content.expect("sc");
    assert_eq!(sc["exit_code"], 3);
    assert_eq!(sc["stderr"], "x\n");

    // The interpreter's own state is untouched by run_file; files are shared.
    s.ok("default", "import os\nos.path.exists('app/main.py')").await;
    let r = s.call("list_files", json!({ "recursive": true })).await;
    let sc = r.structured_content.clone().expect("sc");
    let paths: Vec<&str> =
        sc["entries"].as_array().expect("entries").iter().filter_map(|e| e["path"].as_str()).collect();
    assert_eq!(paths, ["app", "fail.py", "app/main.py"]);
    let links = r.content.iter().filter(|c| c.as_resource_link().is_some()).count();
    assert_eq!(links, 2, "each file is linked as a resource");

    ok_call(&s, "delete_file", json!({ "path": "app" })).await;
    let sc = ok_call(&s, "list_files", json!({})).await;
    assert_eq!(sc["entries"].as_array().map(|a| a.len()), Some(1));
    let r = s.call("read_file", json!({ "path": "app/main.py" })).await;
    assert_eq!(r.is_error, Some(true));
    assert!(text(&r).contains("does not exist"), "{}", text(&r));

    // save_as keeps the code as a file before running it.
    let (r, sc) = s.run_with(json!({ "code": "print('saved run')", "save_as": "keep/this.py" })).await;
    assert_eq!(r.is_error, Some(false));
    assert_eq!(sc["stdout"], "saved run\n");
    let sc = ok_call(&s, "read_file", json!({ "path": "keep/this.py" })).await;
    assert_eq!(sc["content"], "print('saved run')");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_20_mib_file_goes_in_and_out_with_bounded_server_memory() {
    let s = Server::start("ws-big", &[]).await;
    let chunk: Vec<u8> = (0..(5u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 13).to_le_bytes()[0]).collect();
    for i in 0..4 {
        ok_call(
            &s,
            "write_file",
            json!({ "path": "big.bin", "content": b64(&chunk), "encoding": "base64", "append": i > 0 }),
        )
        .await;
    }
    let sc = s
        .ok("default", "import hashlib\nd = open('big.bin','rb').read()\n(len(d), hashlib.sha256(d).hexdigest())")
        .await;
    let mut want = Vec::new();
    for _ in 0..4 {
        want.extend_from_slice(&chunk);
    }
    assert!(sc["result"].as_str().unwrap_or_default().starts_with("(20971520, "), "{sc}");
    let mut got = Vec::new();
    let mut offset = 0u64;
    loop {
        let sc = ok_call(&s, "read_file", json!({ "path": "big.bin", "offset": offset, "length": 4u64 << 20 })).await;
        assert_eq!(sc["encoding"], "base64");
        let part =
            base64::engine::general_purpose::STANDARD.decode(sc["content"].as_str().expect("content")).expect("b64");
        offset += part.len() as u64;
        got.extend_from_slice(&part);
        if sc["eof"] == true {
            break;
        }
    }
    assert_eq!(got.len(), want.len());
    assert!(got == want, "bytes come back exactly");
    let pid = s.child.id().expect("pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let hwm_kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    assert!(hwm_kb < 200 * 1024, "server peak memory {hwm_kb} KiB for a 20 MiB file");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn traversal_and_symlinks_are_refused_or_contained() {
    let s = Server::start("ws-paths", &[]).await;
    for bad in ["../x", "/etc/passwd", "a\u{0}b", "", "x/../../y"] {
        let r = s.call("write_file", json!({ "path": bad, "content": "x" })).await;
        assert_eq!(r.is_error, Some(true), "{bad:?}");
        let r = s.call("read_file", json!({ "path": bad })).await;
        assert_eq!(r.is_error, Some(true), "{bad:?}");
    }
    s.ok("default", "import os\nos.symlink('/etc/passwd', 'pw')\nos.symlink('/tmp', 'tmpdir')\nos.symlink('..', 'up')")
        .await;
    for path in ["pw", "up/etc/passwd"] {
        let r = s.call("read_file", json!({ "path": path })).await;
        assert_eq!(r.is_error, Some(true), "{path}");
        assert!(text(&r).contains("outside the workspace"), "{path}: {}", text(&r));
    }
    let r = s.call("write_file", json!({ "path": "tmpdir/planted", "content": "x" })).await;
    assert_eq!(r.is_error, Some(true));
    let r = s.call("write_file", json!({ "path": "pw", "content": "x" })).await;
    assert_eq!(r.is_error, Some(true), "no write through a final symlink");
    let sc = s.ok("default", "import os\nos.path.exists('/tmp/planted')").await;
    assert_eq!(sc["result"], "False");
    let r = s
        .client
        .as_ref()
        .expect("client")
        .read_resource(ReadResourceRequestParams::new("pyberth://sessions/default/files/pw"))
        .await;
    assert!(r.is_err(), "a resource read through a symlink out of the workspace fails");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn workspace_files_are_resources() {
    let s = Server::start("ws-resources", &[]).await;
    let client = s.client.as_ref().expect("client");
    let templates = client.list_all_resource_templates().await.expect("templates");
    assert!(templates.iter().any(|t| t.uri_template.contains("pyberth://sessions/{session}/files/")));
    s.ok("default", "open('notes.txt','w').write('hello')\nopen('raw.bin','wb').write(bytes([0,255,1]))").await;
    let r = client
        .read_resource(ReadResourceRequestParams::new("pyberth://sessions/default/files/notes.txt"))
        .await
        .expect("read");
    let v = serde_json::to_value(&r).expect("json");
    assert_eq!(v["contents"][0]["text"], "hello");
    let r = client
        .read_resource(ReadResourceRequestParams::new("pyberth://sessions/default/files/raw.bin"))
        .await
        .expect("read");
    let v = serde_json::to_value(&r).expect("json");
    assert_eq!(v["contents"][0]["blob"], "AP8B");
    assert!(
        client
            .read_resource(ReadResourceRequestParams::new("pyberth://sessions/nobody/files/notes.txt"))
            .await
            .is_err()
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn environment_variables_per_run_and_per_session() {
    let s = Server::start("ws-env", &[("PYBERTH_TEST_SERVER_SECRET", "leak")]).await;
    let get = "import os\n(os.environ.get('A'), os.environ.get('B'), os.environ.get('C'), os.environ.get('PYBERTH_TEST_SERVER_SECRET'))";
    let (_, sc) = s.run_with(json!({ "code": get, "env": { "A": "run" }, "session_env": { "B": "sess" }, "env_file": "C=file\nA=overridden" })).await;
    assert_eq!(sc["result"], "('run', 'sess', 'file', None)", "env wins over env_file; the server's env never leaks");
    let (_, sc) = s.run_with(json!({ "code": get })).await;
    assert_eq!(sc["result"], "(None, 'sess', None, None)", "per-run env is gone, session env stays");
    let sc = s
        .ok(
            "default",
            "import subprocess\nsubprocess.run(['sh','-c','echo $B'], capture_output=True, text=True).stdout",
        )
        .await;
    assert_eq!(sc["result"], "'sess\\n'", "child processes see it too");
    for bad in [json!({ "LD_PRELOAD": "/x.so" }), json!({ "PYTHONSTARTUP": "x" }), json!({ "BAD-NAME": "x" })] {
        let (r, _) = s.run_with(json!({ "code": "1", "env": bad })).await;
        assert_eq!(r.is_error, Some(true));
        assert!(text(&r).contains("environment variable"), "{}", text(&r));
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn every_figure_comes_back_as_an_image() {
    let s = Server::start("ws-figures", &[]).await;
    let code = "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.figure()\nplt.bar([1, 2], [3, 4])\nprint('two figures')";
    let (r, sc) = s.run_with(json!({ "code": code, "packages": ["matplotlib"], "timeout_s": 120 })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["images"], 2);
    let images: Vec<_> = r.content.iter().filter_map(|c| c.as_image()).collect();
    assert_eq!(images.len(), 2);
    for img in &images {
        assert_eq!(img.mime_type, "image/png");
        let png = base64::engine::general_purpose::STANDARD.decode(&img.data).expect("b64");
        assert!(png.starts_with(b"\x89PNG"), "a real PNG");
    }
    // Figures are closed after being returned; display() shows objects with _repr_png_.
    let (r, sc) =
        s.run_with(json!({ "code": "from PIL import Image\ndisplay(Image.new('RGB', (4, 4), 'red'))\n1" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["images"], 1);
    s.stop().await;
}

pub(crate) fn tar_of(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, kind, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_mode(0o644);
        if *kind == tar::EntryType::Symlink {
            h.set_size(0);
            b.append_link(&mut h, path, data).expect("link");
        } else {
            h.set_size(data.len() as u64);
            let name = path.as_bytes();
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            h.set_cksum();
            b.append(&h, data.as_bytes()).expect("append");
        }
    }
    b.into_inner().expect("tar")
}

#[tokio::test(flavor = "multi_thread")]
async fn directories_move_in_and_out_as_tar_archives() {
    let s = Server::start("archives", &[]).await;
    let tar = tar_of(&[
        ("proj/", tar::EntryType::Directory, ""),
        ("proj/a.txt", tar::EntryType::Regular, "alpha"),
        ("proj/pkg/mod.py", tar::EntryType::Regular, "VALUE = 7\n"),
        ("proj/empty.txt", tar::EntryType::Regular, ""),
        ("proj/link", tar::EntryType::Symlink, "/etc/passwd"),
        ("../evil.txt", tar::EntryType::Regular, "evil"),
    ]);
    let r = s.call("upload_archive", json!({ "archive": b64(&tar), "path": "in" })).await;
    let sc = r.structured_content.clone().expect("sc");
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    assert_eq!(sc["files"], 3);
    assert_eq!(sc["skipped"].as_array().map(Vec::len), Some(2), "{sc}");
    let sc = s.ok("default", "import os, sys\nsys.path.insert(0, 'in/proj/pkg')\nimport mod\n(open('in/proj/a.txt').read(), mod.VALUE, os.stat('in/proj/a.txt').st_uid == os.getuid())").await;
    assert_eq!(sc["result"], "('alpha', 7, True)", "files land as the code's own");
    s.ok("default", "import os\nos.symlink('/etc/passwd', 'in/proj/pw')\nos.symlink('/tmp', 'escape')").await;

    let r = s.call("download_archive", json!({ "path": "in/proj" })).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let sc = r.structured_content.expect("sc");
    let data = base64::engine::general_purpose::STANDARD.decode(sc["archive"].as_str().expect("archive")).expect("b64");
    let mut names = Vec::new();
    for e in tar::Archive::new(&data[..]).entries().expect("tar") {
        let mut e = e.expect("entry");
        let name = e.path().expect("path").to_string_lossy().into_owned();
        let mut body = String::new();
        std::io::Read::read_to_string(&mut e, &mut body).expect("read");
        names.push((name, body));
    }
    assert!(names.contains(&("in/proj/a.txt".to_owned(), "alpha".to_owned())), "{names:?}");
    assert!(names.iter().all(|(n, _)| !n.ends_with("pw")), "links are left out: {names:?}");
    assert_eq!(sc["files"], 3);

    // Unpacking through a link the code made is refused: nothing lands in /tmp.
    let tar = tar_of(&[("planted.txt", tar::EntryType::Regular, "x")]);
    let r = s.call("upload_archive", json!({ "archive": b64(&tar), "path": "escape" })).await;
    assert_eq!(r.is_error, Some(true), "{}", text(&r));
    assert_eq!(s.ok("default", "import os\nos.path.exists('/tmp/planted.txt')").await["result"], "False");
    let r = s.call("download_archive", json!({ "path": "missing" })).await;
    assert!(text(&r).contains("does not exist"), "{}", text(&r));
    let r = s.call("upload_archive", json!({ "archive": "not base64!" })).await;
    assert_eq!(r.is_error, Some(true));
    s.stop().await;
}

/// File names are the code's to choose: a newline and tab in a name could add forged lines to
/// the listing (a file that does not exist), and control bytes could break resource URIs. The
/// listing escapes them, every listed file can be read, fetched as a resource and deleted.
#[tokio::test(flavor = "multi_thread")]
async fn odd_file_names_cannot_forge_listing_lines_and_stay_usable() {
    let s = Server::start("ws-oddnames", &[]).await;
    let forged = "x\nfile\t0\t0\tforged.txt";
    let names = [forged, "back\\slash", "esc\u{1b}]0;t\u{7}.txt", "sp ace%.txt"];
    let code = format!(
        "for i, n in enumerate({}):\n    open(n, 'w').write(str(i))\n",
        serde_json::to_string(&names).expect("json")
    );
    s.ok("default", &code).await;
    let r = s.call("list_files", json!({})).await;
    let listing = text(&r);
    assert!(!listing.lines().any(|l| l == "file\t0\t0\tforged.txt"), "no forged line: {listing:?}");
    assert!(!listing.contains('\u{1b}'), "{listing:?}");
    let entries = r.structured_content.as_ref().expect("structured")["entries"].as_array().expect("entries").clone();
    let client = s.client.as_ref().expect("client");
    for (i, name) in names.iter().enumerate() {
        assert!(entries.iter().any(|e| e["path"] == *name), "{name:?} listed exactly: {entries:?}");
        let read = ok_call(&s, "read_file", json!({ "path": name })).await;
        assert_eq!(read["content"], i.to_string(), "{name:?} readable");
        let link = r
            .content
            .iter()
            .filter_map(|c| c.as_resource_link())
            .find(|l| l.name == *name)
            .unwrap_or_else(|| panic!("a resource link for {name:?}"));
        let got = client.read_resource(ReadResourceRequestParams::new(link.uri.clone())).await.expect("resource");
        let v = serde_json::to_value(&got).expect("json");
        assert_eq!(v["contents"][0]["text"], i.to_string(), "{name:?} as a resource ({})", link.uri);
        ok_call(&s, "delete_file", json!({ "path": name })).await;
    }
    let sc = s.ok("default", "import os\nsorted(os.listdir('.'))").await;
    assert_eq!(sc["result"], "[]", "every odd file was deleted");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn list_files_shows_allocated_size_beside_apparent_size() {
    let s = Server::start("allocated", &[]).await;
    // A sparse file (64 MiB apparent, nothing allocated) and a fallocated one (size 0, 8 MiB
    // allocated past its end).
    let code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n\
                libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]\n\
                with open('sparse', 'wb') as f:\n    f.truncate(64 << 20)\n\
                fd = os.open('pre', os.O_WRONLY | os.O_CREAT, 0o644)\nassert libc.fallocate(fd, 1, 0, 8 << 20) == 0\n\
                os.close(fd)\nopen('plain', 'wb').write(b'z' * 10000)";
    s.ok("default", code).await;
    let listing = ok_call(&s, "list_files", json!({})).await;
    let entry = |name: &str| {
        listing["entries"].as_array().expect("entries").iter().find(|e| e["path"] == name).cloned().expect(name)
    };
    let sparse = entry("sparse");
    assert_eq!(sparse["size"], 64u64 << 20, "{sparse}");
    assert_eq!(sparse["allocated"], 0, "{sparse}");
    let pre = entry("pre");
    assert_eq!(pre["size"], 0, "{pre}");
    assert_eq!(pre["allocated"], 8u64 << 20, "{pre}");
    let plain = entry("plain");
    assert_eq!(plain["size"], 10000, "{plain}");
    assert!(plain["allocated"].as_u64().is_some_and(|a| a >= 10000), "{plain}");
    // The text says both as well.
    let r = s.call("list_files", json!({})).await;
    assert!(text(&r).contains("file\t0\t8388608\tpre"), "{}", text(&r));
    s.stop().await;
}
