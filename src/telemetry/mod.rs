//! Logs and traces: the `tracing` subscriber (log lines on stderr) and, opt-in, OpenTelemetry
//! spans exported over OTLP/HTTP (issue 32 item 2).
//!
//! Only spans of target [`TARGET`] are exported, and only their declared fields become
//! attributes: log events never do, so no message (which may quote a run's output) leaves
//! the host. Those spans are kept out of the log lines; the request's log span carries the
//! `trace_id`/`span_id` that join the two (issue 31 item 4).

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

mod export;
pub mod traceparent;

pub use traceparent::TraceParent;

/// The target of the spans that are exported (and of nothing else).
pub const TARGET: &str = "pyberth::otel";

/// Spans waiting for export at most: past it the SDK drops new ones (and counts them).
const QUEUE: usize = 2048;
/// How long a stopping server waits for the last spans to reach the collector.
const FLUSH_DEADLINE: Duration = Duration::from_secs(5);

tokio::task_local! {
    /// Set while an MCP request is served: engine calls make spans only inside one, so the
    /// pool keeper and the reaper start no traces of their own.
    static IN_REQUEST: ();
}

/// Runs `f` as (part of) an MCP request: engine calls inside it get client spans.
pub async fn in_request<F: std::future::Future>(f: F) -> F::Output {
    IN_REQUEST.scope((), f).await
}

/// Whether the calling task serves an MCP request (see [`in_request`]).
pub fn serving_request() -> bool {
    IN_REQUEST.try_with(|()| ()).is_ok()
}

/// A client span for a call to the Docker engine, or a disabled span outside a request.
pub fn engine_span(operation: &'static str) -> tracing::Span {
    if serving_request() {
        tracing::info_span!(target: TARGET, "engine", otel.name = operation, otel.kind = "client")
    } else {
        tracing::Span::none()
    }
}

/// An internal span for one step of a request that matters (open, run, install, snapshot).
pub fn step_span(name: &'static str) -> tracing::Span {
    tracing::info_span!(target: TARGET, "step", otel.name = name, otel.kind = "internal")
}

/// The installed subscriber; holds the exporter when traces are on.
#[derive(Debug, Default)]
#[must_use = "call shutdown() to flush the last spans"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Installs the global subscriber: log lines filtered by `filter` on stderr and, with an
    /// OTLP traces URL, the exporter (its POSTs run on `runtime`).
    pub fn install(
        filter: tracing_subscriber::EnvFilter,
        otlp: Option<&str>,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Self, String> {
        // Exported spans are not log lines (their fields are the request span's already).
        let filter = match format!("{TARGET}=off").parse() {
            Ok(off) => filter.add_directive(off),
            Err(_) => filter,
        };
        let logs = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            // Colour only for a person at a terminal: logs in files and CI stay plain text.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_filter(filter);
        let provider = match otlp {
            Some(url) => Some(provider(url, runtime).map_err(|e| format!("--otlp-endpoint {e}"))?),
            None => None,
        };
        let traces = provider.as_ref().map(|p| {
            tracing_opentelemetry::layer()
                .with_tracer(p.tracer("pyberth"))
                // Source paths, thread names and busy/idle times are not ours to export.
                .with_location(false)
                .with_threads(false)
                .with_tracked_inactivity(false)
                .with_filter(tracing_subscriber::filter::filter_fn(|m| m.is_span() && m.target() == TARGET))
        });
        tracing_subscriber::registry().with(logs).with(traces).init();
        if let Some(url) = otlp {
            tracing::info!(url, "exporting traces over OTLP/HTTP");
        }
        Ok(Self { provider })
    }

    /// Flushes the spans still queued (within a deadline) and stops the exporter. Call it
    /// while the runtime still runs: the last POSTs are made on it.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(e) = provider.shutdown_with_timeout(FLUSH_DEADLINE)
        {
            tracing::warn!(error = %e, "traces not flushed");
        }
    }
}

fn provider(url: &str, runtime: &tokio::runtime::Handle) -> Result<SdkTracerProvider, String> {
    let exporter = export::OtlpHttp::new(traces_url(url)?, runtime.clone())?;
    let batches = BatchSpanProcessor::builder(exporter)
        .with_batch_config(BatchConfigBuilder::default().with_max_queue_size(QUEUE).build())
        .build();
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_service_name("pyberth")
        .with_attribute(opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    Ok(SdkTracerProvider::builder().with_span_processor(batches).with_resource(resource).build())
}

/// The URL spans are POSTed to: an endpoint given without a path gets OTLP's `/v1/traces`
/// (as `OTEL_EXPORTER_OTLP_ENDPOINT` does); one with a path is used as it is.
pub fn traces_url(endpoint: &str) -> Result<String, String> {
    let url = reqwest::Url::parse(endpoint).map_err(|e| format!("{endpoint:?}: {e}"))?;
    if url.scheme() != "http" {
        return Err(format!("{endpoint:?}: only http:// is supported (send to a local collector or agent)"));
    }
    if url.host_str().is_none() || !url.username().is_empty() || url.password().is_some() {
        return Err(format!("{endpoint:?}: needs a host and no user or password"));
    }
    Ok(match url.path() {
        "" | "/" => format!("{}v1/traces", url.as_str()),
        _ => url.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_gets_the_traces_path_only_when_it_has_none() {
        assert_eq!(traces_url("http://127.0.0.1:4318").as_deref(), Ok("http://127.0.0.1:4318/v1/traces"));
        assert_eq!(traces_url("http://collector:4318/").as_deref(), Ok("http://collector:4318/v1/traces"));
        assert_eq!(traces_url("http://c:4318/custom/traces").as_deref(), Ok("http://c:4318/custom/traces"));
        assert!(traces_url("https://c:4318").is_err());
        assert!(traces_url("http://user:pw@c:4318").is_err());
        assert!(traces_url("not a url").is_err());
    }
}
