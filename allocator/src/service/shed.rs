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
//! Raft's own RPCs (a separate service, never wrapped) always go through.
//!
//! A follower offers a write to its own queue first (its proposal fails with NOT_LEADER and
//! the call is forwarded); under a flood that queue fills too and the follower sheds by the
//! same rule. Besides, a follower that gets a forwarded write refused OVERLOADED as a whole by
//! the leader sheds the agents' writes itself for a moment ([`LeaderShedding`],
//! [`GroupCommitConfig::follower_shed_hold`]), so that under overload the calls that reach a
//! follower are not decoded, queued, encoded and forwarded only to be refused; the first write
//! after the hold is forwarded again and finds out whether the leader still sheds. A call that
//! a follower forwarded is never shed for that hold (only by the receiving node's own queue):
//! a node that has just become leader answers it, or a follower answers NOT_LEADER with where
//! the leader is.

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use allot_proto::allot::v1 as pb;
use allot_proto::error_detail;
use futures_util::future::Either;
use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::{Code, Status};
use tower::Service;

use super::errors::detail;
use super::forward::FORWARDED_HEADER;
use crate::ledger::Ledger;
use crate::raft::GroupCommit;
#[cfg(doc)]
use crate::raft::GroupCommitConfig;

/// The agents' writes of `allot.v1.Allocator` (full gRPC paths): what is shed.
const SHED_METHODS: [&str; 5] = [
    "/allot.v1.Allocator/Acquire",
    "/allot.v1.Allocator/Report",
    "/allot.v1.Allocator/Release",
    "/allot.v1.Allocator/Decide",
    "/allot.v1.Allocator/Batch",
];

/// Until when this node (a follower) sheds because the leader shed a write it forwarded: a
/// monotonic instant as nanoseconds after `epoch`, 0 for never. Cheap to share.
#[derive(Debug)]
pub struct LeaderShedding {
    epoch: Instant,
    until_ns: AtomicU64,
    /// How long a shed answer holds, ns; 0: never.
    hold_ns: u64,
}

impl LeaderShedding {
    /// Holds of `hold` after each shed answer (zero: never shed for the leader).
    pub fn new(hold: Duration) -> Self {
        LeaderShedding {
            epoch: Instant::now(),
            until_ns: AtomicU64::new(0),
            hold_ns: u64::try_from(hold.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// Nanoseconds from `epoch` to now (saturating).
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Notes the leader's answer to a forwarded call: a write refused OVERLOADED as a whole
    /// (shed, or a unary write refused by the leader's exact queue bound) starts (or extends)
    /// the hold.
    pub fn observe(&self, answer: &Status) {
        self.observe_at(answer, self.now_ns());
    }

    /// Whether the hold is running.
    pub fn active(&self) -> bool {
        self.active_at(self.now_ns())
    }

    /// [`LeaderShedding::observe`] at `now_ns` after the epoch.
    fn observe_at(&self, answer: &Status, now_ns: u64) {
        if is_shed(answer) {
            let until = now_ns.saturating_add(self.hold_ns);
            self.until_ns.fetch_max(until, Ordering::Relaxed);
        }
    }

    /// [`LeaderShedding::active`] at `now_ns` after the epoch.
    fn active_at(&self, now_ns: u64) -> bool {
        now_ns < self.until_ns.load(Ordering::Relaxed)
    }
}

/// Whether `s` is a write refused OVERLOADED as a whole (shed, or refused by the queue bound).
fn is_shed(s: &Status) -> bool {
    s.code() == Code::ResourceExhausted
        && error_detail::of(s).is_some_and(|d| d.reason == pb::ErrorReason::Overloaded as i32)
}

/// `inner` (the allocator's tonic server) behind the load-shedding gate of `commit` and of the
/// leader's last answers (`leader`); with no group commit (the unbatched path) nothing is shed.
#[derive(Clone)]
pub struct Shed<S> {
    inner: S,
    commit: Option<GroupCommit<Ledger>>,
    leader: Arc<LeaderShedding>,
}

impl<S> Shed<S> {
    /// `inner` behind the gate of `commit` and `leader`.
    pub fn new(inner: S, commit: Option<GroupCommit<Ledger>>, leader: Arc<LeaderShedding>) -> Self {
        Shed {
            inner,
            commit,
            leader,
        }
    }

    /// Whether `req` is refused now, and why.
    fn sheds<B>(&self, req: &http::Request<B>) -> Option<&'static str> {
        let c = self.commit.as_ref()?;
        if !SHED_METHODS.contains(&req.uri().path()) {
            return None;
        }
        if c.shedding() {
            return Some("the allocator is shedding load (its commit queue is nearly full)");
        }
        let forwarded = req.headers().contains_key(FORWARDED_HEADER);
        (!forwarded && self.leader.active())
            .then_some("the allocator is shedding load (the leader refused a forwarded write)")
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
        if let Some(why) = self.sheds(&req) {
            if let Some(c) = &self.commit {
                c.count_shed();
            }
            // Dropping the request unread: h2 sends the answer, then RST_STREAM(NO_ERROR), and
            // still releases the connection's flow control for DATA already in flight. Late
            // DATA for a stream h2 has forgotten counts as a local error reset, harmless while
            // the server sets no limit on those (tonic's default); a limit (hyper's usual
            // 1,024) could end a long-lived connection, the followers' forwarding channel
            // first, with GOAWAY under steady shedding.
            return Either::Left(ready(Ok(overloaded(why))));
        }
        Either::Right(self.inner.call(req))
    }
}

/// The answer to a shed call: RESOURCE_EXHAUSTED with an ErrorDetail OVERLOADED, as a queue
/// refusal of a unary call is answered.
fn overloaded(why: &str) -> http::Response<Body> {
    let d = detail(
        pb::ErrorReason::Overloaded,
        format!("{why}; nothing was applied"),
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

    #[test]
    fn a_shed_answer_from_the_leader_holds_for_a_while() {
        let hold = 20_000_000;
        let l = LeaderShedding::new(Duration::from_nanos(hold));
        let t0 = 1_000;
        assert!(!l.active_at(t0));
        l.observe_at(&Status::resource_exhausted("no detail"), t0);
        l.observe_at(&Status::unavailable("x"), t0);
        assert!(
            !l.active_at(t0),
            "only an OVERLOADED refusal starts the hold"
        );
        let overloaded = detail(pb::ErrorReason::Overloaded, "m");
        let other = detail(pb::ErrorReason::KeyCapReached, "m");
        l.observe_at(&error_detail::status(Code::ResourceExhausted, &other), t0);
        assert!(!l.active_at(t0), "a table cap is not load");
        let shed = error_detail::status(Code::ResourceExhausted, &overloaded);
        l.observe_at(&shed, t0);
        assert!(l.active_at(t0));
        assert!(l.active_at(t0 + hold - 1));
        assert!(!l.active_at(t0 + hold), "the hold ends");
        // A later shed answer extends it; an earlier one (a late thread) never shortens it.
        l.observe_at(&shed, t0 + hold);
        l.observe_at(&shed, t0);
        assert!(l.active_at(t0 + 2 * hold - 1));
        // At the end of time the hold saturates instead of wrapping.
        l.observe_at(&shed, u64::MAX - 1);
        assert!(l.active_at(u64::MAX - 1));
        // A zero hold never sheds.
        let never = LeaderShedding::new(Duration::ZERO);
        never.observe_at(&shed, t0);
        assert!(!never.active_at(t0));
    }
}
