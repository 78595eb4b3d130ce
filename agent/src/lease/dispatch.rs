//! Sending lease work to the allocator (issue 9 item 3): every key's Acquire, Report, Release
//! and Decide queued since the last send goes out in **one** `Batch` call (at most
//! [`MAX_CALLS_IN_FLIGHT`] of them in flight per agent), which carries the
//! caller's deadline (`grpc-timeout` = `call_timeout_ms`); the allocator applies it in one
//! group commit. An allocator that does not serve `Batch` (UNIMPLEMENTED: an older version)
//! gets the same items as single calls, sent concurrently; `Batch` is tried again later.
//!
//! Each answer is an [`Answer`]: the allocator's outcome, or the [`CallError`] the link
//! classified its failure into (a Batch item's typed error goes through the same
//! [`CallError::from_detail`]); the manager acts on that.

use super::client::{AllocatorLink, CallError};
use allot_proto::allot::v1 as pb;
use pb::batch_item::Op;
use pb::batch_result::Outcome;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;

/// How one item of a send was answered.
#[derive(Debug, Clone)]
pub enum Answer {
    /// The allocator's answer (never an `Outcome::Error`).
    Done(Outcome),
    /// The item failed, classified once by the link ([`CallError`]).
    Failed(CallError),
}

/// Most items in one `Batch`; more wait for the next send (right after this one).
pub const MAX_BATCH_ITEMS: usize = 1024;

/// Most `Batch` calls one agent has in flight at once (issue 9 item 3): enough that a
/// decision does not wait behind a previous call's round trip and Raft commit, few enough
/// that an agent's calls still share entries on the allocator (one Batch carries everything
/// queued while the others were in flight).
pub const MAX_CALLS_IN_FLIGHT: usize = 4;

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
    /// least one allocator node answered the call (the backoff resets), `false` when none did
    /// or when it refused every item OVERLOADED (the agent backs off with jitter, issue 9
    /// item 3): a Batch the allocator's commit queue refused item by item pauses the agent
    /// like one its load-shedding gate refused whole, before decoding.
    pub async fn send(&self, items: &[Op]) -> (Vec<Answer>, bool) {
        if items.is_empty() {
            return (Vec::new(), true);
        }
        if self.now_ms() >= self.batch_off_until_ms.load(Ordering::Relaxed) {
            match self.send_batch(items).await {
                Ok(answers) => {
                    let up = !all_overloaded(&answers);
                    return (answers, up);
                }
                Err(CallError::Unsupported) => {
                    tracing::info!("the allocator does not serve Batch; sending single calls");
                    let until = self
                        .now_ms()
                        .saturating_add(BATCH_RETRY_AFTER.as_millis() as u64);
                    self.batch_off_until_ms.store(until, Ordering::Relaxed);
                }
                Err(e) => {
                    let up = !e.is_transient();
                    return (vec![Answer::Failed(e); items.len()], up);
                }
            }
        }
        self.send_singles(items).await
    }

    async fn send_batch(&self, items: &[Op]) -> Result<Vec<Answer>, CallError> {
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
            let refused = Answer::Failed(CallError::Rejected {
                reason: pb::ErrorReason::Unspecified,
                field: String::new(),
                message: why,
            });
            return Ok(vec![refused; items.len()]);
        }
        Ok(resp.results.into_iter().map(classify_result).collect())
    }

    async fn send_singles(&self, items: &[Op]) -> (Vec<Answer>, bool) {
        let mut set = JoinSet::new();
        let n = items.len();
        for (i, op) in items.iter().cloned().enumerate() {
            let (link, timeout) = (self.link.clone(), self.timeout);
            set.spawn(async move { (i, single(&link, op, timeout).await) });
        }
        let not_sent = Answer::Failed(CallError::Unreachable {
            message: "not sent".into(),
        });
        let mut answers = vec![not_sent; n];
        while let Some(done) = set.join_next().await {
            if let Ok((i, a)) = done {
                answers[i] = a;
            }
        }
        let up = answers
            .iter()
            .any(|a| !matches!(a, Answer::Failed(e) if e.is_transient()));
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
    // One RPC of `method` carrying `m`, its answer as `Outcome::$outcome`.
    macro_rules! call {
        ($m:ident, $method:ident, $outcome:ident) => {
            link.call(|mut c| {
                let r = req($m.clone(), timeout);
                async move { c.$method(r).await }
            })
            .await
            .map(Outcome::$outcome)
        };
    }
    let r = match op {
        Op::Acquire(m) => call!(m, acquire, Acquire),
        Op::Report(m) => call!(m, report, Report),
        Op::Release(m) => call!(m, release, Release),
        Op::Decide(m) => call!(m, decide, Decide),
    };
    match r {
        Ok(o) => Answer::Done(o),
        Err(e) => Answer::Failed(e),
    }
}

