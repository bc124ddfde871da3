//! The session pod, field by field against the hardening list of docs/kubernetes.md.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};

use super::*;
use crate::docker::container::{NetworkJoin, Sandboxing};
use crate::docker::identity::UidRange;

fn spec() -> Spec {
    Spec {
        memory_mb: 512,
        cpus: 1.5,
        pids: 256,
        tmp_mb: 64,
        workspace_mb: Some(200),
        uid_range: UidRange::default(),
        sandboxing: Sandboxing::default(),
        mounts: Vec::new(),
        network: None,
        orphan_after: std::time::Duration::from_secs(600),
    }
}

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("pyberth.managed".to_owned(), "true".to_owned()),
        ("pyberth.session".to_owned(), "s1".to_owned()),
        ("pyberth.owner".to_owned(), "alice@example.com".to_owned()),
    ])
}

fn make(spec: &Spec, settings: &PodSettings) -> Pod {
    pod(spec, settings, "pyberth-python:1", "pyberth-i-s1-0", 10_123, &labels()).expect("a pod")
}

fn parts(p: &Pod) -> (&PodSpec, &Container) {
    let s = p.spec.as_ref().expect("spec");
    assert_eq!(s.containers.len(), 1, "one container, no sidecar");
    (s, &s.containers[0])
}

#[test]
fn runs_as_the_code_uid_never_root() {
    let p = make(&spec(), &PodSettings::default());
    let (s, c) = parts(&p);
    let ps = s.security_context.as_ref().expect("pod security");
    assert_eq!(ps.run_as_user, Some(10_123));
    assert_eq!(ps.run_as_group, Some(10_123));
    assert_eq!(ps.fs_group, Some(10_123));
    assert_eq!(ps.run_as_non_root, Some(true));
    let cs = c.security_context.as_ref().expect("container security");
    assert_eq!(cs.run_as_user, Some(10_123));
    assert_eq!(cs.run_as_non_root, Some(true));
}

#[test]
fn no_privilege_no_capabilities_read_only_root() {
    let p = make(&spec(), &PodSettings::default());
    let cs = parts(&p).1.security_context.clone().expect("container security");
    assert_eq!(cs.allow_privilege_escalation, Some(false));
    assert_eq!(cs.privileged, Some(false));
    assert_eq!(cs.read_only_root_filesystem, Some(true));
    let caps = cs.capabilities.expect("capabilities");
    assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]));
    assert_eq!(caps.add, None);
}

#[test]
fn seccomp_runtime_default_or_our_localhost_profile() {
    let p = make(&spec(), &PodSettings::default());
    let (s, c) = parts(&p);
    for profile in [
        s.security_context.as_ref().and_then(|x| x.seccomp_profile.clone()),
        c.security_context.as_ref().and_then(|x| x.seccomp_profile.clone()),
    ] {
        let profile = profile.expect("a seccomp profile");
        assert_eq!(profile.type_, "RuntimeDefault");
        assert_eq!(profile.localhost_profile, None);
    }
    let settings = PodSettings { seccomp: Seccomp::Localhost("pyberth/seccomp.json".into()), ..Default::default() };
    let p = make(&spec(), &settings);
    let profile = parts(&p).1.security_context.clone().and_then(|x| x.seccomp_profile).expect("profile");
    assert_eq!(profile.type_, "Localhost");
    assert_eq!(profile.localhost_profile.as_deref(), Some("pyberth/seccomp.json"));
}

#[test]
fn no_service_account_token_no_host_namespaces_no_service_links() {
    let p = make(&spec(), &PodSettings::default());
    let s = parts(&p).0;
    assert_eq!(s.automount_service_account_token, Some(false));
    assert_eq!(s.enable_service_links, Some(false));
    assert_eq!(s.host_network, Some(false));
    assert_eq!(s.host_pid, Some(false));
    assert_eq!(s.host_ipc, Some(false));
    assert_eq!(s.share_process_namespace, Some(false));
    assert_eq!(s.restart_policy.as_deref(), Some("Never"));
}

