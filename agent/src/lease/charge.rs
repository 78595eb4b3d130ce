//! What a leased decision charged, kept so a later refund goes back to exactly that place (issue
//! 10 items 5 and 13, seed §24).
//!
//! A settled reservation gives back its unused cost. For a leased descriptor the only place that
//! may take it is the allocation (an emergency admission's included) that the reservation spent
//! from, and only while that allocation is live: a refund into a newer allocation would let it admit
//! more than it was granted, and a refund into an expired or released one would be granted again
//! elsewhere. A decision that may be refunded later records its charges in a [`ChargeLog`]; the
//! reservation keeps them as [`Charged`] per descriptor.

use super::allocation::HeldAllocation;
use super::book::{KeyLease, LeaseReservation};
use allot_common::descriptor::{Entry, Request, MAX_DESCRIPTORS};
use allot_common::keyed::Keyed;
use allot_common::units::{Micros, Nanos};
use arrayvec::ArrayVec;
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Where a leased descriptor's cost was taken from.
#[derive(Debug, Clone)]
pub enum Charge {
    /// Spent from this allocation.
    Allocation(Arc<HeldAllocation>),
    /// Admitted by the allocator's central decision (`Decide`): debited there, so nothing can
    /// be given back here.
    Central,
}

/// One descriptor's charge, kept by a reservation.
#[derive(Debug, Clone)]
pub struct Charged {
    /// Index of the descriptor in its request.
    pub descriptor: usize,
    /// The key charged.
    pub key: Arc<Keyed<KeyLease>>,
    /// Where from.
    pub charge: Charge,
    /// Microtokens charged.
    pub micros: Micros,
}

impl Charged {
    /// Gives back up to `micros` (never more than was charged and not yet given back) to the
    /// place charged, if it is still live at `now`; returns what came back. An allocation takes
    /// back only spend it has not committed to a report or release
    /// ([`HeldAllocation::unspend`]).
    pub fn refund(&self, micros: Micros, now: Nanos) -> Micros {
        let want = micros.min(self.micros);
        let v = &self.key.value;
        let back = match &self.charge {
            Charge::Allocation(a) if a.is_live(now) => a.unspend(want),
            Charge::Allocation(_) => 0,
            Charge::Central => 0,
        };
        saturating_sub(&v.admitted, back);
        back
    }
}

/// `a -= v`, never below 0.
pub(crate) fn saturating_sub(a: &std::sync::atomic::AtomicU64, v: u64) {
    let _ = a.fetch_update(Ordering::AcqRel, Ordering::Acquire, |x| {
        Some(x.saturating_sub(v))
    });
}

/// One recorded reservation: the descriptor is named by its entries' address, which is unique
/// within the request being decided.
#[derive(Debug)]
struct Recorded {
    entries_at: usize,
    key: Arc<Keyed<KeyLease>>,
    charge: Charge,
    micros: Micros,
    /// The reservation, to recognise it when the decision cancels it.
    allocation_at: usize,
}

/// `allocation_at` of a central charge (no allocation; never an address).
const CENTRAL_AT: usize = usize::MAX;

/// The charges of one decision in progress (no heap allocation; one lock per recorded spend).
#[derive(Debug, Default)]
pub struct ChargeLog(Mutex<ArrayVec<Recorded, MAX_DESCRIPTORS>>);

impl ChargeLog {
    /// Records that `r` was taken for key `key` of the descriptor with `entries`.
    pub(crate) fn record(
        &self,
        entries: &[Entry<'_>],
        key: Arc<Keyed<KeyLease>>,
        r: &LeaseReservation,
    ) {
        let (charge, micros, allocation_at) = match r {
            LeaseReservation::Allocation(a, cost, _) => (
                Charge::Allocation(a.clone()),
                *cost,
                Arc::as_ptr(a) as usize,
            ),
            LeaseReservation::Central(_, cost, _) => (Charge::Central, *cost, CENTRAL_AT),
        };
        // At most one reservation per descriptor, and at most MAX_DESCRIPTORS descriptors.
        let _ = self.0.lock().try_push(Recorded {
            entries_at: entries.as_ptr() as usize,
            key,
            charge,
            micros,
            allocation_at,
        });
    }

    /// Forgets the record of a reservation the decision cancelled.
    pub(crate) fn forget(&self, r: &LeaseReservation) {
        let (at, key, cost) = match r {
            LeaseReservation::Allocation(a, cost, _) => (Arc::as_ptr(a) as usize, None, *cost),
            LeaseReservation::Central(kl, cost, _) => (CENTRAL_AT, Some(Arc::as_ptr(kl)), *cost),
        };
        let mut log = self.0.lock();
        if let Some(i) = log.iter().position(|x| {
            x.allocation_at == at
                && x.micros == cost
                && key.is_none_or(|k| std::ptr::eq(Arc::as_ptr(&x.key), k))
        }) {
            log.remove(i);
        }
    }

    /// Forgets everything recorded (a decision made again from the start).
    pub fn clear(&self) {
        self.0.lock().clear();
    }

    /// The charges recorded, by descriptor index of `req` (the request decided).
    pub fn take(&self, req: &Request<'_>) -> Vec<Charged> {
        let mut log = self.0.lock();
        log.drain(..)
            .filter_map(|x| {
                let descriptor = req
                    .descriptors
                    .iter()
                    .position(|d| d.entries.as_ptr() as usize == x.entries_at)?;
                Some(Charged {
                    descriptor,
                    key: x.key,
                    charge: x.charge,
                    micros: x.micros,
                })
            })
            .collect()
    }
}
