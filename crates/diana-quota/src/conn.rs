//! Connections: what a caller without a credential can hold on either port, bounded.
//!
//! Before a request's `authorization` is read, a stranger can still open connections and
//! send bytes slowly. Each port (the HTTP API, the gRPC port of RLS/RLQS) has its own
//! [`Gate`], and every connection goes through this life:
//!
//! ```text
//!  accepted ──(port full: --max-connections; or its peer full: --max-connections-per-peer)──► closed at once
//!     │ admitted: one place of the port, one of its peer address
//!     ▼
//!  waiting for a request ──(no complete request head within --header-timeout-ms of the
//!     │                     connection's start; HTTP/1: of its previous answer too)──► closed
//!     │  head ≤ 8 KiB and ≤ 32 fields (HTTP/2: header list ≤ 8 KiB), else 431 and closed
//!     ▼
//!  served ──► waiting again (keep-alive)
//!
//!  in any state: no byte read for --idle-timeout-ms ──► closed (HTTP/2 peers answer the
//!  service's pings every 30 s, so a live gateway never idles out); gRPC: at most
//!  --max-connection-age, then a graceful GOAWAY
//!  shutdown: every connection closed gracefully, answers in flight finished
//! ```
//!
//! A place is given back when its connection closes, whatever closed it. The gateways'
//! pooled connections stay usable as long as the gateways close an idle connection before
//! the service would (Envoy's `idle_timeout` on the `diana_quota` cluster, shorter than
//! `--header-timeout-ms`: every bootstrap of this repository sets it).

use crate::metrics::Metrics;
use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// The largest HTTP/1 request head (request line and fields): hyper's smallest read buffer.
/// The API's heads are under 1 KiB.
pub const MAX_HEAD_BYTES: usize = 8192;
/// The most fields in an HTTP/1 request head.
pub const MAX_HEAD_FIELDS: usize = 32;
/// The largest HTTP/2 header list (either port), in bytes.
pub const MAX_HEADER_LIST_BYTES: u32 = 8192;
/// Streams one HTTP/2 connection of the HTTP port may have open at once.
pub const MAX_HTTP2_STREAMS: u32 = 256;
/// How often an HTTP/2 connection is pinged, and how long the answer may take before the
/// connection is closed: a live peer is never idle, a peer that went away (or never
/// answers) does not hold its place.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The bounds of one port's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once on the port; one more is closed at once.
    pub max_connections: usize,
    /// Connections open at once from one peer address; one more is closed at once.
    pub max_per_peer: usize,
    /// HTTP/1: a request head must be complete this long after the connection opened or
    /// its previous answer left (an idle keep-alive connection is closed then too).
    pub header_timeout: Duration,
    /// A connection from which nothing was read for this long is closed.
    pub idle_timeout: Duration,
}

impl ConnectionLimits {
    /// The defaults: 4096 connections a port, 1024 from one address, 10 s for a request
    /// head, 60 s idle.
    pub const DEFAULT: ConnectionLimits = ConnectionLimits {
        max_connections: 4096,
        max_per_peer: 1024,
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(60),
    };
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        ConnectionLimits::DEFAULT
    }
}

/// Which cap closed a connection as soon as it was accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapReached {
    /// The port has `max_connections` open.
    Port,
    /// The peer address has `max_per_peer` open.
    Peer,
}

impl CapReached {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            CapReached::Port => "port",
            CapReached::Peer => "peer",
        }
    }
}

/// The connections of one port: how many are open, per peer address too.
pub struct Gate {
    /// `http` or `grpc`: the metrics' label.
    port: &'static str,
    limits: ConnectionLimits,
    open: Mutex<Open>,
    /// Where its counts go (the service's metrics).
    metrics: Option<Arc<Metrics>>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

impl Gate {
    /// The gate of `port` (`http` or `grpc`); `metrics`: the service's, which count its
    /// connections.
    pub fn new(
        port: &'static str,
        limits: ConnectionLimits,
        metrics: Option<Arc<Metrics>>,
    ) -> Arc<Gate> {
        Arc::new(Gate {
            port,
            limits,
            open: Mutex::new(Open::default()),
            metrics,
        })
    }

    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().total
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // Counts are updated whole under the lock: a poisoned one is consistent.
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for a connection from `peer`, or why there is none.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Place, CapReached> {
        let refused = {
            let mut open = self.lock();
            let from_peer = open.per_peer.get(&peer).copied().unwrap_or(0);
            if open.total >= self.limits.max_connections {
                Some(CapReached::Port)
            } else if from_peer >= self.limits.max_per_peer {
                Some(CapReached::Peer)
            } else {
                open.total += 1;
                open.per_peer.insert(peer, from_peer + 1);
                if let Some(metrics) = self.metrics.as_deref() {
                    metrics.set_connections(self.port, open.total);
                }
                None
            }
        };
        match refused {
            Some(reason) => {
                if let Some(metrics) = self.metrics.as_deref() {
                    metrics.connection_refused(self.port, reason.label());
                }
                Err(reason)
            }
            None => Ok(Place {
                gate: Arc::clone(self),
                peer,
            }),
        }
    }