#[test]
fn limits_equal_requests_from_the_spec() {
    let settings = PodSettings { ephemeral_mb: 1024, ..Default::default() };
    let p = make(&spec(), &settings);
    let r = parts(&p).1.resources.clone().expect("resources");
    let limits = r.limits.expect("limits");
    assert_eq!(limits["memory"].0, "512Mi");
    assert_eq!(limits["cpu"].0, "1500m");
    assert_eq!(limits["ephemeral-storage"].0, "1024Mi");
    assert_eq!(r.requests, Some(limits), "Guaranteed QoS");
}

#[test]
fn workspace_tmp_and_shm_are_memory_backed_and_bounded() {
    let p = make(&spec(), &PodSettings::default());
    let (s, c) = parts(&p);
    let volumes = s.volumes.clone().expect("volumes");
    let size = |name: &str| {
        let v = volumes.iter().find(|v| v.name == name).unwrap_or_else(|| panic!("volume {name}"));
        let d = v.empty_dir.clone().expect("an emptyDir");
        assert_eq!(d.medium.as_deref(), Some("Memory"), "{name} is memory-backed");
        d.size_limit.expect("a size limit").0
    };
    assert_eq!(size("workspace"), "200Mi");
    assert_eq!(size("tmp"), "64Mi");
    assert_eq!(size("shm"), "64Mi");
    assert_eq!(volumes.len(), 3, "no other volume: {volumes:?}");
    let mounts: Vec<(String, String)> =
        c.volume_mounts.clone().expect("mounts").into_iter().map(|m| (m.name, m.mount_path)).collect();
    assert!(mounts.contains(&("workspace".into(), "/workspace".into())));
    assert!(mounts.contains(&("tmp".into(), "/tmp".into())));
    assert!(mounts.contains(&("shm".into(), "/dev/shm".into())));
    // Without a workspace bound of its own, the memory limit bounds it.
    let p = make(&Spec { workspace_mb: None, ..spec() }, &PodSettings::default());
    let v = parts(&p).0.volumes.clone().expect("volumes");
    assert_eq!(v[0].empty_dir.clone().and_then(|d| d.size_limit).map(|q| q.0).as_deref(), Some("512Mi"));
}

#[test]
fn runtime_class_from_the_settings() {
    let p = make(&spec(), &PodSettings::default());
    assert_eq!(parts(&p).0.runtime_class_name, None);
    let settings = PodSettings { runtime_class: Some("gvisor".into()), ..Default::default() };
    let p = make(&spec(), &settings);
    assert_eq!(parts(&p).0.runtime_class_name.as_deref(), Some("gvisor"));
}

#[test]
fn labels_valid_and_network_label_follows_egress() {
    let p = make(&spec(), &PodSettings::default());
    let l = p.metadata.labels.clone().expect("labels");
    assert!(l.values().all(|v| crate::k8s::labels::is_valid_value(v)), "{l:?}");
    assert_eq!(l["pyberth.session"], "s1");
    assert_eq!(l[LABEL_SANDBOX], "true");
    assert_eq!(l[LABEL_EGRESS], "none");
    let a = p.metadata.annotations.clone().expect("annotations");
    assert_eq!(a["pyberth.io/original-pyberth.owner"], "alice@example.com");
    let join = NetworkJoin { network: "n".into(), dns: vec![], env: vec!["HTTP_PROXY=http://proxy:3128".into()] };
    let p = make(&Spec { network: Some(join), ..spec() }, &PodSettings::default());
    assert_eq!(p.metadata.labels.clone().expect("labels")[LABEL_EGRESS], "proxy");
    let env = parts(&p).1.env.clone().expect("env");
    assert!(env.iter().any(|e| e.name == "HTTP_PROXY" && e.value.as_deref() == Some("http://proxy:3128")));
}

