//! The records a server leaves in its state dir for the next one, as they are on disk.
//!
//! The JSON layout is the one earlier versions wrote (field names and flattening unchanged),
//! so a server of this version adopts what one of the previous version left.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

/// What both records of a session keep: [`Running`] of a running session, and [`Sleeper`]
/// of a hibernated one.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct About {
    /// The instance its container is labelled with.
    pub(crate) instance: String,
    pub(crate) principal: String,
    pub(crate) name: String,
    pub(crate) environment: String,
    pub(crate) image: String,
    pub(crate) container: String,
    pub(crate) volume: String,
    pub(crate) uid: u32,
    /// The sets on its path, attached again to every new interpreter.
    #[serde(default)]
    pub(crate) layers: Vec<crate::packages::Layer>,
    pub(crate) packages: Vec<String>,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) python: String,
}

/// What a server needs to take a running session over (`sessions/<container>.json`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Running {
    #[serde(flatten)]
    pub(crate) about: About,
    /// The agent's pid when the record was written (0: unknown).
    pub(crate) pid: u32,
    /// Its egress, if it has any.
    #[serde(default)]
    pub(crate) egress: Option<Egress>,
}

/// A session's egress as its record keeps it: header values are not kept (they come from the
/// adopting server's config, by environment and host), nor the CA (a new one each start).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Egress {
    /// Its own network (labelled with the instance that made it).
    pub(crate) network: String,
    /// The proxy's address there, which the session's proxy variables name.
    pub(crate) proxy_ip: std::net::IpAddr,
    /// The allow-list in force, `set_network` narrowing included.
    pub(crate) allow: Vec<String>,
}

/// A hibernated session (`sleepers/<snapshot volume>.json`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Sleeper {
    #[serde(flatten)]
    pub(crate) about: About,
    /// Unix ms of its last use: its TTL runs from there.
    pub(crate) last_used_ms: u64,
    pub(crate) saved: SavedRecord,
    /// The allow-list in force when it slept, if it had egress (header values and the CA are
    /// never kept: they come from the adopting server).
    #[serde(default)]
    pub(crate) egress: Option<Vec<String>>,
}

/// A snapshot of the catalogue (`snapshots/<volume>.json`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Snap {
    /// The instance its volume is labelled with.
    pub(crate) instance: String,
    pub(crate) principal: String,
    pub(crate) name: String,
    pub(crate) session: String,
    pub(crate) saved: SavedRecord,
}

/// A snapshot, as stored in a record (`session::snapshot::Saved` converts to and from it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SavedRecord {
    pub(crate) volume: String,
    pub(crate) environment: String,
    pub(crate) requirements: Vec<String>,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) files: u64,
    pub(crate) workspace_bytes: u64,
    pub(crate) state_bytes: u64,
    pub(crate) skipped: u64,
    pub(crate) meta: Option<Vec<u8>>,
    pub(crate) sizes: HashMap<String, u64>,
    pub(crate) digests: HashMap<String, u64>,
    /// Stored by the packer, volume to volume: it must be restored the same way (absent in
    /// records written before the packer: those were streamed).
    #[serde(default)]
    pub(crate) packed: bool,
    /// Whether globals were saved (grade `files+globals`).
    pub(crate) globals: bool,
    pub(crate) saved: Vec<String>,
    pub(crate) lost: Vec<(String, String)>,
    pub(crate) took_ms: u64,
}
