use std::collections::HashMap;

use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType};

use super::seam::split_path;
use super::translate::{ANNOTATION_NAME, container_name, our_labels, pod_name, selector, session_pod};
use crate::docker::seam::matches_labels;
use crate::k8s::pod::PodSettings;

fn body(labels: &[(&str, &str)], mounts: Vec<Mount>, network: &str) -> ContainerCreateBody {
    ContainerCreateBody {
        image: Some("pyberth-sandbox:t".into()),
        labels: Some(labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()),
        env: Some(vec!["PYBERTH_ORPHAN_AFTER_S=42".into()]),
        host_config: Some(HostConfig {
            memory: Some(512 << 20),
            nano_cpus: Some(1_500_000_000),
            pids_limit: Some(128),
            tmpfs: Some(HashMap::from([("/tmp".into(), "rw,nosuid,nodev,size=32m,nr_inodes=16384".into())])),
            network_mode: Some(network.into()),
            mounts: Some(mounts),
            ..Default::default()
        }),
        ..Default::default()
    }
}

const LABELS: [(&str, &str); 4] = [
    ("pyberth.managed", "1"),
    ("pyberth.session", "My Session!"),
    ("pyberth.owner", "alice@example.com"),
    ("pyberth.uid", "1879048200"),
];

#[test]
fn pod_names_are_dns_labels_and_stable() {
    assert_eq!(pod_name("pyberth-i1-s1-3"), "pyberth-i1-s1-3", "a valid name stays");
    for hostile in ["pyberth-i1-My Session!-3", "pyberth-i1-ä-1", &"x".repeat(300), "---", "A_B", "-lead"] {
        let p = pod_name(hostile);
        assert!(p.len() <= 63 && !p.starts_with('-') && !p.ends_with('-'), "{hostile:?} -> {p}");
        assert!(p.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'), "{p}");
        assert_eq!(p, pod_name(hostile), "the same name finds the same pod");
    }
    // Two names that clean alike still get two pods.
    assert_ne!(pod_name("pyberth-a_b"), pod_name("pyberth-a.b"));
}

#[test]
fn a_session_body_becomes_its_pod() {
    let pod =
        session_pod("pyberth-i1-My Session!-3", &body(&LABELS, Vec::new(), "none"), Some(64), &PodSettings::default())
            .expect("a pod");
    assert_eq!(pod.metadata.name.as_deref(), Some(pod_name("pyberth-i1-My Session!-3").as_str()));
    assert_eq!(container_name(&pod), "pyberth-i1-My Session!-3");
    assert_eq!(pod.metadata.annotations.as_ref().expect("notes")[ANNOTATION_NAME], "pyberth-i1-My Session!-3");
    let spec = pod.spec.as_ref().expect("spec");
    assert_eq!(spec.security_context.as_ref().and_then(|s| s.run_as_user), Some(1_879_048_200), "the code's uid");
    let c = &spec.containers[0];
    let limits = c.resources.as_ref().and_then(|r| r.limits.clone()).expect("limits");
    assert_eq!(limits["memory"].0, "512Mi");
    assert_eq!(limits["cpu"].0, "1500m");
    let sizes: HashMap<String, String> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| (v.name.clone(), v.empty_dir.as_ref().and_then(|d| d.size_limit.clone()).expect("size").0))
        .collect();
    assert_eq!(sizes["workspace"], "64Mi", "the workspace volume's size");
    assert_eq!(sizes["tmp"], "32Mi", "the /tmp tmpfs' size");
    let env: Vec<String> =
        c.env.iter().flatten().map(|e| format!("{}={}", e.name, e.value.clone().unwrap_or_default())).collect();
    assert!(env.contains(&"PYBERTH_ORPHAN_AFTER_S=42".to_owned()), "{env:?}");
    // Labels round-trip: the hashed owner and the session name come back as given.
    let back = our_labels(&pod);
    for (k, v) in LABELS {
        assert_eq!(back[k], v, "{k}");
    }
    assert!(!back.keys().any(|k| k.starts_with("pyberth.io/")), "{back:?}");
}

/// A pod made by someone else, annotated to pass for a session of ours: its container-name
/// annotation names another pod, its original-value annotations another principal and
/// instance than its labels hash to. It is read under its own name and labels.
#[test]
fn forged_annotations_do_not_make_a_pod_another_sessions_or_principals() {
    let name = "pyberth-i1-My Session!-3";
    let mut pod =
        session_pod(name, &body(&LABELS, Vec::new(), "none"), Some(64), &PodSettings::default()).expect("a pod");
    // Renamed: its annotation now names a session container whose pod is another.
    pod.metadata.name = Some("planted".into());
    assert_eq!(container_name(&pod), "planted", "an annotation naming another pod is not believed");
    let notes = pod.metadata.annotations.get_or_insert_with(Default::default);
    notes.insert("pyberth.io/original-pyberth.owner".into(), "bob@example.com".into());
    notes.insert("pyberth.io/original-pyberth.instance".into(), "someone-elses".into());
    let back = our_labels(&pod);
    assert_ne!(back["pyberth.owner"], "bob@example.com", "an original that does not hash to the label");
    assert!(back["pyberth.owner"].starts_with("h-"), "the label's own value stays: {back:?}");
    assert!(!back.contains_key("pyberth.instance"), "an annotation adds no label: {back:?}");
    // A pod whose annotation names itself is read as ours.
    pod.metadata.name = Some(pod_name(name));
    assert_eq!(container_name(&pod), name);
}

