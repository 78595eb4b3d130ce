//! The lease work waiting to be sent to the allocator, in two lanes (issue 9 item 3).
//!
//! - **urgent**: `Decide`s (a request waits for each) and `Acquire`s (a cold or exhausted key's
//!   requests may wait for it; a prefetch keeps a hot key from running dry);
//! - **routine**: `Report`s and `Release`s of a maintenance pass (nobody waits for them).
//!
//! A call takes urgent work first, so a decision never waits behind a tick's reports for
//! thousands of keys; the manager keeps one call slot free of routine-only calls (see
//! [`manager`](super::manager)), so urgent work always finds a call slot. Each allocation has at most
//! one Report or Release queued *or in flight* ([`WorkQueue::settle`] ends it when its answer is
//! applied): with several calls in flight, two cumulative spends of one allocation never race
//! each other to the allocator.

use super::allocation::HeldAllocation;
use super::book::KeyLease;
use allot_common::keyed::Keyed;
use allot_common::units::Micros;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use tokio::sync::oneshot;

/// Lease work waiting to be sent; composed into its request when the call is sent, so an
/// Acquire asks for what the decisions waiting *then* need.
#[derive(Debug)]
pub enum Pending {
    /// An allocation for the key.
    Acquire(Arc<Keyed<KeyLease>>),
    /// The cumulative spend of an allocation.
    Report(Arc<Keyed<KeyLease>>, Arc<HeldAllocation>),
    /// An allocation's end, with its final spend.
    Release(Arc<Keyed<KeyLease>>, Arc<HeldAllocation>),
    /// A central decision of `cost` µtokens; `done` fires when its answer is on the key.
    Decide(Arc<Keyed<KeyLease>>, Micros, oneshot::Sender<()>),
}

impl Pending {
    /// The key the work is for.
    pub fn key(&self) -> &Arc<Keyed<KeyLease>> {
        match self {
            Pending::Acquire(k)
            | Pending::Report(k, _)
            | Pending::Release(k, _)
            | Pending::Decide(k, _, _) => k,
        }
    }

    /// The allocation a Report or Release is for.
    pub fn allocation_id(&self) -> Option<u64> {
        match self {
            Pending::Report(_, a) | Pending::Release(_, a) => Some(a.id),
            Pending::Acquire(_) | Pending::Decide(..) => None,
        }
    }

    fn urgent(&self) -> bool {
        matches!(self, Pending::Acquire(_) | Pending::Decide(..))
    }

    /// A Decide whose request stopped waiting: nobody would use its answer, and sending it
    /// would debit the allocator for nothing.
    fn abandoned(&self) -> bool {
        matches!(self, Pending::Decide(_, _, done) if done.is_closed())
    }
}

/// The two lanes and the allocations with a Report or Release queued or in flight.
#[derive(Debug, Default)]
pub struct WorkQueue {
    urgent: VecDeque<Pending>,
    routine: VecDeque<Pending>,
    busy: HashSet<u64>,
}

impl WorkQueue {
    /// Queues `p`. A Report or Release of an allocation that has one queued or in flight is
    /// dropped (the next maintenance pass sends the newer spend); returns whether it was queued.
    pub fn push(&mut self, p: Pending) -> bool {
        if let Some(id) = p.allocation_id() {
            if !self.busy.insert(id) {
                return false;
            }
        }
        if p.urgent() {
            self.urgent.push_back(p);
        } else {
            self.routine.push_back(p);
        }
        true
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.urgent.is_empty() && self.routine.is_empty()
    }

    /// Whether urgent work is queued.
    pub fn has_urgent(&self) -> bool {
        !self.urgent.is_empty()
    }

    /// Takes up to `max` items for one call: urgent work first (abandoned Decides dropped),
    /// then routine work when `routine` allows it. The allocations taken stay busy until
    /// [`settle`](Self::settle).
    pub fn take(&mut self, max: usize, routine: bool) -> Vec<Pending> {
        self.urgent.retain(|p| !p.abandoned());
        let n = self.urgent.len().min(max);
        let mut batch: Vec<Pending> = self.urgent.drain(..n).collect();
        if routine {
            let m = self.routine.len().min(max - n);
            batch.extend(self.routine.drain(..m));
        }
        batch
    }

    /// The answer for allocation `id`'s Report or Release is applied: a new one may be queued.
    pub fn settle(&mut self, id: u64) {
        self.busy.remove(&id);
    }

    /// Drops everything queued and forgets what is in flight (shutdown: every allocation is
    /// then released once, whatever was pending).
    pub fn clear(&mut self) {
        self.urgent.clear();
        self.routine.clear();
        self.busy.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Arc<Keyed<KeyLease>> {
        super::super::tests::some_key()
    }

    fn alloc(id: u64) -> Arc<HeldAllocation> {
        Arc::new(HeldAllocation::new(id, 1, 10, 5, 0, 1))
    }

    fn kinds(v: &[Pending]) -> Vec<&'static str> {
        v.iter()
            .map(|p| match p {
                Pending::Acquire(_) => "acquire",
                Pending::Report(..) => "report",
                Pending::Release(..) => "release",
                Pending::Decide(..) => "decide",
            })
            .collect()
    }

    #[test]
    fn urgent_work_goes_first_and_routine_only_when_allowed() {
        let (k, mut q) = (key(), WorkQueue::default());
        assert!(q.push(Pending::Report(k.clone(), alloc(1))));
        assert!(q.push(Pending::Release(k.clone(), alloc(2))));
        let (tx, _rx) = oneshot::channel();
        assert!(q.push(Pending::Decide(k.clone(), 5, tx)));
        assert!(q.push(Pending::Acquire(k.clone())));
        assert!(q.has_urgent());
        assert_eq!(kinds(&q.take(10, false)), ["decide", "acquire"]);
        assert!(!q.has_urgent() && !q.is_empty());
        assert_eq!(kinds(&q.take(1, true)), ["report"]);
        assert_eq!(kinds(&q.take(usize::MAX, true)), ["release"]);
        assert!(q.is_empty());
        assert!(q.take(0, true).is_empty());
    }

    #[test]
    fn an_allocation_has_one_report_or_release_until_its_answer_is_applied() {
        let (k, mut q) = (key(), WorkQueue::default());
        assert!(q.push(Pending::Report(k.clone(), alloc(7))));
        assert!(!q.push(Pending::Report(k.clone(), alloc(7))), "queued");
        let sent = q.take(10, true);
        assert_eq!(sent.len(), 1);
        assert!(!q.push(Pending::Release(k.clone(), alloc(7))), "in flight");
        q.settle(7);
        assert!(q.push(Pending::Release(k.clone(), alloc(7))));
        q.clear();
        assert!(q.is_empty());
        assert!(q.push(Pending::Report(k, alloc(7))), "forgotten by clear");
    }

    #[test]
    fn abandoned_decides_are_never_sent() {
        let (k, mut q) = (key(), WorkQueue::default());
        let (gone, rx) = oneshot::channel();
        drop(rx);
        let (kept, _rx) = oneshot::channel();
        q.push(Pending::Decide(k.clone(), 1, gone));
        q.push(Pending::Decide(k, 2, kept));
        let sent = q.take(10, true);
        assert!(matches!(sent.as_slice(), [Pending::Decide(_, 2, _)]));
    }
}
