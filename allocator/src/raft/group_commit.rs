//! Group commit on the leader (issue 9 item 3): concurrent proposals, from every RPC, agent and
//! key, wait in one bounded queue and are proposed together as one batch command per Raft entry,
//! so a whole batch costs one replication round and one fsync per node instead of one per
//! command. Every caller is answered only after its entry committed and applied (a leader crash
//! loses no answered decision).
//!
//! Flushing: the flusher proposes as soon as an entry slot is free (at most
//! [`GroupCommitConfig::max_in_flight`] entries proposed and not yet committed); while entries
//! are in flight, new calls accumulate and go out together in the next entry, up to
//! [`GroupCommitConfig::max_entry_items`] commands, or an equal share of the queue over the
//! entry slots when the queue is deeper (adaptive size: a backlog drains in one round of
//! in-flight entries, so throughput under a backlog is not capped at `max_in_flight ×
//! max_entry_items` per commit latency). The batch grows with the load by itself: a lone call
//! pays one commit, a flood shares them. An optional [`GroupCommitConfig::window`] waits a
//! little longer before each flush.
//!
//! Overload: the queue holds at most [`GroupCommitConfig::queue_items`] commands not yet
//! proposed; a call that does not fit is refused at once, unapplied ([`CommitError::Overloaded`]),
//! so the queue never grows into latency that every caller then times out on (congestion
//! collapse). A call carries its deadline: commands whose deadline passed, or whose caller went
//! away, before they were proposed are dropped unapplied ([`CommitError::DeadlineExceeded`]);
//! so are those whose deadline falls before the entry can commit (the moving average of recent
//! entries' commit latency, [`CommitLatency`]): committing them would be work whose answer
//! nobody reads, taken from callers that can still be answered in time.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
    /// Most commands in one entry while the queue holds at most `max_in_flight` times this;
    /// a deeper queue is divided equally over the entry slots. A call is never split, so an
    /// entry can exceed its size by one call's commands less one. Must be > 0.
    pub max_entry_items: usize,
    /// Most entries proposed and not yet committed. 1 flushes exactly when the previous entry
    /// has committed. Must be > 0.
    pub max_in_flight: usize,
    /// Extra wait before each flush, to let more calls join; zero flushes as soon as an entry
    /// slot is free.
    pub window: Duration,
    /// Whether the server refuses new writes from their headers alone while the queue is nearly
    /// full ([`GroupCommit::shedding`]); `false` leaves every refusal to the exact bound, after
    /// decoding (kept for comparison: `--no-shed` in the cluster benchmark).
    pub shed_early: bool,
    /// How long a follower sheds the agents' writes itself after the leader refused one it
    /// forwarded OVERLOADED as a whole (`service::LeaderShedding`); zero: never. The
    /// default, 20 ms, is about what the leader's shedding margin (at most 256 commands)
    /// takes to drain at tens of thousands of commands a second, and far below the agents'
    /// own backoff after a shed answer (250 ms and up).
    pub follower_shed_hold: Duration,
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
            shed_early: true,
            follower_shed_hold: Duration::from_millis(20),
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
    /// Queued commands above which [`GroupCommit::shedding`] is true.
    shed_above: usize,
    /// Calls refused by the server's load-shedding gate (counted by [`GroupCommit::shed`]).
    shed: Arc<AtomicU64>,
    /// [`GroupCommitConfig::follower_shed_hold`].
    follower_shed_hold: Duration,
}

