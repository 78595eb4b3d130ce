//! Group commit on the leader (issue 9 item 3): concurrent proposals, from every RPC, agent and
//! key, wait in one bounded queue and are proposed together as one batch command per Raft entry,
//! so a whole batch costs one replication round and one fsync per node instead of one per
//! command. Every caller is answered only after its entry committed and applied (a leader crash
//! loses no answered decision).
//!
//! Flushing: the flusher proposes as soon as an entry slot is free (at most
//! [`GroupCommitConfig::max_in_flight`] entries proposed and not yet committed); while entries
//! are in flight, new calls accumulate and go out together in the next entry, up to
//! [`GroupCommitConfig::max_entry_items`] commands. The batch grows with the load by itself: a
//! lone call pays one commit, a flood shares them. An optional [`GroupCommitConfig::window`]
//! waits a little longer before each flush.
//!
//! Overload: the queue holds at most [`GroupCommitConfig::queue_items`] commands not yet
//! proposed; a call that does not fit is refused at once, unapplied ([`CommitError::Overloaded`]),
//! so the queue never grows into latency that every caller then times out on (congestion
//! collapse). A call carries its deadline: commands whose deadline passed, or whose caller went
//! away, before they were proposed are dropped unapplied ([`CommitError::DeadlineExceeded`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio::time::Instant;

use super::app::App;
use super::ledger_time::LedgerTime;
use super::node::{write_error, ClientError};
use super::types::typ::Raft;
use super::types::Stamped;

/// An [`App`] whose commands can be grouped into one command applied in order in one entry.
pub trait Batching: App {
    /// One command applying `cmds` in order at the entry's stamped time, answered by a response
    /// that [`Batching::unbatch`] splits into one response per command.
    fn batch(cmds: Vec<Self::Command>) -> Self::Command;

    /// The per-command responses of a batch command's response; `None` when `r` is not one.
    fn unbatch(r: Self::Response) -> Option<Vec<Self::Response>>;
}

/// Queue and flush settings of a [`GroupCommit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupCommitConfig {
    /// Most commands waiting to be proposed; a call that would pass it is refused with
    /// [`CommitError::Overloaded`] (a call larger than the bound is taken when the queue is
    /// empty). Must be > 0.
    pub queue_items: usize,
    /// Most commands in one entry; a call is never split, so an entry can exceed this by one
    /// call's commands less one. Must be > 0.
    pub max_entry_items: usize,
    /// Most entries proposed and not yet committed. 1 flushes exactly when the previous entry
    /// has committed. Must be > 0.
    pub max_in_flight: usize,
    /// Extra wait before each flush, to let more calls join; zero flushes as soon as an entry
    /// slot is free.
    pub window: Duration,
}

impl Default for GroupCommitConfig {
    /// The best of the settings measured in `docs/benchmarks.md` ("Group commit, Batch and
    /// Decide"): small entries, several in flight (openraft pipelines them), so that one entry
    /// commits well within callers' deadlines. A command admitted waits about
    /// `queue_items / capacity` before it is proposed: the bound must stay well below
    /// capacity × the callers' deadlines.
    fn default() -> Self {
        Self {
            queue_items: 4_096,
            max_entry_items: 256,
            max_in_flight: 4,
            window: Duration::ZERO,
        }
    }
}

/// Why grouped commands got no committed response.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum CommitError {
    /// The queue was full; nothing was applied. Retry after a jittered backoff.
    #[error("the commit queue is full ({capacity} commands); nothing was applied")]
    Overloaded {
        /// The queue's bound, in commands.
        capacity: usize,
    },
    /// The caller's deadline passed before the commands were proposed; nothing was applied.
    #[error("the deadline passed before the commands were proposed; nothing was applied")]
    DeadlineExceeded,
    /// The proposal failed (not the leader, Raft stopped or rejected the entry).
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// What one caller gets: its commands' responses in order, or why not.
type Answer<A> = Result<Vec<<A as App>::Response>, CommitError>;

/// One caller's commands, kept together in one entry.
struct Call<A: App> {
    cmds: Vec<A::Command>,
    deadline: Option<Instant>,
    reply: oneshot::Sender<Answer<A>>,
}

/// The queue of a node's group commit; cheap to clone (clones share one queue and flusher).
/// The flusher task ends when the last clone is dropped.
pub struct GroupCommit<A: Batching> {
    tx: mpsc::UnboundedSender<Call<A>>,
    queued: Arc<AtomicUsize>,
    holds: Arc<watch::Sender<usize>>,
    capacity: usize,
}

impl<A: Batching> Clone for GroupCommit<A> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            queued: self.queued.clone(),
            holds: self.holds.clone(),
            capacity: self.capacity,
        }
    }
}

/// While alive, the flusher proposes nothing (see [`GroupCommit::hold`]).
pub struct FlushHold {
    holds: Arc<watch::Sender<usize>>,
}

