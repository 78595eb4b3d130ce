//! The backend of [`Limiter::decide`](super::Limiter::decide): no rule is leased there.

use super::TABLE_FULL_RETRY_NS;
use crate::decision::{Decision, RetryAfter};
use crate::global::{GlobalDecision, GlobalKey, GlobalLimits};
use crate::units::{Micros, Nanos};

/// The backend of [`Limiter::decide`](super::Limiter::decide): no rule is leased, so it is never called.
pub(super) struct NoGlobal;

impl GlobalLimits for NoGlobal {
    type Reservation = ();

    fn reserve(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) -> GlobalDecision<()> {
        unreachable_global()
    }

    fn peek(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) -> GlobalDecision<()> {
        unreachable_global()
    }

    fn cancel(&self, _: ()) {}

    fn refund(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) {}
}

/// `decide` passes no backend, so no item is ever global target there; deny if that changes.
#[cold]
fn unreachable_global() -> GlobalDecision<()> {
    GlobalDecision {
        decision: Decision {
            allowed: false,
            remaining_micros: 0,
            reset_after: 0,
            retry_after: RetryAfter::After(TABLE_FULL_RETRY_NS),
        },
        reservation: None,
        cold: false,
        unreachable: false,
    }
}