impl<A: Batching> Clone for GroupCommit<A> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            queued: self.queued.clone(),
            holds: self.holds.clone(),
            capacity: self.capacity,
            shed_above: self.shed_above,
            shed: self.shed.clone(),
            follower_shed_hold: self.follower_shed_hold,
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
            max_in_flight: config.max_in_flight.max(1),
            max_entry_items: config.max_entry_items.max(1),
            latency: Arc::new(CommitLatency::default()),
            window: config.window,
            carry: None,
        };
        tokio::spawn(flusher.run());
        let capacity = config.queue_items.max(1);
        Self {
            tx,
            queued,
            holds: Arc::new(holds),
            capacity,
            shed_above: match config.shed_early {
                true => shed_above(capacity, config.max_entry_items.max(1)),
                false => usize::MAX,
            },
            shed: Arc::new(AtomicU64::new(0)),
            follower_shed_hold: config.follower_shed_hold,
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

    /// Whether a new call should be refused before its body is even decoded (issue 9 item 3,
    /// load shedding): the queue is within `min(max_entry_items, queue_items / 4)` commands of
    /// full. A call that [`GroupCommit::submit`] would most likely refuse anyway is then
    /// refused by the server for the price of its headers, not of decoding, converting and
    /// answering each of its items; under twice the capacity, those refusals took CPU from
    /// the commits (`docs/benchmarks.md`, "Overload"). The margin keeps the queue deep
    /// enough to fill the next entries (a call that gets past the gate still meets the exact
    /// bound in `submit`). Racy by design: a call shed a moment before the queue drained is
    /// like one that arrived a moment earlier.
    pub fn shedding(&self) -> bool {
        self.queued.load(Ordering::Acquire) > self.shed_above
    }

    /// Counts one call the server's load-shedding gate refused (because
    /// [`GroupCommit::shedding`] was true, or, on a follower, because the leader had just
    /// refused a forwarded write OVERLOADED).
    pub fn count_shed(&self) {
        self.shed.fetch_add(1, Ordering::Relaxed);
    }

    /// [`GroupCommitConfig::follower_shed_hold`].
    pub fn follower_shed_hold(&self) -> Duration {
        self.follower_shed_hold
    }

    /// Calls the server's load-shedding gate refused since start ([`GroupCommit::count_shed`]).
    pub fn shed(&self) -> u64 {
        self.shed.load(Ordering::Relaxed)
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
    max_in_flight: usize,
    max_entry_items: usize,
    /// Recent entries' commit latency, to drop calls that cannot be answered in time.
    latency: Arc<CommitLatency>,
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
            let cap = entry_size(
                self.queued.load(Ordering::Acquire),
                self.max_in_flight,
                self.max_entry_items,
            );
            let calls = self.gather(first, cap);
            let taken: usize = calls.iter().map(|c| c.cmds.len()).sum();
            self.queued.fetch_sub(taken, Ordering::AcqRel);
            let live = drop_expired(calls, Instant::now(), self.latency.estimate());
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
            let (raft, latency) = (self.raft.clone(), self.latency.clone());
            tokio::spawn(async move {
                let proposed = Instant::now();
                let result = raft.client_write(entry).await;
                latency.record(proposed.elapsed());
                drop(slot);
                answer::<A>(result.map(|r| r.data).map_err(write_error), lens, replies);
            });
        }
    }

    /// `first` and the calls queued behind it, up to `cap` commands (calls are never split).
    fn gather(&mut self, first: Call<A>, cap: usize) -> Vec<Call<A>> {
        let mut items = first.cmds.len();
        let mut calls = vec![first];
        while items < cap {
            let Ok(c) = self.rx.try_recv() else {
                break;
            };
            if items.saturating_add(c.cmds.len()) > cap {
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

/// The queue depth above which new calls are shed before decoding: `capacity` less
/// `min(max_entry_items, capacity / 4)` (the default 4,096 and 256: above 3,840). A queue of
/// fewer than four commands is never shed early: its exact bound refuses alone.
fn shed_above(capacity: usize, max_entry_items: usize) -> usize {
    capacity - max_entry_items.min(capacity / 4)
}

/// The size of the next entry, in commands: `max_entry_items`, or an equal share of the
/// `queued` commands over the `max_in_flight` entry slots when that is larger.
fn entry_size(queued: usize, max_in_flight: usize, max_entry_items: usize) -> usize {
    queued
        .div_ceil(max_in_flight.max(1))
        .max(max_entry_items)
        .max(1)
}

/// The most a call's deadline must lie beyond the flush for the call to be proposed.
const MAX_COMMIT_MARGIN: Duration = Duration::from_millis(100);

/// A moving average of how long an entry takes from proposal to applied (weight 1/8 for the
/// newest), in nanoseconds; zero until the first entry committed.
#[derive(Debug, Default)]
struct CommitLatency(AtomicU64);

impl CommitLatency {
    /// Adds one entry's commit latency (saturating at `u64::MAX` ns).
    fn record(&self, took: Duration) {
        let took = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |old| {
                Some((old - old / 8).saturating_add(took / 8))
            });
    }

    /// The current average, at most [`MAX_COMMIT_MARGIN`]: an average left high by a stall
    /// (an election) only drops calls that have less than that left, so fresh calls still
    /// commit and bring it down again.
    fn estimate(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Acquire)).min(MAX_COMMIT_MARGIN)
    }
}

