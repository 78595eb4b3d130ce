//! Sending lease work to the allocator (issue 9 item 3): every key's Acquire, Report, Release
//! and Decide queued since the last send goes out in **one** `Batch` call, which carries the
//! caller's deadline (`grpc-timeout` = `call_timeout_ms`); the allocator applies it in one
//! group commit. An allocator that does not serve `Batch` (UNIMPLEMENTED: an older version)
//! gets the same items as single calls, sent concurrently; `Batch` is tried again later.
//!
//! Each answer is classified once, here, into an [`Answer`]; the manager acts on that.

use super::client::AllocatorLink;
use allot_proto::allot::v1 as pb;
use pb::batch_item::Op;
use pb::batch_result::Outcome;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tonic::{Code, Status};

/// How one item of a send was answered.
#[derive(Debug, Clone)]
pub enum Answer {
    /// The allocator's answer (never an `Outcome::Error`).
    Done(Outcome),
    /// The allocator no longer holds the allocation as live (ended, stale epoch, unknown id,
    /// not the holder): drop it.
    Fenced,
    /// Refused for good (bad input, unknown policy, key cap): the allocator is up.
    Refused(String),
    /// The allocator does not serve this call (UNIMPLEMENTED): an older version.
    Unsupported,
    /// No allocator answered (unavailable, timeout, overloaded, no leader): the failure mode.
    Unreachable(String),
}

/// Most items in one `Batch`; more wait for the next send (right after this one).
pub const MAX_BATCH_ITEMS: usize = 1024;

/// How long after an UNIMPLEMENTED `Batch` the agent sends single calls before trying
/// `Batch` again (the allocator may have been upgraded).
const BATCH_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Sends items through a link, in one `Batch` when the allocator serves it.
#[derive(Debug)]
pub struct Dispatcher {
    link: Arc<AllocatorLink>,
    timeout: Duration,
    /// Monotonic ms (tokio clock, from `epoch`) until which `Batch` is not tried; 0: try it.
    batch_off_until_ms: AtomicU64,
    epoch: tokio::time::Instant,
}