#[test]
fn what_a_pod_cannot_carry_is_refused_with_a_reason() {
    let bind = Mount {
        target: Some("/data".into()),
        source: Some("/srv/data".into()),
        typ: Some(MountType::BIND),
        ..Default::default()
    };
    let e = session_pod("c", &body(&LABELS, vec![bind], "none"), None, &PodSettings::default()).expect_err("bind");
    assert!(e.to_string().contains("host folders"), "{e}");
    let e = session_pod("c", &body(&LABELS[..3], Vec::new(), "none"), None, &PodSettings::default()).expect_err("uid");
    assert!(e.to_string().contains("uid"), "{e}");
    // The layer store's volume mount is no host folder: it is left out, not refused.
    let store = Mount { target: Some("/opt/store".into()), typ: Some(MountType::VOLUME), ..Default::default() };
    assert!(session_pod("c", &body(&LABELS, vec![store], "none"), None, &PodSettings::default()).is_ok());
}

/// A session network becomes the label the NetworkPolicy lets reach the proxy, and the egress
/// variables the owner added stay, once; the fixed ones are not doubled.
#[test]
fn a_session_network_is_the_egress_label_and_its_variables() {
    let mut b = body(&LABELS, Vec::new(), "pyberth-net-1");
    b.env.get_or_insert_with(Vec::new).extend(["HTTPS_PROXY=http://10.1.2.3:3128".to_owned(), "NO_PROXY=".to_owned()]);
    let pod = session_pod("c", &b, None, &PodSettings::default()).expect("a pod");
    assert_eq!(
        pod.metadata.labels.as_ref().and_then(|l| l.get(crate::k8s::pod::LABEL_EGRESS)).map(String::as_str),
        Some("proxy")
    );
    let env = pod.spec.and_then(|s| s.containers.into_iter().next()).and_then(|c| c.env).unwrap_or_default();
    let named =
        |k: &str| env.iter().filter(|e| e.name == k).map(|e| e.value.clone().unwrap_or_default()).collect::<Vec<_>>();
    assert_eq!(named("HTTPS_PROXY"), vec!["http://10.1.2.3:3128".to_owned()]);
    assert_eq!(named("NO_PROXY"), vec![String::new()]);
    assert_eq!(named("PYBERTH_ORPHAN_AFTER_S"), vec!["42".to_owned()], "the fixed ones once");
    let plain = session_pod("c", &body(&LABELS, Vec::new(), "none"), None, &PodSettings::default()).expect("a pod");
    assert_eq!(
        plain.metadata.labels.as_ref().and_then(|l| l.get(crate::k8s::pod::LABEL_EGRESS)).map(String::as_str),
        Some("none")
    );
}

#[test]
fn label_filters_become_selectors_over_our_pods_only() {
    let filters = HashMap::from([(
        "label".to_owned(),
        vec!["pyberth.managed=1".to_owned(), "pyberth.owner=alice@example.com".to_owned(), "pyberth.uid".to_owned()],
    )]);
    let s = selector(Some(&filters));
    let terms: Vec<&str> = s.split(',').collect();
    assert_eq!(terms.len(), 4, "{s}");
    assert_eq!(terms[0], "pyberth.io/sandbox=true");
    assert!(terms[2].starts_with("pyberth.owner=h-"), "the principal hashed as on the pod: {s}");
    assert_eq!(terms[3], "pyberth.uid");
    let hostile = HashMap::from([("label".to_owned(), vec!["pyberth.session=a,pyberth.managed".to_owned()])]);
    assert_eq!(selector(Some(&hostile)).matches(',').count(), 1, "a value adds no term");
    let labels = HashMap::from([("pyberth.heartbeat".to_owned(), "i1".to_owned())]);
    let beat = HashMap::from([("label".to_owned(), vec!["pyberth.heartbeat=i1".to_owned()])]);
    assert!(matches_labels(&labels, Some(&beat)) && !matches_labels(&HashMap::new(), Some(&beat)));
}

#[test]
fn a_download_path_splits_into_its_directory_and_name() {
    assert_eq!(split_path("/workspace/a/b.txt"), ("/workspace/a".into(), "b.txt".into()));
    assert_eq!(split_path("/workspace/"), ("/".into(), "workspace".into()));
    assert_eq!(split_path("x"), (".".into(), "x".into()));
}

/// Cluster failures reach the caller in the cluster's terms; a missing pod stays a 404 the
/// owners act on.
#[test]
fn cluster_errors_are_said_in_the_clusters_words() {
    use crate::k8s::cluster::Error as C;
    let said = |e: C| crate::docker::Error::Engine(super::from_cluster(e)).to_string();
    let forbidden = said(C::Forbidden { doing: "create pods".into(), namespace: "ns".into(), message: "no".into() });
    assert!(forbidden.contains("deploy/kubernetes/10-rbac.yaml") && forbidden.contains("403 Forbidden"), "{forbidden}");
    let never = said(C::Stopped { pod: "p".into(), phase: "Failed".into() });
    assert_eq!(never, "pod p stopped (phase Failed)");
    for text in [&forbidden, &never] {
        assert!(!text.contains("Docker") && !text.contains("docker"), "{text}");
    }
    let gone = crate::docker::Error::Engine(super::from_cluster(C::Gone("p".into())));
    assert!(gone.is_gone(), "{gone:?}");
    let refused = crate::docker::Error::Engine(super::unsupported("x")).to_string();
    assert!(refused.starts_with("x is not supported on Kubernetes yet"), "{refused}");
}
