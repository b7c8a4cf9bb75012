//! Whether a connect the request started was still under way when the route's timeout
//! ended the request. The route's timer, not the connect timeout, stopped it then, and a
//! route timeout below the connect timeout would otherwise hide an endpoint that drops
//! connection attempts from ejection for good.
//!
//! The watch travels as a task-local: HTTP/1.1 connects happen inside the pooled client
//! ([`super::Http1`]), which wraps them in [`watched`] within the request's future.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

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
    /// Runs `exchange`, counting the connects it starts. Not an `async fn`: one would hold
    /// `exchange` twice, as its argument and inside the scope (rust-lang/rust#62958).
    pub(super) fn over<F: Future>(self: &Arc<Self>, exchange: F) -> impl Future<Output = F::Output> + use<F> {
        WATCH.scope(self.clone(), exchange)
    }

    pub(super) fn connecting(&self) -> bool {
        self.unfinished.load(Ordering::Relaxed) > 0
    }
}

/// `connect`, counted by the watch of the exchange it runs for, if any, for as long as that
/// exchange waits on it.
pub(super) fn watched<F: Future>(connect: F) -> Watching<F> {
    let watch = WATCH.try_with(Arc::clone).ok();
    if let Some(watch) = &watch {
        watch.unfinished.fetch_add(1, Ordering::Relaxed);
    }
    Watching {
        connect: Box::pin(connect),
        watch,
    }
}

pub(super) struct Watching<F> {
    connect: Pin<Box<F>>,
    watch: Option<Arc<ConnectWatch>>,
}

impl<F> Watching<F> {
    fn release(&mut self) {
        if let Some(watch) = self.watch.take() {
            watch.unfinished.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<F: Future> Future for Watching<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let connected = std::task::ready!(self.connect.as_mut().poll(cx));
        self.release();
        Poll::Ready(connected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connect_counts_while_its_exchange_waits_on_it() {
        let watch = Arc::new(ConnectWatch::default());
        watch
            .over(async {
                let connect = watched(async {});
                assert!(WATCH.with(|watch| watch.connecting()), "counted while it runs");
                connect.await;
            })
            .await;
        assert!(!watch.connecting(), "finished");

        // Cut short by the route's timer: the exchange's future, the connect with it, is
        // dropped unfinished.
        let cut = WATCH.sync_scope(watch.clone(), || watched(std::future::pending::<()>()));
        drop(cut);
        assert!(watch.connecting(), "dropped unfinished: it did not connect");
    }
}
