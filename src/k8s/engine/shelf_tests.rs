use super::*;

fn shelf(tag: &str) -> (Shelf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("pyberth-shelf-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    (Shelf::open(dir.clone()).expect("open"), dir)
}

fn meta() -> Meta {
    Meta {
        labels: HashMap::from([("pyberth.snapshot".to_owned(), "s1".to_owned())]),
        options: HashMap::new(),
        created: "2026-11-26T00:00:00Z".into(),
    }
}

fn tar_of(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, kind, body) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        if *kind == tar::EntryType::Symlink {
            h.set_link_name(std::str::from_utf8(body).expect("utf-8")).expect("link");
            h.set_size(0);
        }
        // Raw names: the builder's own checks would refuse the hostile ones before we could.
        let name = h.as_old_mut().name.as_mut();
        name[..path.len()].copy_from_slice(path.as_bytes());
        h.set_cksum();
        let body: &[u8] = if *kind == tar::EntryType::Symlink { &[] } else { body };
        b.append(&h, body).expect("append");
    }
    b.into_inner().expect("tar")
}

#[test]
fn a_volume_keeps_its_labels_and_files_across_opens() {
    let (s, dir) = shelf("keep");
    s.create("pyberth-i-snap-1", &meta()).expect("create");
    let t = tar_of(&[
        ("state", tar::EntryType::Directory, b""),
        ("state/meta.json", tar::EntryType::Regular, b"{}"),
        ("workspace/a/b.txt", tar::EntryType::Regular, b"hello"),
    ]);
    s.unpack("pyberth-i-snap-1", t.as_slice()).expect("unpack");
    let again = Shelf::open(dir.clone()).expect("reopen");
    assert_eq!(again.list().keys().cloned().collect::<Vec<_>>(), ["pyberth-i-snap-1"]);
    assert_eq!(again.get("pyberth-i-snap-1").expect("there").labels["pyberth.snapshot"], "s1");
    let mut packed = Vec::new();
    again.pack("pyberth-i-snap-1", &mut packed).expect("pack");
    let mut names: Vec<String> = tar::Archive::new(packed.as_slice())
        .entries()
        .expect("entries")
        .map(|e| e.expect("entry").path().expect("path").to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(
        names.contains(&"snap/workspace/a/b.txt".to_owned()) && names.contains(&"snap/state/meta.json".to_owned()),
        "{names:?}"
    );
    assert!(again.remove("pyberth-i-snap-1") && !again.remove("pyberth-i-snap-1"));
    assert!(again.list().is_empty());
    let _ = std::fs::remove_dir_all(dir);
}

// Attack view: a tar that tries to leave the volume, or to write through a link.
#[test]
fn hostile_tars_write_nothing_outside_the_volume() {
    let (s, dir) = shelf("hostile");
    s.create("v", &meta()).expect("create");
    let outside = dir.join("escaped");
    for (what, t) in [
        ("dot-dot", tar_of(&[("../escaped", tar::EntryType::Regular, b"x")])),
        ("absolute", tar_of(&[("/tmp/escaped-abs", tar::EntryType::Regular, b"x")])),
        ("symlink", tar_of(&[("link", tar::EntryType::Symlink, b"..")])),
        ("hardlink", tar_of(&[("hard", tar::EntryType::Link, b"")])),
    ] {
        assert!(s.unpack("v", t.as_slice()).is_err(), "{what} refused");
    }
    assert!(!outside.exists() && !Path::new("/tmp/escaped-abs").exists());
    // A link planted in the data (not by a tar: by anyone with the directory) is not followed.
    std::os::unix::fs::symlink(&dir, dir.join("v/data/planted")).expect("plant");
    let t = tar_of(&[("planted/escaped", tar::EntryType::Regular, b"x")]);
    assert!(s.unpack("v", t.as_slice()).is_err(), "not through a planted link");
    assert!(!outside.exists());
    // Nor is a directory made through it.
    let t = tar_of(&[("planted/made", tar::EntryType::Directory, b"")]);
    assert!(s.unpack("v", t.as_slice()).is_err(), "no directory through a planted link");
    assert!(!dir.join("made").exists(), "a directory made outside the volume");
    // Names that are not one directory below the shelf reach nothing.
    for bad in ["..", ".hidden", "a/b", "", "v/../../x"] {
        assert!(s.create(bad, &meta()).is_err() && s.get(bad).is_none() && !s.remove(bad), "{bad:?}");
    }
    let _ = std::fs::remove_dir_all(dir);
}
