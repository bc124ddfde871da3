//! Every engine call's failure counted, whatever owner made it: a delegating [`Engine`] the
//! registry wraps its engine in once, so `pyberth_engine_errors_total{op}` sees them all (issue
//! 32). `op` is the trait method's name, a fixed set.
//!
//! Not counted: a 404 (the object is not there: an answer the owners act on, e.g. removing a
//! container that is already gone) and a container's non-zero exit reported by `wait_container`.

use std::sync::Arc;

use futures::StreamExt as _;

use super::types::*;
use super::{Engine, EngineRef};
use crate::metrics::Metrics;

/// An engine whose failed calls are counted into the server's metrics.
#[derive(Debug)]
pub struct Counted {
    inner: EngineRef,
    metrics: Arc<Metrics>,
}

impl Counted {
    /// `inner`, its failures counted into `metrics`.
    pub fn wrap(inner: EngineRef, metrics: Arc<Metrics>) -> EngineRef {
        Arc::new(Self { inner, metrics })
    }

    fn fut<'a, T: Send + 'a>(&'a self, op: &'static str, call: Fut<'a, T>) -> Fut<'a, T> {
        Box::pin(async move {
            let result = call.await;
            if let Err(e) = &result {
                count(&self.metrics, op, e);
            }
            result
        })
    }

    fn items<'a, T: Send + 'a>(&self, op: &'static str, items: Items<'a, T>) -> Items<'a, T> {
        let metrics = self.metrics.clone();
        items
            .inspect(move |item| {
                if let Err(e) = item {
                    count(&metrics, op, e);
                }
            })
            .boxed()
    }
}

fn count(metrics: &Metrics, op: &'static str, e: &Error) {
    match e {
        Error::DockerResponseServerError { status_code: 404, .. } | Error::DockerContainerWaitError { .. } => {}
        _ => metrics.engine_error(op),
    }
}

/// One call of a method: the inner engine's, its failures counted under the method's name.
macro_rules! counting {
    ($this:tt, $name:ident, Fut, ($($arg:ident),*)) => {
        $this.fut(stringify!($name), $this.inner.$name($($arg),*))
    };
    ($this:tt, $name:ident, Items, ($($arg:ident),*)) => {
        $this.items(stringify!($name), $this.inner.$name($($arg),*))
    };
}

forward_engine!(counting => impl Engine for Counted);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::docker::fake::FakeEngine;
    use crate::metrics::Bounds;

    fn errors(metrics: &Metrics, op: &str) -> Option<u64> {
        let text = metrics.encode();
        let prefix = format!("pyberth_engine_errors_total{{op=\"{op}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|n| n.trim().parse().expect("a count"))
    }

    #[tokio::test]
    async fn a_failed_call_is_counted_under_its_method() {
        let metrics = Arc::new(Metrics::new(Bounds::new([], [], false)));
        let engine = Counted::wrap(Arc::new(FakeEngine::with_images(&[])), metrics.clone());
        let net = || NetworkCreateRequest { name: "n1".into(), ..Default::default() };
        engine.create_network(net()).await.expect("a new network");
        assert_eq!(errors(&metrics, "create_network"), None, "a call that worked is no error");
        // The name is taken now: the engine answers 409.
        engine.create_network(net()).await.expect_err("a name taken");
        engine.create_network(net()).await.expect_err("a name taken");
        assert_eq!(errors(&metrics, "create_network"), Some(2));
        // A stream's failed item counts too (the fake engine cannot build).
        let built: Vec<_> = engine.build_image(q::BuildImageOptions::default(), None, None).collect().await;
        assert!(built.iter().any(|b| b.is_err()));
        assert_eq!(errors(&metrics, "build_image"), Some(1));
        // "Not there" is an answer, not a failure.
        engine.remove_container("nobody", None).await.expect_err("no such container");
        assert_eq!(errors(&metrics, "remove_container"), None);
        assert_eq!(errors(&metrics, "create_network"), Some(2), "other ops keep their own counts");
    }
}
