//! Directories in and out of a session's workspace as tar, so that neither the MCP tools nor
//! `pyberth run` reach the engine themselves: everything a front end does goes through the
//! session.

use std::path::Path;
use std::time::SystemTime;

use super::Session;
use crate::docker::archive::{self, Cap, CopyBack, Moved};

impl Session {
    /// Uploads a host directory as the workspace (without `.git`), at most `cap` bytes.
    pub async fn upload_dir(&self, dir: &Path, cap: Cap) -> Result<Moved, String> {
        archive::upload_dir(&self.docker, &self.container_id(), dir, cap).await
    }

    /// Uploads one file into the workspace; returns its (mtime, size).
    pub async fn upload_file(&self, name: &str, data: &[u8]) -> Result<(u64, u64), String> {
        archive::upload_file(&self.docker, &self.container_id(), name, data).await
    }

    /// Copies the files the run made or changed since `since` into the host directory `out`.
    pub async fn download_changed(
        &self,
        since: SystemTime,
        rules: CopyBack,
        out: &Path,
        cap: Cap,
    ) -> Result<Moved, String> {
        archive::download_changed(&self.docker, &self.container_id(), since, rules, out, cap).await
    }

    /// A workspace file or directory as a tar of its regular files and directories.
    pub async fn download_tree(&self, rel: &str, cap: Cap) -> Result<(Vec<u8>, Moved), String> {
        archive::download_tree(&self.docker, &self.container_id(), rel, cap).await
    }
}
