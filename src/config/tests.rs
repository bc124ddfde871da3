//! Tests of the settings: their checks and the state dir.

use super::*;

#[test]
fn a_state_dir_of_someone_else_or_open_to_others_is_refused() {
    use std::os::unix::fs::PermissionsExt as _;
    let base = std::env::temp_dir().join(format!("pyberth-statedir-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let uid = rustix::process::geteuid().as_raw();
    let fresh = base.join("a/b");
    secure_dir(&fresh, uid).expect("created");
    let mode = std::fs::metadata(&fresh).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    let e = secure_dir(&fresh, uid + 1).expect_err("another user's");
    assert!(e.contains("belongs to uid"), "{e}");
    std::fs::set_permissions(&fresh, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    assert!(secure_dir(&fresh, uid).expect_err("world-writable").contains("others may write"));
    let link = base.join("link");
    std::os::unix::fs::symlink(&fresh, &link).expect("symlink");
    assert!(secure_dir(&link, uid).expect_err("a symlink").contains("not a directory"));
    let _ = std::fs::remove_dir_all(&base);
}

fn parse(args: &[&str]) -> SandboxConfig {
    from_flags(args)
}

#[test]
fn defaults_are_valid() {
    let c = parse(&[]);
    c.validate().expect("defaults");
    assert_eq!(c.timeout_s, 60);
    assert_eq!(c.output_cap, 1 << 20);
    assert_eq!(c.idle_ttl_s, 86400);
    assert_eq!(c.hibernate_after_s, 600);
}

#[test]
fn errors_name_the_flag() {
    let e = parse(&["--memory-mb", "8"]).validate().expect_err("too small");
    assert!(e.to_string().contains("--memory-mb"), "{e}");
    let e = parse(&["--timeout-s", "100", "--max-timeout-s", "10"]).validate().expect_err("max");
    assert!(e.to_string().contains("--max-timeout-s"), "{e}");
    let e = parse(&["--instance", "a b"]).validate().expect_err("instance");
    assert!(e.to_string().contains("--instance"), "{e}");
    let e = parse(&["--fallback-release", "../x"]).validate().expect_err("release");
    assert!(e.to_string().contains("--fallback-release"), "{e}");
}

#[test]
fn egress_dns_takes_up_to_three_addresses_the_proxy_can_reach() {
    let c = parse(&["--egress-dns", "10.0.0.53,2001:db8::53"]);
    c.validate().expect("two addresses");
    assert_eq!(c.egress_dns, ["10.0.0.53", "2001:db8::53"]);
    for bad in ["dns.example.com", "127.0.0.53", "::1", "0.0.0.0", "224.0.0.1", "1.1.1.1,8.8.8.8,9.9.9.9,1.0.0.1"] {
        let e = parse(&["--egress-dns", bad]).validate().expect_err(bad);
        assert!(e.to_string().contains("egress_dns"), "{bad}: {e}");
    }
}