/// Answers calls whose deadline falls within `margin` of `now` (passed, or too close for an
/// entry proposed now to commit in time) or whose caller went away, unapplied, and returns the
/// others.
fn drop_expired<A: App>(calls: Vec<Call<A>>, now: Instant, margin: Duration) -> Vec<Call<A>> {
    let mut live = Vec::with_capacity(calls.len());
    let horizon = now.checked_add(margin).unwrap_or(now);
    for c in calls {
        let expired = c.deadline.is_some_and(|d| d <= horizon);
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
    fn calls_are_shed_only_within_a_quarter_queue_or_an_entry_of_full() {
        // The defaults: shed above 3,840 of 4,096.
        assert_eq!(shed_above(4_096, 256), 3_840);
        // A small queue keeps three quarters.
        assert_eq!(shed_above(64, 256), 48);
        assert_eq!(shed_above(8, 4), 6);
        // Below four commands nothing is shed early (the exact bound refuses alone).
        assert_eq!(shed_above(3, 256), 3);
        assert_eq!(shed_above(1, 1), 1);
        // The extremes do not overflow.
        assert_eq!(shed_above(usize::MAX, 1), usize::MAX - 1);
        assert_eq!(
            shed_above(usize::MAX, usize::MAX),
            usize::MAX - usize::MAX / 4
        );
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
        let live = drop_expired(vec![past, future, none, gone], now, Duration::ZERO);
        assert_eq!(
            live.len(),
            2,
            "the call without a deadline and the later one stay"
        );
        assert!(live.iter().all(|c| !c.reply.is_closed()));
        assert_eq!(past_rx.await.ok(), Some(Err(CommitError::DeadlineExceeded)));
    }

    #[tokio::test]
    async fn calls_that_cannot_commit_before_their_deadline_are_dropped_unapplied() {
        let now = Instant::now();
        let (soon, soon_rx) = call(Some(now + Duration::from_millis(5)));
        let (later, _later_rx) = call(Some(now + Duration::from_millis(50)));
        let live = drop_expired(vec![soon, later], now, Duration::from_millis(10));
        assert_eq!(
            live.len(),
            1,
            "only the call with time for a 10 ms commit stays"
        );
        assert_eq!(soon_rx.await.ok(), Some(Err(CommitError::DeadlineExceeded)));
        // A margin beyond what the clock can represent drops nothing it cannot compute.
        let (far, _far_rx) = call(Some(now + Duration::from_secs(1)));
        assert_eq!(drop_expired(vec![far], now, Duration::MAX).len(), 1);
    }

    #[test]
    fn entries_grow_to_drain_a_deep_queue_over_the_slots() {
        assert_eq!(entry_size(0, 4, 256), 256);
        assert_eq!(entry_size(1_024, 4, 256), 256);
        assert_eq!(entry_size(1_025, 4, 256), 257);
        assert_eq!(entry_size(4_096, 4, 256), 1_024);
        // Zero settings and the extremes never divide by zero or overflow.
        assert_eq!(entry_size(0, 0, 0), 1);
        assert_eq!(entry_size(usize::MAX, 1, 1), usize::MAX);
        assert_eq!(entry_size(usize::MAX, usize::MAX, 0), 1);
    }

    #[test]
    fn the_commit_latency_average_follows_recent_entries_and_saturates() {
        let l = CommitLatency::default();
        assert_eq!(l.estimate(), Duration::ZERO);
        for _ in 0..64 {
            l.record(Duration::from_millis(8));
        }
        let ms = l.estimate().as_millis();
        assert!((7..=8).contains(&ms), "{ms}");
        l.record(Duration::MAX);
        assert_eq!(l.estimate(), MAX_COMMIT_MARGIN, "capped");
        assert!(l.0.load(Ordering::Acquire) >= u64::MAX / 8);
        for _ in 0..1_000 {
            l.record(Duration::ZERO);
        }
        assert!(l.estimate() < Duration::from_millis(1));
    }
}
