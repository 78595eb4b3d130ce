//! The agent's link to the allocator cluster: any node answers (followers forward to the
//! leader), so calls rotate through the configured endpoints on failure and follow a leader hint
//! when a node gives one. Every call is bounded by a timeout.

use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use parking_lot::Mutex;
use prost::Message;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// Why the link could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// No endpoint was given.
    #[error("no allocator endpoint configured")]
    NoEndpoints,
    /// An endpoint is not a valid URI.
    #[error("allocator endpoint {0:?} is not a valid address: {1}")]
    BadEndpoint(String, String),
}

/// Connections to the allocator nodes.
pub struct AllocatorLink {
    endpoints: Vec<(String, Channel)>,
    current: AtomicUsize,
    hinted: Mutex<Option<(String, Channel)>>,
    timeout: Duration,
}

impl std::fmt::Debug for AllocatorLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllocatorLink")
            .field(
                "endpoints",
                &self.endpoints.iter().map(|e| &e.0).collect::<Vec<_>>(),
            )
            .finish()
    }
}

fn channel(addr: &str, timeout: Duration) -> Result<Channel, LinkError> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    Ok(Endpoint::from_shared(uri)
        .map_err(|e| LinkError::BadEndpoint(addr.to_string(), e.to_string()))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .tcp_nodelay(true)
        .connect_lazy())
}

/// Whether another node might answer where this one failed.
fn retryable(s: &Status) -> bool {
    matches!(
        s.code(),
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Unknown
            | Code::Cancelled
            | Code::Internal
    )
}

impl AllocatorLink {
    /// A link to `endpoints` ("host:port"); calls time out after `timeout`. Connects lazily.
    ///
    /// # Errors
    /// [`LinkError`] for an empty list or an unparsable address.
    pub fn new(endpoints: &[String], timeout: Duration) -> Result<Self, LinkError> {
        if endpoints.is_empty() {
            return Err(LinkError::NoEndpoints);
        }
        let endpoints = endpoints
            .iter()
            .map(|a| Ok((a.clone(), channel(a, timeout)?)))
            .collect::<Result<Vec<_>, LinkError>>()?;
        Ok(AllocatorLink {
            endpoints,
            current: AtomicUsize::new(0),
            hinted: Mutex::new(None),
            timeout,
        })
    }

    /// Runs `call` against the current node, then the others, until one answers with something
    /// other than a transport failure. A timed-out Acquire is retried with the same request id,
    /// so the allocator never charges it twice.
    ///
    /// # Errors
    /// The last node's status when none answered, or the first semantic error.
    pub async fn call<T, F, Fut>(&self, call: F) -> Result<T, Status>
    where
        F: Fn(AllocatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut last = Status::unavailable("no allocator endpoint answered");
        let hinted = self.hinted.lock().clone();
        if let Some((_, ch)) = hinted {
            match self.once(&call, ch).await {
                Ok(v) => return Ok(v),
                Err(s) if retryable(&s) => {
                    *self.hinted.lock() = None;
                    last = s;
                }
                Err(s) => return Err(s),
            }
        }
        let n = self.endpoints.len();
        let start = self.current.load(Ordering::Relaxed);
        for i in 0..n {
            let idx = (start + i) % n;
            match self.once(&call, self.endpoints[idx].1.clone()).await {
                Ok(v) => {
                    self.current.store(idx, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(s) if s.code() == Code::FailedPrecondition && !s.details().is_empty() => {
                    // A follower that could not forward names the leader: go there next.
                    if let Ok(h) = pb::LeaderHint::decode(s.details()) {
                        if !h.leader_addr.is_empty() {
                            if let Ok(ch) = channel(&h.leader_addr, self.timeout) {
                                *self.hinted.lock() = Some((h.leader_addr.clone(), ch.clone()));
                                if let Ok(v) = self.once(&call, ch).await {
                                    return Ok(v);
                                }
                            }
                        }
                    }
                    last = s;
                }
                Err(s) if retryable(&s) => last = s,
                Err(s) => return Err(s),
            }
        }
        Err(last)
    }

    async fn once<T, F, Fut>(&self, call: &F, ch: Channel) -> Result<T, Status>
    where
        F: Fn(AllocatorClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        match tokio::time::timeout(self.timeout, call(AllocatorClient::new(ch))).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(s),
            Err(_) => Err(Status::deadline_exceeded("allocator call timed out")),
        }
    }
}