impl Drop for FlushHold {
    fn drop(&mut self) {
        self.holds.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl<A: Batching> GroupCommit<A> {
    /// Starts the flusher of `raft`, stamping entries from `time`. Zero settings are raised
    /// to 1. Must be called inside a tokio runtime.
    pub(super) fn start(raft: Raft<A>, time: Arc<LedgerTime>, config: GroupCommitConfig) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let (holds, hold_rx) = watch::channel(0usize);
        let flusher = Flusher {
            raft,
            time,
            rx,
            queued: queued.clone(),
            holds: hold_rx,
            slots: Arc::new(Semaphore::new(config.max_in_flight.max(1))),
            max_entry_items: config.max_entry_items.max(1),
            window: config.window,
            carry: None,
        };
        tokio::spawn(flusher.run());
        Self {
            tx,
            queued,
            holds: Arc::new(holds),
            capacity: config.queue_items.max(1),
        }
    }

    /// Queues `cmds` to be proposed together in one entry and returns their responses, in
    /// order, after that entry committed and applied. `deadline` is when the caller stops
    /// waiting: commands still queued then are dropped unapplied. An empty call returns at once.
    ///
    /// # Errors
    /// [`CommitError::Overloaded`] at once when the queue is full; [`CommitError::DeadlineExceeded`]
    /// when the deadline passed before proposal; [`CommitError::Client`] when the proposal
    /// failed ([`ClientError::NotLeader`] on a follower; [`ClientError::Stopped`] when Raft or
    /// the flusher stopped: the outcome is then unknown).
    pub async fn submit(
        &self,
        cmds: Vec<A::Command>,
        deadline: Option<Instant>,
    ) -> Result<Vec<A::Response>, CommitError> {
        let n = cmds.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        self.reserve(n)?;
        let (reply, rx) = oneshot::channel();
        let call = Call {
            cmds,
            deadline,
            reply,
        };
        if self.tx.send(call).is_err() {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            return Err(ClientError::Stopped("the group commit flusher stopped".into()).into());
        }
        rx.await.unwrap_or_else(|_| {
            Err(ClientError::Stopped("the group commit flusher stopped".into()).into())
        })
    }

    /// Counts `n` more queued commands, or refuses them when they do not fit.
    fn reserve(&self, n: usize) -> Result<(), CommitError> {
        reserve(&self.queued, self.capacity, n)
    }

    /// Commands queued and not yet proposed.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Stops flushing until the returned guard is dropped: calls queue up (and are refused once
    /// the queue is full) while nothing is proposed. For maintenance and for tests that need a
    /// queue in a known state.
    pub fn hold(&self) -> FlushHold {
        self.holds.send_modify(|n| *n += 1);
        FlushHold {
            holds: self.holds.clone(),
        }
    }
}

/// The task that drains the queue into entries.
struct Flusher<A: Batching> {
    raft: Raft<A>,
    time: Arc<LedgerTime>,
    rx: mpsc::UnboundedReceiver<Call<A>>,
    queued: Arc<AtomicUsize>,
    holds: watch::Receiver<usize>,
    slots: Arc<Semaphore>,
    max_entry_items: usize,
    window: Duration,
    /// A call taken from the queue that did not fit into the previous entry.
    carry: Option<Call<A>>,
}

impl<A: Batching> Flusher<A> {
    async fn run(mut self) {
        loop {
            let first = match self.carry.take() {
                Some(c) => c,
                None => match self.rx.recv().await {
                    Some(c) => c,
                    // Every handle is gone: nobody can queue anything any more.
                    None => return,
                },
            };
            // Waiting for a slot is what batches: calls arriving meanwhile join this entry.
            let Ok(slot) = self.slots.clone().acquire_owned().await else {
                return;
            };
            // A dropped hold sender cannot happen while a handle lives; either way, go on.
            let _ = self.holds.wait_for(|n| *n == 0).await;
            if !self.window.is_zero() {
                tokio::time::sleep(self.window).await;
            }
            let calls = self.gather(first);
            let taken: usize = calls.iter().map(|c| c.cmds.len()).sum();
            self.queued.fetch_sub(taken, Ordering::AcqRel);
            let live = drop_expired(calls, Instant::now());
            if live.is_empty() {
                continue;
            }
            let lens: Vec<usize> = live.iter().map(|c| c.cmds.len()).collect();
            let mut replies = Vec::with_capacity(live.len());
            let mut cmds = Vec::with_capacity(lens.iter().sum());
            for c in live {
                cmds.extend(c.cmds);
                replies.push(c.reply);
            }
            let entry = Stamped {
                now_ms: self.time.stamp(),
                cmd: A::batch(cmds),
            };
            let raft = self.raft.clone();
            tokio::spawn(async move {
                let result = raft.client_write(entry).await;
                drop(slot);
                answer::<A>(result.map(|r| r.data).map_err(write_error), lens, replies);
            });
        }
    }

