//! Load shedding before decoding (issue 9 item 3: goodput at twice the capacity stays near the
//! capacity). While the leader's group-commit queue is nearly full
//! ([`GroupCommit::shedding`]), a new write of the agents' data plane is answered
//! RESOURCE_EXHAUSTED with an ErrorDetail OVERLOADED from its headers alone: its body is never
//! decoded, converted or queued, and the answer is one status instead of one detail per Batch
//! item. Nothing is applied, exactly as when the queue's own bound refuses the call. An agent
//! classifies both as `Overloaded` (the failure mode for its waiting decisions; Reports and
//! Releases stay queued) and pauses its sending with a jittered, growing backoff, whether the
//! whole call was shed or every item of it was refused OVERLOADED.
//!
//! Only the agents' writes are shed: Acquire, Report, Release, Decide and Batch. Status reads,
//! the operators' calls (policies and shares queue too, but are rare and must get through) and
//! Raft's own RPCs (a separate service, never wrapped) always go through. A follower's queue
//! never fills (its proposals fail at once with NOT_LEADER and the call is forwarded), so in
//! practice only the leader sheds; a follower still decodes and forwards what the leader then
//! sheds.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::task::{Context, Poll};

use allot_proto::allot::v1 as pb;
use allot_proto::error_detail;
use futures_util::future::Either;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::Code;
use tower::Service;

use super::errors::detail;
use crate::ledger::Ledger;
use crate::raft::GroupCommit;

/// The agents' writes of `allot.v1.Allocator` (full gRPC paths): what is shed.
const SHED_METHODS: [&str; 5] = [
    "/allot.v1.Allocator/Acquire",
    "/allot.v1.Allocator/Report",
    "/allot.v1.Allocator/Release",
    "/allot.v1.Allocator/Decide",
    "/allot.v1.Allocator/Batch",
];

/// `inner` (the allocator's tonic server) behind the load-shedding gate of `commit`; with no
/// group commit (the unbatched path) nothing is shed.
#[derive(Clone)]
pub struct Shed<S> {
    inner: S,
    commit: Option<GroupCommit<Ledger>>,
}

impl<S> Shed<S> {
    /// `inner` behind the gate of `commit`.
    pub fn new(inner: S, commit: Option<GroupCommit<Ledger>>) -> Self {
        Shed { inner, commit }
    }

    /// Whether a request for `path` is refused now.
    fn sheds(&self, path: &str) -> bool {
        match &self.commit {
            Some(c) => c.shedding() && SHED_METHODS.contains(&path),
            None => false,
        }
    }
}

impl<S: NamedService> NamedService for Shed<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Shed<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Either<Ready<Result<http::Response<Body>, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if self.sheds(req.uri().path()) {
            if let Some(c) = &self.commit {
                c.count_shed();
            }
            // Dropping the request unread: h2 sends the answer, then RST_STREAM(NO_ERROR), and
            // still releases the connection's flow control for DATA already in flight. Late
            // DATA for a stream h2 has forgotten counts as a local error reset, harmless while
            // the server sets no limit on those (tonic's default); a limit (hyper's usual
            // 1,024) could end a long-lived connection, the followers' forwarding channel
            // first, with GOAWAY under steady shedding.

            return Either::Left(ready(Ok(overloaded())));
        }
        Either::Right(self.inner.call(req))
    }
}

/// The answer to a shed call: RESOURCE_EXHAUSTED with an ErrorDetail OVERLOADED, as a queue
/// refusal of a unary call is answered.
fn overloaded() -> http::Response<Body> {
    let d = detail(
        pb::ErrorReason::Overloaded,
        "the allocator is shedding load (its commit queue is nearly full); nothing was applied",
    );
    error_detail::status(Code::ResourceExhausted, &d).into_http()
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_proto::allot::v1::allocator_server::SERVICE_NAME;

    #[test]
    fn only_the_agents_writes_are_shed() {
        let path = |m: &str| format!("/{SERVICE_NAME}/{m}");
        for m in ["Acquire", "Report", "Release", "Decide", "Batch"] {
            assert!(SHED_METHODS.contains(&path(m).as_str()), "{m}");
        }
        let never = [
            "Status",
            "PutPolicy",
            "SetShares",
            "ClusterInit",
            "AddLearner",
            "ChangeMembership",
            "ClusterStatus",
        ];
        for m in never {
            assert!(!SHED_METHODS.contains(&path(m).as_str()), "{m}");
        }
        // Raft's service has methods of its own under another name.
        for m in ["AppendEntries", "Vote", "InstallSnapshot"] {
            let raft = format!("/allot.v1.RaftService/{m}");
            assert!(!SHED_METHODS.contains(&raft.as_str()), "{m}");
        }
    }
}
