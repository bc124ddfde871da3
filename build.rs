//! Compiles the sandbox's relay (images/python/relay.rs) into a static binary that the server
//! carries into the sandbox image (src/docker/image.rs): one file of the standard library,
//! built by this build's own `rustc` for this build's target, optimised whatever the profile
//! (it runs in every session). Static, so it runs on whatever C library the image's base has.
//! For a target that is not x86_64 or aarch64 Linux the relay is empty, and the image has none.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "images/python/relay.rs";
    println!("cargo:rerun-if-changed={src}");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("relay");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    if os != "linux" || !matches!(arch.as_str(), "x86_64" | "aarch64") {
        // No relay for this target: the image keeps none, and keeper.py relays (its relay()).
        std::fs::write(&out, b"").expect("OUT_DIR is writable");
        return;
    }
    let status = Command::new(rustc)
        .args(["--edition", "2024", "--crate-name", "pyberth_relay", "--target", &target])
        .args(["-C", "opt-level=3", "-C", "panic=abort", "-C", "codegen-units=1", "-C", "strip=symbols"])
        .args(["-C", "target-feature=+crt-static", "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .expect("rustc runs");
    assert!(status.success(), "cannot compile {src}");
}
