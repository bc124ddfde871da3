//! Quota use against quota (issue 32): scrape-time gauges per principal and quota. Only the
//! principals the operator's configuration names get series (a set the operator bounds), never
//! one a caller brings (an OAuth subject under the `"*"` default, say): those are refused with
//! a tool error and audited, not listed here.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// One principal's use of one quota at a scrape.
#[derive(Debug, Clone)]
pub(crate) struct QuotaRow {
    /// A principal named in the configuration.
    pub(crate) principal: String,
    /// `cpu_seconds`, `run_seconds`, `egress_bytes` (per UTC day), `snapshot_bytes`, `sessions`.
    pub(crate) quota: &'static str,
    /// What it uses now (today, for the daily ones).
    pub(crate) used: f64,
    /// Its limit, when it has one.
    pub(crate) limit: Option<f64>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    principal: String,
    quota: &'static str,
}

type Gauges = Family<QuotaLabels, Gauge<f64, AtomicU64>>;

/// `pyberth_quota_used` and `pyberth_quota_limit`.
#[derive(Debug, Clone)]
pub(crate) struct QuotaGauges {
    used: Gauges,
    limit: Gauges,
}

impl QuotaGauges {
    pub(crate) fn new(m: &super::Metrics) -> Self {
        Self {
            used: m.family(
                "quota_used",
                "Use of each quota by principals the configuration names (daily ones: today, UTC)",
            ),
            limit: m.family("quota_limit", "Each quota of principals the configuration names"),
        }
    }

    /// The gauges from `rows`, replacing the last scrape's.
    pub(crate) fn set(&self, rows: &[QuotaRow]) {
        self.used.clear();
        self.limit.clear();
        for r in rows {
            let labels = QuotaLabels { principal: r.principal.clone(), quota: r.quota };
            self.used.get_or_create(&labels).set(r.used);
            if let Some(limit) = r.limit {
                self.limit.get_or_create(&labels).set(limit);
            }
        }
    }
}