#[test]
fn fixed_environment_command_and_no_stdin() {
    let p = make(&spec(), &PodSettings::default());
    let c = parts(&p).1;
    assert_eq!(c.name, "sandbox");
    assert_eq!(c.command, Some(vec!["sleep".to_owned(), "infinity".to_owned()]));
    assert_eq!(c.working_dir.as_deref(), Some("/workspace"));
    assert_eq!(c.stdin, Some(false));
    assert_eq!(c.tty, Some(false));
    let env = c.env.clone().expect("env");
    assert!(env.iter().any(|e| e.name == "HOME" && e.value.as_deref() == Some("/workspace")));
    assert!(env.iter().any(|e| e.name == "PYBERTH_ORPHAN_AFTER_S" && e.value.as_deref() == Some("600")));
    assert_eq!(env.len(), ENV.len() + CACHE_ENV.len() + 1);
}

#[test]
fn host_mounts_are_refused_not_dropped() {
    let s = Spec { mounts: vec![crate::docker::container::read_only_bind(std::path::Path::new("/x"), "/y")], ..spec() };
    let e = pod(&s, &PodSettings::default(), "img", "n", 10_000, &labels()).expect_err("refused");
    assert!(e.to_string().contains("host folders"), "{e}");
}

// Attack view: a template someone loosened after we made it; the pod it gives is not used.
#[test]
fn a_weakened_pod_is_said_not_hardened() {
    let ours = make(&spec(), &PodSettings::default());
    assert_eq!(hardened(ours.spec.as_ref().expect("spec")), Ok(()));
    type Weaken = fn(&mut PodSpec);
    let weakenings: [(&str, Weaken); 9] = [
        ("token", |s| s.automount_service_account_token = Some(true)),
        ("host network", |s| s.host_network = Some(true)),
        ("root", |s| s.security_context.as_mut().expect("psc").run_as_user = Some(0)),
        ("escalation", |s| {
            s.containers[0].security_context.as_mut().expect("sc").allow_privilege_escalation = Some(true)
        }),
        ("privileged", |s| s.containers[0].security_context.as_mut().expect("sc").privileged = Some(true)),
        ("writable root", |s| s.containers[0].security_context.as_mut().expect("sc").read_only_root_filesystem = None),
        ("capabilities", |s| {
            let caps = s.containers[0].security_context.as_mut().expect("sc").capabilities.as_mut().expect("caps");
            caps.add = Some(vec!["SYS_ADMIN".into()]);
        }),
        ("unconfined", |s| {
            let psc = s.security_context.as_mut().expect("psc");
            psc.seccomp_profile.as_mut().expect("seccomp").type_ = "Unconfined".into();
        }),
        ("host path", |s| {
            let v = k8s_openapi::api::core::v1::Volume {
                name: "node".into(),
                host_path: Some(k8s_openapi::api::core::v1::HostPathVolumeSource { path: "/".into(), type_: None }),
                ..Default::default()
            };
            s.volumes.get_or_insert_default().push(v);
        }),
    ];
    for (what, weaken) in weakenings {
        let mut s = ours.spec.clone().expect("spec");
        weaken(&mut s);
        assert!(hardened(&s).is_err(), "{what}: refused");
    }
}

/// The egress proxy's pod carries the hardening of a sandbox pod (the same check the claimed
/// pods pass), the label the NetworkPolicy lets sandboxes reach, and not the sandbox label
/// (whose default-deny policy would cut it off).
#[test]
fn the_proxy_pod_is_hardened_and_reachable_by_label() {
    let labels = BTreeMap::from([("pyberth.egress".to_owned(), "proxy".to_owned())]);
    let p = proxy_pod(&PodSettings::default(), "pyberth:latest", "pyberth-i1-egress-1", &labels);
    let spec = p.spec.clone().expect("spec");
    assert_eq!(hardened(&spec), Ok(()));
    assert_eq!(spec.automount_service_account_token, Some(false));
    let l = p.metadata.labels.clone().unwrap_or_default();
    assert_eq!(l.get(LABEL_APP).map(String::as_str), Some(PROXY_APP));
    assert!(!l.contains_key(LABEL_SANDBOX), "{l:?}");
    assert_eq!(l.get("pyberth.egress").map(String::as_str), Some("proxy"), "our labels, for the sweeps");
    let c = &spec.containers[0];
    assert_eq!(c.security_context.as_ref().and_then(|s| s.run_as_user), Some(65534));
    assert_eq!(c.command.as_deref(), Some(&["sleep".to_owned(), "infinity".to_owned()][..]), "the proxy is an exec");
}

