//! The hostile-tar rulebook shared by uploads, dependency layers and snapshots: pure checks on
//! what an archive from a sandbox names, with no I/O (every byte out of a sandbox is hostile).

/// A relative path with no `..`, root or prefix components: it stays inside the directory it
/// is unpacked into.
pub fn safe_relative(p: &std::path::Path) -> bool {
    p.components().all(|c| matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir))
}