    fn leave(&self, peer: IpAddr) {
        let mut open = self.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(count) = open.per_peer.get_mut(&peer) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.per_peer.remove(&peer);
            }
        }
        if let Some(metrics) = self.metrics.as_deref() {
            metrics.set_connections(self.port, open.total);
        }
    }

    /// One connection closed by the service for `reason` (`idle`, `header`).
    pub fn closed(&self, reason: &'static str) {
        if let Some(metrics) = self.metrics.as_deref() {
            metrics.connection_closed(self.port, reason);
        }
    }

    /// Accepts `stream` from `peer` (no Nagle delay: answers are small), or closes it at
    /// once when there is no place for it.
    pub fn guard(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr) -> Option<Guarded> {
        match self.admit(peer.ip()) {
            Ok(place) => {
                if let Err(error) = stream.set_nodelay(true) {
                    tracing::debug!(%error, "cannot set TCP_NODELAY on a connection");
                }
                Some(Guarded::new(stream, place, self.limits))
            }
            Err(reason) => {
                tracing::debug!(%peer, port = self.port, reason = reason.label(), "connection refused: too many open");
                drop(stream);
                None
            }
        }
    }
}

/// A connection's place in its [`Gate`], given back when dropped.
pub struct Place {
    gate: Arc<Gate>,
    peer: IpAddr,
}

impl std::fmt::Debug for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Place")
            .field("port", &self.gate.port)
            .field("peer", &self.peer)
            .finish()
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.gate.leave(self.peer);
    }
}

/// Whether a connection's first request has arrived: the server marks it when a request's
/// head is read (the HTTP port's service, the gRPC port's interceptor, from the request's
/// extensions), which disarms the connection's first-request deadline.
#[derive(Debug, Clone, Default)]
pub struct Served(Arc<AtomicBool>);

impl Served {
    /// A request's head was read on this connection.
    pub fn mark(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_marked(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// An admitted connection: its stream, its place, and two deadlines, at which a read that
/// waits fails with `TimedOut` (the server then closes the connection): the first request's
/// head must arrive within the header timeout, and something must be read at least once
/// per idle timeout.
pub struct Guarded {
    stream: TcpStream,
    place: Place,
    idle: Duration,
    idle_deadline: Pin<Box<Sleep>>,
    first_request: Pin<Box<Sleep>>,
    served: Served,
}

impl Guarded {
    fn new(stream: TcpStream, place: Place, limits: ConnectionLimits) -> Guarded {
        Guarded {
            stream,
            place,
            idle: limits.idle_timeout,
            idle_deadline: Box::pin(tokio::time::sleep(limits.idle_timeout)),
            first_request: Box::pin(tokio::time::sleep(limits.header_timeout)),
            served: Served::default(),
        }
    }

    /// The peer's address.
    pub fn peer(&self) -> IpAddr {
        self.place.peer
    }

    /// What marks the connection's first request.
    pub fn served(&self) -> Served {
        self.served.clone()
    }

    fn timed_out(&self, reason: &'static str, what: &str) -> io::Error {
        self.place.gate.closed(reason);
        io::Error::new(io::ErrorKind::TimedOut, what.to_string())
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    let next = Instant::now() + self.idle;
                    self.idle_deadline.as_mut().reset(next);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => {
                if !self.served.is_marked() && self.first_request.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(
                        self.timed_out("header", "no request within the header timeout")
                    ));
                }
                if self.idle_deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(
                        self.timed_out("idle", "nothing read for the idle timeout")
                    ));
                }
                Poll::Pending
            }
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// tonic puts this into every request's extensions: the gRPC port's interceptor marks the
/// connection's first request with it.
impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = Served;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.served()
    }
}

/// Accepts connections on `listener` until `stop` resolves, handing each admitted one to
/// `serve`. An accept error (the process is out of descriptors) pauses accepting for a
/// moment instead of spinning.
pub async fn accept_loop<F>(
    listener: tokio::net::TcpListener,
    gate: Arc<Gate>,
    stop: impl Future<Output = ()>,
    mut serve: F,
) where
    F: FnMut(Guarded),
{
    tokio::pin!(stop);
    loop {
        tokio::select! {
            biased;
            () = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if let Some(connection) = gate.guard(stream, peer) {
                        serve(connection);
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "cannot accept a connection; retrying in 100 ms");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    #[test]
    fn places_are_bounded_per_port_and_per_peer_and_given_back() {
        let gate = Gate::new(
            "http",
            ConnectionLimits {
                max_connections: 3,
                max_per_peer: 2,
                ..ConnectionLimits::default()
            },
            None,
        );
        let a1 = gate.admit(ip(1)).unwrap();
        let _a2 = gate.admit(ip(1)).unwrap();
        assert_eq!(gate.admit(ip(1)).unwrap_err(), CapReached::Peer);
        let _b1 = gate.admit(ip(2)).unwrap();
        assert_eq!(gate.admit(ip(3)).unwrap_err(), CapReached::Port);
        assert_eq!(gate.open(), 3);
        drop(a1);
        assert_eq!(gate.open(), 2);
        let _c1 = gate.admit(ip(3)).unwrap();
        assert_eq!(gate.admit(ip(1)).unwrap_err(), CapReached::Port);
    }
}
