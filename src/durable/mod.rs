//! Everything that outlives a server, in its state dir (docs/design.md D12): the records of
//! sessions, hibernated sessions, snapshots, background runs and layer use.
//!
//! [`ledger::Ledger`] is the only writer of those records; [`records`] is their on-disk form.
//! `crate::state_dir` stays the low-level file layer (never through a symlink).

pub(crate) mod catalogue;
pub(crate) mod jobs;
pub(crate) mod layer_use;
pub(crate) mod ledger;
pub(crate) mod records;
