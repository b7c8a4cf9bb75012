//! Whether a connect the request started was still under way when the route's timeout
//! ended the request. The route's timer, not the connect timeout, stopped it then, and a
//! route timeout below the connect timeout would otherwise hide an endpoint that drops
//! connection attempts from ejection for good.
//!
//! The watch travels as a task-local: HTTP/1.1 connects happen inside hyper-util's pooled
//! client, which calls the connector ([`Watched`]) from within the request's future.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Uri;

tokio::task_local! {
    static WATCH: Arc<ConnectWatch>;
}

#[derive(Debug, Default)]
pub(super) struct ConnectWatch {
    /// Connects started under the watch that have not ended. A connect dropped unfinished
    /// (the request's future was) stays counted: it did not connect.
    unfinished: AtomicU32,
}

impl ConnectWatch {
    /// Runs `exchange`, counting the connects it starts.
    pub(super) async fn over<F: Future>(self: &Arc<Self>, exchange: F) -> F::Output {
        WATCH.scope(self.clone(), exchange).await
    }

    pub(super) fn connecting(&self) -> bool {
        self.unfinished.load(Ordering::Relaxed) > 0
    }
}

/// `connect`, counted by the watch of the exchange it runs for, if any.
pub(super) fn watched<F: Future>(connect: F) -> impl Future<Output = F::Output> {
    let watch = WATCH.try_with(Arc::clone).ok();
    if let Some(watch) = &watch {
        watch.unfinished.fetch_add(1, Ordering::Relaxed);
    }
    async move {
        let connected = connect.await;
        if let Some(watch) = watch {
            watch.unfinished.fetch_sub(1, Ordering::Relaxed);
        }
        connected
    }
}

/// A connector whose connects the watch counts.
#[derive(Clone)]
pub(crate) struct Watched<C>(pub(super) C);

impl<C> tower_service::Service<Uri> for Watched<C>
where
    C: tower_service::Service<Uri>,
    C::Future: Send + 'static,
{
    type Response = C::Response;
    type Error = C::Error;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, C::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, destination: Uri) -> Self::Future {
        Box::pin(watched(self.0.call(destination)))
    }
}