/// Whether every answer is an OVERLOADED refusal (at least one answer).
fn all_overloaded(answers: &[Answer]) -> bool {
    !answers.is_empty()
        && answers
            .iter()
            .all(|a| matches!(a, Answer::Failed(CallError::Overloaded { .. })))
}

/// One Batch item's answer: its outcome, or its typed error classified by the link's rules.
fn classify_result(r: pb::BatchResult) -> Answer {
    match r.outcome {
        Some(Outcome::Error(e)) => Answer::Failed(CallError::from_detail(&e)),
        Some(o) => Answer::Done(o),
        None => Answer::Failed(CallError::Rejected {
            reason: pb::ErrorReason::Unspecified,
            field: String::new(),
            message: "a Batch result without an outcome".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::client::Fence;

    #[test]
    fn a_batch_refused_overloaded_item_by_item_counts_as_unanswered() {
        let overloaded = || {
            Answer::Failed(CallError::Overloaded {
                message: "m".into(),
            })
        };
        let done = || Answer::Done(Outcome::Release(pb::ReleaseResponse { returned: 1 }));
        let fenced = || {
            Answer::Failed(CallError::Fenced {
                why: Fence::NotHolder,
                message: "m".into(),
            })
        };
        assert!(all_overloaded(&[overloaded()]));
        assert!(all_overloaded(&[overloaded(), overloaded()]));
        assert!(!all_overloaded(&[overloaded(), done()]));
        assert!(!all_overloaded(&[fenced(), overloaded()]));
        assert!(!all_overloaded(&[]));
    }

    #[test]
    fn batch_items_are_classified_by_their_typed_error() {
        let item = |reason: pb::ErrorReason| pb::BatchResult {
            outcome: Some(Outcome::Error(pb::ErrorDetail {
                reason: reason as i32,
                message: "m".into(),
                ..Default::default()
            })),
        };
        assert!(matches!(
            classify_result(item(pb::ErrorReason::NotHolder)),
            Answer::Failed(CallError::Fenced {
                why: Fence::NotHolder,
                ..
            })
        ));
        assert!(matches!(
            classify_result(item(pb::ErrorReason::StaleEpoch)),
            Answer::Failed(CallError::Fenced {
                why: Fence::StaleEpoch,
                ..
            })
        ));
        assert!(matches!(
            classify_result(item(pb::ErrorReason::Overloaded)),
            Answer::Failed(CallError::Overloaded { .. })
        ));
        let ok = pb::BatchResult {
            outcome: Some(Outcome::Release(pb::ReleaseResponse { returned: u64::MAX })),
        };
        assert!(matches!(
            classify_result(ok),
            Answer::Done(Outcome::Release(pb::ReleaseResponse { returned: u64::MAX }))
        ));
        assert!(matches!(
            classify_result(pb::BatchResult { outcome: None }),
            Answer::Failed(CallError::Rejected { .. })
        ));
    }
}
