//! Names and volumes of new sessions, on the fake engine.

use std::collections::HashMap;

use bollard::models::VolumeCreateRequest;

use super::new_volume;
use crate::docker::fake::FakeEngine;

fn request(name: &str, principal: &str) -> VolumeCreateRequest {
    let labels = HashMap::from([("pyberth.principal".to_owned(), principal.to_owned())]);
    VolumeCreateRequest { name: Some(name.into()), labels: Some(labels), ..Default::default() }
}

#[tokio::test]
async fn a_volume_name_taken_by_another_session_is_refused_and_left_as_it_was() {
    let fake = FakeEngine::with_images(&[]);
    new_volume(&fake, request("pyberth-i-main-0", "bob")).await.expect("bob's workspace");
    fake.world().volumes.get_mut("pyberth-i-main-0").expect("made").files.files.insert("secret".into(), b"b".to_vec());

    let refused = new_volume(&fake, request("pyberth-i-main-0", "alice")).await.expect_err("a taken name");
    assert!(refused.to_string().contains("exists already"), "{refused}");
    let w = fake.world();
    let kept = w.volumes.get("pyberth-i-main-0").expect("bob's volume stays");
    assert_eq!(kept.labels.get("pyberth.principal").map(String::as_str), Some("bob"));
    assert!(kept.files.files.contains_key("secret"));
}

#[test]
fn serials_are_new_on_each_call_and_carry_this_process_tag() {
    let (a, b) = (crate::docker::next_serial(), crate::docker::next_serial());
    assert_ne!(a, b);
    assert_eq!(a[..6], b[..6], "one tag per process");
    assert!(a[..6].chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()), "{a}");
    assert!(a[6..].parse::<u64>().is_ok() && b[6..].parse::<u64>().is_ok(), "{a} {b}");
}