/// Helper pods (installer, store writer) carry a sandbox pod's hardening; the installer may
/// reach the proxy and has its scratch room; the writer runs as the store's uid with the
/// claim's `sets/` writable; without a claim, no store volume at all.
#[test]
fn helper_pods_are_hardened_and_only_the_writer_writes_the_store() {
    let claimed = PodSettings { layer_claim: Some("pyberth-layers".into()), ephemeral_mb: 256, ..Default::default() };
    let installer = Helper {
        name: "pyberth-i1-install-1".into(),
        image: "pyberth-sandbox:x".into(),
        uid: 1_879_048_300,
        env: vec!["PB_UV=uv".into(), "not a variable".into()],
        memory_mb: 2048,
        cpus: None,
        tmp_mb: 1024,
        scratch: vec![("/workspace".into(), 4096)],
        egress: true,
        ..Default::default()
    };
    let p = helper_pod(&claimed, &installer);
    let spec = p.spec.clone().expect("spec");
    assert_eq!(hardened(&spec), Ok(()));
    let labels = p.metadata.labels.clone().unwrap_or_default();
    assert_eq!((labels[LABEL_SANDBOX].as_str(), labels[LABEL_EGRESS].as_str()), ("true", "proxy"));
    assert!(!uses_store(&p), "the installer never mounts the store");
    let c = &spec.containers[0];
    let limits = c.resources.as_ref().and_then(|r| r.limits.clone()).unwrap_or_default();
    assert_eq!(limits.get("ephemeral-storage").map(|q| q.0.as_str()), Some("4352Mi"), "its scratch room counted");
    assert!(!limits.contains_key("cpu"), "wheels only: every core");
    assert_eq!(c.env.as_ref().map(Vec::len), Some(1), "only KEY=value strings");
    assert_eq!(c.command.as_deref(), Some(&["sleep".to_owned(), "infinity".to_owned()][..]), "its command is an exec");

    let writer = Helper {
        uid: STORE_UID,
        store: Some(StoreMount { path: "/store".into(), sub_path: Some(STORE_SETS.into()), writable: true }),
        ..installer.clone()
    };
    let p = helper_pod(&claimed, &writer);
    let spec = p.spec.clone().expect("spec");
    assert_eq!(hardened(&spec), Ok(()));
    let v = spec.volumes.iter().flatten().find_map(|v| v.persistent_volume_claim.clone()).expect("the claim");
    assert_eq!((v.claim_name.as_str(), v.read_only), ("pyberth-layers", Some(false)));
    let m = spec.containers[0].volume_mounts.iter().flatten().find(|m| m.mount_path == "/store").expect("mounted");
    assert_eq!((m.sub_path.as_deref(), m.read_only), (Some("sets"), Some(false)));
    assert_eq!(spec.security_context.as_ref().and_then(|s| s.fs_group), Some(i64::from(STORE_UID)));
    assert!(!uses_store(&helper_pod(&PodSettings::default(), &writer)), "no claim, no store");

    // A session pod mounts `sets/` read-only, in the source too (no fsGroup change of the store).
    let mut session = pod(&self::spec(), &claimed, "img", "s", 1_879_048_301, &BTreeMap::new()).expect("pod");
    with_store(&mut session, "pyberth-layers", "/opt/pyberth/layers");
    let s = session.spec.expect("spec");
    let v = s.volumes.iter().flatten().find_map(|v| v.persistent_volume_claim.clone()).expect("the claim");
    assert_eq!(v.read_only, Some(true));
    let m = s.containers[0].volume_mounts.iter().flatten().find(|m| m.name == "layers").expect("mounted");
    assert_eq!((m.sub_path.as_deref(), m.read_only), (Some("sets"), Some(true)));
}