impl Dispatcher {
    /// A dispatcher over `link`; each call carries a deadline of `timeout`.
    pub fn new(link: Arc<AllocatorLink>, timeout: Duration) -> Self {
        Dispatcher {
            link,
            timeout,
            batch_off_until_ms: AtomicU64::new(0),
            epoch: tokio::time::Instant::now(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Sends `items` and returns one answer per item, in order; `true` with them when at
    /// least one allocator node answered the call (the backoff resets), `false` when none did.
    pub async fn send(&self, items: Vec<Op>) -> (Vec<Answer>, bool) {
        if items.is_empty() {
            return (Vec::new(), true);
        }
        if self.now_ms() >= self.batch_off_until_ms.load(Ordering::Relaxed) {
            match self.send_batch(&items).await {
                Ok(answers) => return (answers, true),
                Err(s) if s.code() == Code::Unimplemented => {
                    tracing::info!("the allocator does not serve Batch; sending single calls");
                    let until = self
                        .now_ms()
                        .saturating_add(BATCH_RETRY_AFTER.as_millis() as u64);
                    self.batch_off_until_ms.store(until, Ordering::Relaxed);
                }
                Err(s) => {
                    let a = classify_status(&s);
                    let up = !matches!(a, Answer::Unreachable(_));
                    return (vec![a; items.len()], up);
                }
            }
        }
        self.send_singles(items).await
    }

    async fn send_batch(&self, items: &[Op]) -> Result<Vec<Answer>, Status> {
        let req = pb::BatchRequest {
            items: items
                .iter()
                .map(|op| pb::BatchItem {
                    op: Some(op.clone()),
                })
                .collect(),
        };
        let timeout = self.timeout;
        let resp = self
            .link
            .call(|mut c| {
                let mut r = tonic::Request::new(req.clone());
                r.set_timeout(timeout);
                async move { c.batch(r).await }
            })
            .await?;
        if resp.results.len() != items.len() {
            // A malformed answer: nothing in it can be trusted to belong to an item.
            let why = format!(
                "Batch answered {} results for {} items",
                resp.results.len(),
                items.len()
            );
            return Ok(vec![Answer::Refused(why); items.len()]);
        }
        Ok(resp.results.into_iter().map(classify_result).collect())
    }

    async fn send_singles(&self, items: Vec<Op>) -> (Vec<Answer>, bool) {
        let mut set = JoinSet::new();
        let n = items.len();
        for (i, op) in items.into_iter().enumerate() {
            let (link, timeout) = (self.link.clone(), self.timeout);
            set.spawn(async move { (i, single(&link, op, timeout).await) });
        }
        let mut answers = vec![Answer::Unreachable("not sent".into()); n];
        while let Some(done) = set.join_next().await {
            if let Ok((i, a)) = done {
                answers[i] = a;
            }
        }
        let up = answers.iter().any(|a| !matches!(a, Answer::Unreachable(_)));
        (answers, up)
    }
}

/// One item as its own RPC.
async fn single(link: &AllocatorLink, op: Op, timeout: Duration) -> Answer {
    fn req<T>(m: T, timeout: Duration) -> tonic::Request<T> {
        let mut r = tonic::Request::new(m);
        r.set_timeout(timeout);
        r
    }
    let r = match op {
        Op::Acquire(m) => link
            .call(|mut c| {
                let r = req(m.clone(), timeout);
                async move { c.acquire(r).await }
            })
            .await
            .map(Outcome::Acquire),
        Op::Report(m) => link
            .call(|mut c| {
                let r = req(m.clone(), timeout);
                async move { c.report(r).await }
            })
            .await
            .map(Outcome::Report),
        Op::Release(m) => link
            .call(|mut c| {
                let r = req(m.clone(), timeout);
                async move { c.release(r).await }
            })
            .await
            .map(Outcome::Release),
        Op::Decide(m) => link
            .call(|mut c| {
                let r = req(m.clone(), timeout);
                async move { c.decide(r).await }
            })
            .await
            .map(Outcome::Decide),
    };
    match r {
        Ok(o) => Answer::Done(o),
        Err(s) => classify_status(&s),
    }
}

fn classify_result(r: pb::BatchResult) -> Answer {
    match r.outcome {
        Some(Outcome::Error(e)) => classify_detail(&e),
        Some(o) => Answer::Done(o),
        None => Answer::Refused("a Batch result without an outcome".into()),
    }
}

/// An item's typed error (issue 11 item 4): classified on its reason, never on its text.
fn classify_detail(e: &pb::ErrorDetail) -> Answer {
    use pb::ErrorReason as R;
    match R::try_from(e.reason).unwrap_or(R::Unspecified) {
        R::UnknownAllocation | R::StaleEpoch | R::AllocationEnded | R::NotHolder => Answer::Fenced,
        R::NotLeader | R::DeadlineExceeded | R::Overloaded => {
            Answer::Unreachable(e.message.clone())
        }
        R::Unspecified
        | R::BadInput
        | R::UnknownPolicy
        | R::VersionMismatch
        | R::KeyCapReached
        | R::NeverGrantable
        | R::ScopeLocal => Answer::Refused(e.message.clone()),
    }
}

/// A failed call's status: the typed detail when the allocator attached one, else its code.
fn classify_status(s: &Status) -> Answer {
    use prost::Message;
    match s.code() {
        Code::Unimplemented => return Answer::Unsupported,
        // A FAILED_PRECONDITION with details is a not-the-leader hint the link could not
        // follow. (A LeaderHint and an ErrorDetail share their wire shape, so these details
        // are never read as an ErrorDetail: keeping an allocation is the safe reading.)
        Code::FailedPrecondition if !s.details().is_empty() => {
            return Answer::Unreachable(s.message().to_string())
        }
        _ => {}
    }
    if let Ok(e) = pb::ErrorDetail::decode(s.details()) {
        if e.reason != pb::ErrorReason::Unspecified as i32 {
            return classify_detail(&e);
        }
    }
    match s.code() {
        Code::FailedPrecondition | Code::NotFound => Answer::Fenced,
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Unknown
        | Code::Cancelled
        | Code::ResourceExhausted
        | Code::Internal
        | Code::Aborted => Answer::Unreachable(s.message().to_string()),
        _ => Answer::Refused(s.message().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn typed_details_decide_the_class_not_the_code() {
        let detail = |reason: pb::ErrorReason| pb::ErrorDetail {
            reason: reason as i32,
            message: "m".into(),
            ..Default::default()
        };
        let status =
            |code, d: pb::ErrorDetail| Status::with_details(code, "m", d.encode_to_vec().into());
        assert!(matches!(
            classify_status(&status(Code::NotFound, detail(pb::ErrorReason::StaleEpoch))),
            Answer::Fenced
        ));
        // FAILED_PRECONDITION with details reads as a leader hint: keep, retry later.
        assert!(matches!(
            classify_status(&status(
                Code::FailedPrecondition,
                detail(pb::ErrorReason::StaleEpoch)
            )),
            Answer::Unreachable(_)
        ));
        assert!(matches!(
            classify_status(&status(
                Code::ResourceExhausted,
                detail(pb::ErrorReason::KeyCapReached)
            )),
            Answer::Refused(_)
        ));
        assert!(matches!(
            classify_status(&status(
                Code::ResourceExhausted,
                detail(pb::ErrorReason::Overloaded)
            )),
            Answer::Unreachable(_)
        ));
        assert!(matches!(
            classify_status(&Status::unimplemented("old")),
            Answer::Unsupported
        ));
        // Without details: the code (an empty FAILED_PRECONDITION is a fenced allocation).
        assert!(matches!(
            classify_status(&Status::failed_precondition("stale")),
            Answer::Fenced
        ));
        assert!(matches!(
            classify_status(&Status::invalid_argument("bad")),
            Answer::Refused(_)
        ));
        assert!(matches!(
            classify_result(pb::BatchResult { outcome: None }),
            Answer::Refused(_)
        ));
    }
}
