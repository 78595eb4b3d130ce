//! Forwarding to the leader: a follower sends a write, a Batch or a status read on to the
//! leader once, marked with [`FORWARDED_HEADER`] (so a call is never forwarded twice) and with
//! the caller's remaining deadline; when it cannot, it answers where the leader is
//! (`errors::not_leader`).

use super::errors::not_leader;
#[cfg(doc)]
use super::Shed;
use super::{AllocatorService, Client};
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;
use tonic::{Code, Request, Response, Status};

/// Metadata header set on a call a follower forwarded to the leader.
pub const FORWARDED_HEADER: &str = "x-allot-forwarded";

/// How long a forwarded call may take.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

impl AllocatorService {
    /// A client of the node at `addr`, its channel kept for the next calls.
    fn client(&self, addr: &str) -> Result<Client, Status> {
        let mut m = self.channels.lock();
        if let Some(c) = m.get(addr) {
            return Ok(AllocatorClient::new(c.clone()));
        }
        let ch = self
            .connect
            .channel(addr)
            .map_err(|e| Status::internal(format!("bad leader address {addr:?}: {e}")))?;
        m.insert(addr.to_string(), ch.clone());
        Ok(AllocatorClient::new(ch))
    }

    /// On a follower: runs `forward` against the leader once, or answers where the leader is.
    pub(super) async fn forward<T, F, Fut>(
        &self,
        forwarded: bool,
        leader_id: Option<u64>,
        leader_addr: Option<String>,
        forward: F,
    ) -> Result<Response<T>, Status>
    where
        F: FnOnce(Client) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let leader_addr = leader_addr.filter(|a| !a.is_empty());
        // A call forwarded once is not forwarded again (no loops while leadership moves); its
        // caller still learns where the leader is.
        let Some(addr) = leader_addr.clone().filter(|_| !forwarded) else {
            return Err(not_leader(leader_id, leader_addr));
        };
        match tokio::time::timeout(FORWARD_TIMEOUT, forward(self.client(&addr)?)).await {
            Err(_elapsed) => Err(Status::deadline_exceeded("the forwarded call timed out")),
            Ok(Err(s)) if s.code() == Code::Unavailable => Err(not_leader(leader_id, Some(addr))),
            Ok(Err(s)) => {
                // A write the leader refused OVERLOADED: shed the next ones here for a while
                // ([`Shed`]).
                self.leader_shedding.observe(&s);
                Err(s)
            }
            Ok(other) => other,
        }
    }
}

/// Whether `r` was forwarded by a follower.
pub(super) fn forwarded<T>(r: &Request<T>) -> bool {
    r.metadata().contains_key(FORWARDED_HEADER)
}

/// `r` marked as forwarded.
fn mark<T>(mut r: Request<T>) -> Request<T> {
    r.metadata_mut().insert(
        FORWARDED_HEADER,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    r
}

/// `body` as a call forwarded to the leader, with what is left of the caller's deadline.
pub(super) fn forward_request<T>(body: T, deadline: Option<Instant>) -> Request<T> {
    let mut r = mark(Request::new(body));
    if let Some(d) = deadline {
        r.set_timeout(d.saturating_duration_since(Instant::now()));
    }
    r
}
