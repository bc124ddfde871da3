//! The Kubernetes engine (issue 33): plain Pods, or agent-sandbox claims (`k8s_mode`).
//!
//! - `pod`: the hardened pod spec of a session, mapped from the settings our Docker containers
//!   get (docs/kubernetes.md, the table of /work/shared research §2.4).
//! - `labels`: our labels in the syntax Kubernetes accepts.
//! - `claims`: agent-sandbox mode's objects (template, warm pool, claim) and the check that a
//!   claim's pod is this session's before anything execs into it.
//! - `sandboxes`: those objects on the wire: made, claimed, resolved, listed, released.
//! - `cluster`: the kube-rs client side: create, wait Running, exec (the agent relay over the
//!   pods/exec websocket), list by label, delete; API refusals turned into clear errors.
//! - `engine`: the owners' `Engine` seam over those: session containers as pods (or claims),
//!   execs as pods/exec, volumes as records, the rest refused as not supported yet.
//! - `manifests`: the checked-in `deploy/kubernetes/` files, parsed and checked by the tests.
//! - `render`: `pyberth k8s manifests`, those files for one configuration, with each
//!   environment's agent-sandbox template as the engine makes it.

pub mod claims;
pub mod cluster;
pub mod engine;
pub mod labels;
pub mod manifests;
pub mod pod;
pub mod render;
pub mod sandboxes;

/// The container name inside every session pod (agent-sandbox's convention too).
pub const CONTAINER: &str = "sandbox";
