//! Accept loops: HTTP/1.1 and HTTP/2 (prior knowledge) on one port, each connection
//! watched so a drain lets in-flight requests and streams finish.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};

use crate::response::ProxyBody;

/// What a served port does with each request.
pub(crate) trait Handler: Clone + Send + Sync + 'static {
    fn handle(
        &self,
        peer: SocketAddr,
        request: Request<Incoming>,
    ) -> impl Future<Output = Response<ProxyBody>> + Send;
}

/// An accepting listener. Dropping it also stops accepting and starts the drain.
pub(crate) struct RunningListener {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl RunningListener {
    pub(crate) fn spawn<H: Handler>(listener: TcpListener, handler: H, drain_grace: Duration) -> Self {
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(serve(listener, handler, stopped, drain_grace));
        RunningListener { stop, task }
    }

    /// Stops accepting at once; the returned task ends when open connections have finished
    /// or the drain grace has run out and the rest were closed.
    pub(crate) fn drain(self) -> JoinHandle<()> {
        let _ = self.stop.send(());
        self.task
    }
}

async fn serve<H: Handler>(
    listener: TcpListener,
    handler: H,
    mut stopped: oneshot::Receiver<()>,
    drain_grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let local = listener.local_addr().ok();
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Small writes such as single SSE events must not wait for Nagle.
                    let _ = stream.set_nodelay(true);
                    let handler = handler.clone();
                    let service = service_fn(move |request| {
                        let handler = handler.clone();
                        async move { Ok::<_, Infallible>(handler.handle(peer, request).await) }
                    });
                    let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                    let connection = graceful.watch(connection);
                    connections.spawn(async move {
                        if let Err(error) = connection.await {
                            tracing::debug!(%peer, %error, "connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    // Usually out of file descriptors: back off instead of spinning.
                    tracing::warn!(?local, %error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let open = connections.len();
    if tokio::time::timeout(drain_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?local, open, "drain grace elapsed, closing remaining connections");
    }
    connections.shutdown().await;
}
