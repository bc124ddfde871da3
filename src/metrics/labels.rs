//! Label values, bounded by construction: each label takes a fixed word, a name the operator
//! configured, or "other". Nothing a caller or a sandbox types (session names, hosts, tool
//! names) becomes a label: each distinct value is a series Prometheus keeps for weeks.

use std::collections::{BTreeSet, HashSet};
use std::sync::Mutex;

use prometheus_client::encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder};

/// Distinct principals shown as labels; later ones are counted as "other". Principals come
/// from the operator's tokens file, but a file of thousands would still be thousands of series.
pub(crate) const MAX_PRINCIPALS: usize = 100;

/// The value given to a name outside the known set.
pub(crate) const OTHER: &str = "other";

/// The `principal` label: present only when the operator turned it on (`--metrics-principal`).
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub(crate) struct Who(pub(crate) Option<String>);

impl EncodeLabelSet for Who {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        match &self.0 {
            Some(p) => ("principal", p.as_str()).encode(encoder.encode_label()),
            None => Ok(()),
        }
    }
}

/// Maps names to label values: known names as they are, others to [`OTHER`].
#[derive(Debug, Default)]
pub(crate) struct Bounds {
    /// The environments the operator configured.
    environments: BTreeSet<String>,
    /// The upstream MCP servers the operator configured (code mode).
    upstreams: BTreeSet<String>,
    /// Whether principals are labels at all.
    principals_on: bool,
    /// Principals seen so far, up to [`MAX_PRINCIPALS`].
    principals: Mutex<HashSet<String>>,
}

impl Bounds {
    /// Bounds for these configured names.
    pub(crate) fn new(
        environments: impl IntoIterator<Item = String>,
        upstreams: impl IntoIterator<Item = String>,
        principals_on: bool,
    ) -> Self {
        Self {
            environments: environments.into_iter().collect(),
            upstreams: upstreams.into_iter().collect(),
            principals_on,
            principals: Mutex::default(),
        }
    }

    /// The label value of an environment.
    pub(crate) fn environment(&self, name: &str) -> String {
        known(&self.environments, name)
    }

    /// The label value of an upstream server named in a bridged call (the sandbox's code
    /// names it: a made-up name is "other").
    pub(crate) fn upstream(&self, name: &str) -> String {
        known(&self.upstreams, name)
    }

    /// The principal label: none unless turned on; past [`MAX_PRINCIPALS`] distinct ones, "other".
    pub(crate) fn who(&self, principal: &str) -> Who {
        if !self.principals_on {
            return Who(None);
        }
        let mut seen = self.principals.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(principal) {
            return Who(Some(principal.to_owned()));
        }
        if seen.len() >= MAX_PRINCIPALS {
            return Who(Some(OTHER.to_owned()));
        }
        seen.insert(principal.to_owned());
        Who(Some(principal.to_owned()))
    }
}

fn known(set: &BTreeSet<String>, name: &str) -> String {
    if set.contains(name) { name.to_owned() } else { OTHER.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(who: &Who) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        let family =
            prometheus_client::metrics::family::Family::<Who, prometheus_client::metrics::counter::Counter>::default();
        family.get_or_create(who).inc();
        registry.register("probe", "probe", family);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("encodes");
        out.lines().find(|l| l.starts_with("probe_total")).unwrap_or_default().to_owned()
    }

    #[test]
    fn the_principal_is_no_label_unless_turned_on() {
        let off = Bounds::new([], [], false);
        assert_eq!(off.who("alice"), Who(None));
        assert_eq!(encoded(&off.who("alice")), "probe_total 1");
        let on = Bounds::new([], [], true);
        assert_eq!(encoded(&on.who("alice")), "probe_total{principal=\"alice\"} 1");
    }

    #[test]
    fn principals_past_the_cap_share_one_series() {
        let on = Bounds::new([], [], true);
        for i in 0..MAX_PRINCIPALS {
            assert_eq!(on.who(&format!("p{i}")), Who(Some(format!("p{i}"))));
        }
        assert_eq!(on.who("one-too-many"), Who(Some(OTHER.into())));
        assert_eq!(on.who("p0"), Who(Some("p0".into())), "one seen before keeps its own");
    }

    #[test]
    fn names_outside_the_configuration_are_other() {
        let b = Bounds::new(["default".to_owned(), "data".to_owned()], ["github".to_owned()], false);
        assert_eq!(b.environment("data"), "data");
        assert_eq!(b.environment("made-up"), OTHER);
        assert_eq!(b.upstream("github"), "github");
        // A bridged call names its upstream from inside the sandbox: never a label as typed.
        assert_eq!(b.upstream("evil\"} 1\nfake_metric{x=\""), OTHER);
    }
}
