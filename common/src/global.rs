//! The seam between the decision core and leased global quota (design §2, §3).
//!
//! Inside an agent, rules with `scope: global` are not decided from local state: their tokens come
//! from allocations the allocator granted.
//! [`Limiter::decide_with`](crate::limiter::Limiter::decide_with) asks a [`GlobalLimits`]
//! implementation to *reserve* the cost of such descriptors, and cancels the reservations when any
//! other descriptor denies, so multi-descriptor requests stay all-or-nothing and shadow mode
//! behaves exactly as for local rules.

use crate::config::Rule;
use crate::decision::Decision;
use crate::descriptor::Entry;
use crate::units::{Micros, Nanos};

/// A descriptor whose rule is leased.
#[derive(Debug, Clone, Copy)]
pub struct GlobalKey<'a> {
    /// The request's domain.
    pub domain: &'a str,
    /// The matched rule.
    pub rule: &'a Rule,
    /// Its index in the domain's rules.
    pub rule_index: u32,
    /// The descriptor's entries (the key).
    pub entries: &'a [Entry<'a>],
}

/// The answer for one leased descriptor.
#[derive(Debug)]
pub struct GlobalDecision<R> {
    /// Allowed, remaining (what this agent can still spend locally), reset and retry-after.
    pub decision: Decision,
    /// Present when allowed and reserved: pass it to [`GlobalLimits::cancel`] to give it back.
    pub reservation: Option<R>,
    /// The key holds no allocation yet: an Acquire has been started and the caller may wait for
    /// it and decide again (the only decision that may wait on the network).
    pub cold: bool,
    /// Denied because the allocator could not be reached for the key and the rule's failure
    /// mode (design §7) denied: not a verdict on the contract ([`Reason::AllocatorUnreachable`]).
    ///
    /// [`Reason::AllocatorUnreachable`]: crate::limiter::Reason::AllocatorUnreachable
    pub unreachable: bool,
}

/// Leased enforcement of `scope: global` rules. Implementations must not block: the decision
/// path holds no lock across the network.
pub trait GlobalLimits {
    /// What [`reserve`](Self::reserve) takes and [`cancel`](Self::cancel) gives back.
    type Reservation;

    /// Takes `cost` microtokens for `key` at `now` if the key's allocations can cover it.
    fn reserve(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<Self::Reservation>;

    /// As [`reserve`](Self::reserve), for a caller that will never cancel (a request of one
    /// descriptor): an implementation may skip keeping what a cancel would need, and the
    /// decision's `reservation` may be `None` even when allowed.
    fn commit(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<Self::Reservation> {
        self.reserve(key, cost, now)
    }

    /// Whether `reserve` would allow, without taking anything: the decision's remaining is
    /// what the key holds now (the request is already denied elsewhere, nothing will be spent).
    fn peek(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<Self::Reservation>;

    /// Returns a reservation's tokens (the request was denied by another descriptor).
    fn cancel(&self, reservation: Self::Reservation);

    /// Gives back `micros` that an earlier admitted request turned out not to use (a settled
    /// reservation, design §10 "Refunds"). Never creates tokens beyond what was spent for the key.
    fn refund(&self, key: GlobalKey<'_>, micros: Micros, now: Nanos);
}
