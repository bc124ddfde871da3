//! The OTLP/HTTP span exporter: batches from the SDK's batch processor, encoded with the
//! official OpenTelemetry protobufs and POSTed with the reqwest already in our tree (rmcp's
//! HTTP client), so the exporter adds no second HTTP stack.
//!
//! A collector that is slow or down costs spans, never the server: each POST has a deadline,
//! a failed batch is dropped and counted, and the count is logged at most once a minute.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use prost::Message as _;

/// How long one POST may take: the batch thread waits for it, and spans queue behind it.
const POST_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a collector that keeps failing is reported.
const REPORT_EVERY: Duration = Duration::from_secs(60);

/// Spans to an OTLP/HTTP (protobuf) receiver.
#[derive(Debug)]
pub(super) struct OtlpHttp {
    url: String,
    client: reqwest::Client,
    /// The SDK calls `export` on its own thread, outside tokio: the POST runs on our runtime.
    runtime: tokio::runtime::Handle,
    resource: ResourceAttributesWithSchema,
    dropped: AtomicU64,
    last_report: Mutex<Option<Instant>>,
}

impl OtlpHttp {
    pub(super) fn new(url: String, runtime: tokio::runtime::Handle) -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .timeout(POST_TIMEOUT)
            // The collector is configured by the operator; a redirect elsewhere is not followed.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("cannot build the OTLP client: {e}"))?;
        Ok(Self {
            url,
            client,
            runtime,
            resource: ResourceAttributesWithSchema::default(),
            dropped: AtomicU64::new(0),
            last_report: Mutex::new(None),
        })
    }

    /// Counts a lost batch; says so on the first loss and then at most once per [`REPORT_EVERY`].
    fn lost(&self, spans: usize, why: &str) {
        let total = self.dropped.fetch_add(spans as u64, Ordering::Relaxed) + spans as u64;
        let Ok(mut last) = self.last_report.lock() else { return };
        if last.is_none_or(|t| t.elapsed() >= REPORT_EVERY) {
            *last = Some(Instant::now());
            tracing::warn!(url = %self.url, dropped_spans = total, "OTLP export failed, spans dropped: {why}");
        }
    }
}

impl SpanExporter for OtlpHttp {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let count = batch.len();
        let body =
            ExportTraceServiceRequest { resource_spans: group_spans_by_resource_and_scope(batch, &self.resource) }
                .encode_to_vec();
        let (client, url) = (self.client.clone(), self.url.clone());
        // Built inside the task: reqwest's request arms its timer on creation, which needs
        // the runtime (this thread is the SDK's, not tokio's).
        let post = async move {
            client.post(url).header(reqwest::header::CONTENT_TYPE, "application/x-protobuf").body(body).send().await
        };
        let outcome = match self.runtime.spawn(post).await {
            Ok(Ok(r)) if r.status().is_success() => Ok(()),
            Ok(Ok(r)) => Err(format!("the collector answered {}", r.status())),
            Ok(Err(e)) => Err(e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        // The loss is ours to count and report: an error back to the SDK would log every batch.
        if let Err(why) = outcome {
            self.lost(count, &why);
        }
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        let dropped = self.dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            tracing::warn!(dropped_spans = dropped, "OTLP export lost spans while the server ran");
        }
        Ok(())
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.resource = resource.into();
    }
}
