//! tonic over turmoil's simulated TCP: the production servers and clients, unchanged, on a
//! network the simulation partitions, delays and holds.
//!
//! Servers take a stream of accepted [`SimStream`]s (`serve_with_incoming`); clients get lazy
//! channels whose connector opens a [`turmoil::net::TcpStream`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use allot_agent::lease::client::{Connect, LinkError};
use allot_allocator::raft::ChannelFactory;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Uri};

/// One accepted simulated TCP connection, as a tonic server reads it.
pub struct SimStream(turmoil::net::TcpStream);

impl Connected for SimStream {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for SimStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for SimStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The connections accepted on `listener`, as a stream for `serve_with_incoming`. The accept
/// loop is a task of the calling host: it ends with the host (crash) or the first accept error.
pub fn incoming(
    listener: turmoil::net::TcpListener,
) -> UnboundedReceiverStream<io::Result<SimStream>> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let accepted = listener.accept().await.map(|(s, _)| SimStream(s));
            let failed = accepted.is_err();
            if tx.send(accepted).is_err() || failed {
                return;
            }
        }
    });
    UnboundedReceiverStream::new(rx)
}

/// A lazy channel to `addr` ("host:port", a turmoil host name) over simulated TCP: connects on
/// first use, connects time out after `connect_timeout`.
///
/// # Errors
/// The transport error when `addr` is not a valid authority.
pub fn channel(addr: &str, connect_timeout: Duration) -> Result<Channel, tonic::transport::Error> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    Ok(Endpoint::from_shared(uri)?
        .connect_timeout(connect_timeout)
        .connect_with_connector_lazy(tower::service_fn(|uri: Uri| async move {
            let host = uri.host().unwrap_or_default().to_string();
            let port = uri.port_u16().unwrap_or(80);
            let stream = turmoil::net::TcpStream::connect((host.as_str(), port)).await?;
            Ok::<_, io::Error>(TokioIo::new(stream))
        })))
}

/// Raft's (and the forwarding service's) channels to peers over simulated TCP.
#[derive(Debug, Clone, Copy)]
pub struct SimChannels {
    /// Limit on establishing a connection.
    pub connect_timeout: Duration,
}

impl ChannelFactory for SimChannels {
    fn channel(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        channel(addr, self.connect_timeout)
    }
}

/// The agent's connector ([`Connect`]) over simulated TCP.
pub fn agent_connect() -> Connect {
    std::sync::Arc::new(|addr: &str, timeout: Duration| {
        channel(addr, timeout).map_err(|e| LinkError::BadEndpoint(addr.to_string(), e.to_string()))
    })
}