    /// `first` and the calls queued behind it, up to the entry's size (calls are never split).
    fn gather(&mut self, first: Call<A>) -> Vec<Call<A>> {
        let mut items = first.cmds.len();
        let mut calls = vec![first];
        while items < self.max_entry_items {
            let Ok(c) = self.rx.try_recv() else {
                break;
            };
            if items + c.cmds.len() > self.max_entry_items {
                self.carry = Some(c);
                break;
            }
            items += c.cmds.len();
            calls.push(c);
        }
        calls
    }
}

/// Adds `n` to the `queued` count when that stays within `capacity` (or the queue is empty, so
/// a call larger than the bound still goes through alone), atomically against other callers.
fn reserve(queued: &AtomicUsize, capacity: usize, n: usize) -> Result<(), CommitError> {
    let mut current = queued.load(Ordering::Acquire);
    loop {
        let fits = current == 0 || current.saturating_add(n) <= capacity;
        if !fits {
            return Err(CommitError::Overloaded { capacity });
        }
        let next = current.saturating_add(n);
        match queued.compare_exchange_weak(current, next, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Ok(()),
            Err(seen) => current = seen,
        }
    }
}

/// Answers calls whose deadline passed (or whose caller went away) before proposal, unapplied,
/// and returns the others.
fn drop_expired<A: App>(calls: Vec<Call<A>>, now: Instant) -> Vec<Call<A>> {
    let mut live = Vec::with_capacity(calls.len());
    for c in calls {
        let expired = c.deadline.is_some_and(|d| d <= now);
        if expired || c.reply.is_closed() {
            let _ = c.reply.send(Err(CommitError::DeadlineExceeded));
        } else {
            live.push(c);
        }
    }
    live
}

/// Splits a committed batch's responses among the calls it carried (`lens` commands each).
fn answer<A: Batching>(
    result: Result<Option<A::Response>, ClientError>,
    lens: Vec<usize>,
    replies: Vec<oneshot::Sender<Answer<A>>>,
) {
    let responses = result.and_then(|data| {
        data.and_then(A::unbatch)
            .filter(|r| r.len() == lens.iter().sum::<usize>())
            .ok_or_else(|| {
                ClientError::Rejected("a batch entry produced no batch of responses".into())
            })
    });
    match responses {
        Ok(all) => {
            let mut all = all.into_iter();
            for (n, reply) in lens.into_iter().zip(replies) {
                let _ = reply.send(Ok(all.by_ref().take(n).collect()));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone().into()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft::test_app::{CounterApp, CounterCmd};

    fn call(
        deadline: Option<Instant>,
    ) -> (Call<CounterApp>, oneshot::Receiver<Answer<CounterApp>>) {
        let (reply, rx) = oneshot::channel();
        let cmds = vec![CounterCmd::Remove { key: "k".into() }];
        let c = Call {
            cmds,
            deadline,
            reply,
        };
        (c, rx)
    }

    #[test]
    fn the_queue_bound_refuses_what_does_not_fit_and_admits_a_large_call_alone() {
        let q = AtomicUsize::new(0);
        assert_eq!(reserve(&q, 1, 1), Ok(()));
        assert_eq!(
            reserve(&q, 1, 1),
            Err(CommitError::Overloaded { capacity: 1 })
        );
        q.store(0, Ordering::Release);
        // Larger than the bound, but the queue is empty: taken alone.
        assert_eq!(reserve(&q, 4, 10), Ok(()));
        assert_eq!(
            reserve(&q, 4, 1),
            Err(CommitError::Overloaded { capacity: 4 })
        );
        // At the extremes the count saturates instead of wrapping.
        let q = AtomicUsize::new(usize::MAX - 1);
        assert!(reserve(&q, usize::MAX, 5).is_ok());
        assert_eq!(q.load(Ordering::Acquire), usize::MAX);
        assert_eq!(
            reserve(&AtomicUsize::new(0), usize::MAX, usize::MAX),
            Ok(())
        );
    }

    #[tokio::test]
    async fn expired_and_abandoned_calls_are_answered_unapplied_and_dropped() {
        let now = Instant::now();
        let (past, past_rx) = call(Some(now));
        let (future, _future_rx) = call(Some(now + Duration::from_secs(3_600)));
        let (none, _none_rx) = call(None);
        let (gone, gone_rx) = call(None);
        drop(gone_rx);
        let live = drop_expired(vec![past, future, none, gone], now);
        assert_eq!(
            live.len(),
            2,
            "the call without a deadline and the later one stay"
        );
        assert!(live.iter().all(|c| !c.reply.is_closed()));
        assert_eq!(past_rx.await.ok(), Some(Err(CommitError::DeadlineExceeded)));
    }
}
