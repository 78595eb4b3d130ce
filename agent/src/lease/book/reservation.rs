//! What a reserved lease decision holds, and how a cancel gives it back.

use super::{KeyLease, LeaseBook};
use crate::lease::allocation::HeldAllocation;
use allot_common::keyed::Keyed;
use allot_common::units::Micros;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What a reserved lease decision spent (`GlobalLimits::reserve` of [`LeaseView`](super::LeaseView)), given back by its `cancel`.
#[derive(Debug)]
pub enum LeaseReservation {
    /// Spent from an allocation; the key is given when its fuse was spent too.
    Allocation(Arc<HeldAllocation>, Micros, Option<Arc<Keyed<KeyLease>>>),
    /// Admitted from the key's central credit (the allocator's `Decide`); whether the fuse
    /// was spent too.
    Central(Arc<Keyed<KeyLease>>, Micros, bool),
}

impl LeaseBook {
    /// Returns a reservation's tokens: to its allocation (an emergency admission's included)
    /// or central credit, and to the fuse.
    pub(super) fn cancel(&self, r: LeaseReservation) {
        match r {
            LeaseReservation::Allocation(a, cost, fused) => {
                a.unspend(cost);
                if let Some(kl) = fused {
                    self.refund_fuse(&kl.value, cost);
                }
            }
            LeaseReservation::Central(kl, cost, fused) => {
                // Back to the credit (still void at its time: never used late).
                kl.value.protocol.add_credit(cost, 0);
                kl.value.admitted.fetch_sub(cost, Ordering::Relaxed);
                if fused {
                    self.refund_fuse(&kl.value, cost);
                }
            }
        }
    }
}
