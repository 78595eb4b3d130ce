//! Requests the agent tracks after answering them (seed §24–25): reservations waiting to be
//! settled and concurrency slots waiting for `Done`, by request id.
//!
//! The registry is touched only by requests that carry an id and either reserve or hold a slot;
//! a plain Check never takes its lock. The lock is never held across a decision or a refund:
//! an entry is switched to its next state under the lock and the work happens after.
//!
//! Every entry has a deadline: an abandoned reservation expires (its cost stays spent, its
//! slots are freed) and a forgotten request's slots are freed. Settled and expired reservations
//! leave a tombstone for a while, so a repeated Settle gets the same answer.

use allot_common::concurrency::Permit;
use allot_common::units::{Micros, Nanos};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

pub use allot_common::descriptor::{OwnedDescriptor, OwnedRequest};

/// An admitted reservation.
#[derive(Debug)]
pub struct Reservation<V> {
    /// The request as reserved (its cost is the maximum).
    pub request: OwnedRequest,
    /// Tokens spent per descriptor (0 where nothing was spent: no limit, or a shadow denial).
    pub spent: Vec<u64>,
    /// When it was spent, ns (windows refund only while that window is current).
    pub spent_at: Nanos,
    /// The answer given, repeated to a retried Reserve.
    pub answer: V,
}

/// Lifecycle of a tracked request.
#[derive(Debug)]
enum Phase {
    /// A Reserve with this id is being decided.
    Pending,
    /// Admitted: holding slots and/or a reservation until `expires_at`.
    Active,
    /// Settled at `actual` tokens, `refunded` tokens given back per descriptor.
    Settled { actual: u64, refunded: u64 },
    /// Expired unsettled: its cost stayed spent.
    Expired,
}

#[derive(Debug)]
struct Tracked<V> {
    phase: Phase,
    permits: Vec<Permit>,
    reservation: Option<Arc<Reservation<V>>>,
    /// Active: when it expires; Pending: when a lost decision is given up; tombstones: when
    /// they are forgotten. ns.
    until: Nanos,
}

/// Why the registry refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TrackingError {
    /// No reservation or request with this id is known (never made, or long forgotten).
    #[error("no reservation {0:?} is known (never made, or forgotten after it ended)")]
    NotFound(String),
    /// The reservation expired before it was settled: its cost stays spent.
    #[error("reservation {0:?} expired before it was settled; its cost stays spent")]
    Expired(String),
    /// A Reserve with this id is still being decided.
    #[error("a Reserve with request_id {0:?} is still being decided; retry")]
    InProgress(String),
    /// The id belongs to a checked request, not a reservation.
    #[error("request_id {0:?} is in use by a request that is not a reservation")]
    NotAReservation(String),
    /// Too many requests tracked at once (memory bound).
    #[error("{max} requests are already tracked in flight; finish or settle some first")]
    TooMany {
        /// The bound.
        max: usize,
    },
}

/// What [`TrackedRequests::begin_reserve`] found.
#[derive(Debug)]
pub enum Begin<V> {
    /// New id: it is now pending; decide, then [`TrackedRequests::admit`] or [`TrackedRequests::abandon`].
    New,
    /// A reservation with this id exists: repeat its answer (ns left until it expires).
    Existing(Arc<Reservation<V>>, Nanos),
}

/// The result of a settlement.
#[derive(Debug)]
pub struct Settlement<V> {
    /// The reservation settled.
    pub reservation: Arc<Reservation<V>>,
    /// Microtokens to give back per descriptor (empty when this settle repeats an earlier one).
    pub unused: Vec<Micros>,
    /// Tokens given back per descriptor that spent the maximum.
    pub refunded: u64,
    /// The actual cost recorded (by the first settlement).
    pub actual: u64,
    /// This call repeats an earlier settlement; nothing more is refunded.
    pub repeated: bool,
}

/// Tracked requests by id.
#[derive(Debug)]
pub struct TrackedRequests<V> {
    entries: Mutex<HashMap<String, Tracked<V>>>,
    max_tracked: usize,
    tombstone_ns: Nanos,
}

impl<V> TrackedRequests<V> {
    /// A registry tracking at most `max_tracked` requests, keeping tombstones `tombstone_ns`.
    pub fn new(max_tracked: usize, tombstone_ns: Nanos) -> Self {
        TrackedRequests {
            entries: Mutex::new(HashMap::new()),
            max_tracked,
            tombstone_ns,
        }
    }

    /// Requests tracked now (including tombstones).
    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether another request can be tracked.
    ///
    /// # Errors
    /// [`TrackingError::TooMany`] at the bound.
    pub fn has_room(&self) -> Result<(), TrackingError> {
        if self.entries.lock().len() >= self.max_tracked {
            return Err(TrackingError::TooMany {
                max: self.max_tracked,
            });
        }
        Ok(())
    }

    /// Starts a Reserve with id `id` at `now`; a pending entry is given up at `give_up_at`.
    ///
    /// # Errors
    /// [`TrackingError::InProgress`] when the same id is being decided,
    /// [`TrackingError::Expired`] when its reservation expired, [`TrackingError::NotAReservation`]
    /// when a checked request holds the id, [`TrackingError::TooMany`] at the bound.
    pub fn begin_reserve(
        &self,
        id: &str,
        now: Nanos,
        give_up_at: Nanos,
    ) -> Result<Begin<V>, TrackingError> {
        let mut m = self.entries.lock();
        if let Some(t) = m.get_mut(id) {
            if matches!(t.phase, Phase::Active) && now >= t.until {
                expire(t, now, self.tombstone_ns);
            }
            return match (&t.phase, &t.reservation) {
                (Phase::Pending, _) => Err(TrackingError::InProgress(id.to_string())),
                (Phase::Expired, _) => Err(TrackingError::Expired(id.to_string())),
                (_, None) => Err(TrackingError::NotAReservation(id.to_string())),
                (Phase::Active, Some(r)) => {
                    Ok(Begin::Existing(r.clone(), t.until.saturating_sub(now)))
                }
                (Phase::Settled { .. }, Some(r)) => Ok(Begin::Existing(r.clone(), 0)),
            };
        }
        if m.len() >= self.max_tracked {
            return Err(TrackingError::TooMany {
                max: self.max_tracked,
            });
        }
        m.insert(
            id.to_string(),
            Tracked {
                phase: Phase::Pending,
                permits: Vec::new(),
                reservation: None,
                until: give_up_at,
            },
        );
        Ok(Begin::New)
    }

    /// Records the admitted reservation `id` (pending before), holding `permits` until
    /// `expires_at`.
    pub fn admit(
        &self,
        id: &str,
        reservation: Arc<Reservation<V>>,
        permits: Vec<Permit>,
        expires_at: Nanos,
    ) {
        self.entries.lock().insert(
            id.to_string(),
            Tracked {
                phase: Phase::Active,
                permits,
                reservation: Some(reservation),
                until: expires_at,
            },
        );
    }

    /// Forgets the pending Reserve `id` (it was denied or failed): a retry decides afresh.
    pub fn abandon(&self, id: &str) {
        let mut m = self.entries.lock();
        if m.get(id).is_some_and(|t| matches!(t.phase, Phase::Pending)) {
            m.remove(id);
        }
    }

    /// Holds the slots of checked request `id` until `expires_at` (added to any it holds).
    pub fn hold(&self, id: &str, permits: Vec<Permit>, expires_at: Nanos) {
        let mut m = self.entries.lock();
        match m.get_mut(id) {
            // The id is reused: the slots join the entry and go with it (Done, settlement,
            // expiry). Its phase is left alone, so a settled reservation is never revived.
            Some(t) => {
                t.permits.extend(permits);
                t.until = t.until.max(expires_at);
            }
            None => {
                m.insert(
                    id.to_string(),
                    Tracked {
                        phase: Phase::Active,
                        permits,
                        reservation: None,
                        until: expires_at,
                    },
                );
            }
        }
    }

    /// Settles reservation `id` at `actual` tokens at `now`: its slots are freed and the unused
    /// cost per descriptor (`spent − min(spent, actual)`) is returned for the caller to refund.
    /// A repeated settlement returns the first one's numbers with nothing to refund.
    ///
    /// # Errors
    /// [`TrackingError::NotFound`], [`TrackingError::Expired`], [`TrackingError::InProgress`],
    /// [`TrackingError::NotAReservation`].
    pub fn settle(
        &self,
        id: &str,
        actual: u64,
        now: Nanos,
    ) -> Result<Settlement<V>, TrackingError> {
        let (settlement, freed) = {
            let mut m = self.entries.lock();
            let t = m
                .get_mut(id)
                .ok_or_else(|| TrackingError::NotFound(id.to_string()))?;
            if matches!(t.phase, Phase::Active) && now >= t.until {
                expire(t, now, self.tombstone_ns);
            }
            let Some(r) = t.reservation.clone() else {
                return Err(match t.phase {
                    Phase::Pending => TrackingError::InProgress(id.to_string()),
                    _ => TrackingError::NotAReservation(id.to_string()),
                });
            };
            match t.phase {
                Phase::Pending => return Err(TrackingError::InProgress(id.to_string())),
                Phase::Expired => return Err(TrackingError::Expired(id.to_string())),
                Phase::Settled { actual, refunded } => {
                    return Ok(Settlement {
                        reservation: r,
                        unused: Vec::new(),
                        refunded,
                        actual,
                        repeated: true,
                    })
                }
                Phase::Active => {}
            }
            let unused: Vec<Micros> = r
                .spent
                .iter()
                .map(|&s| allot_common::units::tokens_to_micros(s - s.min(actual)))
                .collect();
            let refunded = r
                .spent
                .iter()
                .map(|&s| s - s.min(actual))
                .max()
                .unwrap_or(0);
            t.phase = Phase::Settled { actual, refunded };
            t.until = now.saturating_add(self.tombstone_ns);
            let freed = std::mem::take(&mut t.permits);
            (
                Settlement {
                    reservation: r,
                    unused,
                    refunded,
                    actual,
                    repeated: false,
                },
                freed,
            )
        };
        // Slots are freed outside the lock (dropping a permit is an atomic decrement anyway).
        drop(freed);
        Ok(settlement)
    }

    /// Frees the concurrency slots of request `id`; returns how many. A checked request is
    /// forgotten; a reservation stays, to be settled or to expire.
    pub fn done(&self, id: &str) -> u64 {
        let freed = {
            let mut m = self.entries.lock();
            let Some(t) = m.get_mut(id) else { return 0 };
            let freed = std::mem::take(&mut t.permits);
            if t.reservation.is_none() && !matches!(t.phase, Phase::Pending) {
                m.remove(id);
            }
            freed
        };
        freed.iter().map(Permit::slots).sum()
    }

    /// Expires what is due at `now` and forgets old tombstones; returns how many slots were
    /// freed.
    pub fn sweep(&self, now: Nanos) -> u64 {
        let mut freed = Vec::new();
        {
            let mut m = self.entries.lock();
            m.retain(|_, t| {
                if now < t.until {
                    return true;
                }
                match t.phase {
                    Phase::Active if t.reservation.is_some() => {
                        freed.append(&mut t.permits);
                        expire(t, now, self.tombstone_ns);
                        true
                    }
                    // A forgotten checked request, a lost pending decision, an old tombstone.
                    _ => {
                        freed.append(&mut t.permits);
                        false
                    }
                }
            });
        }
        freed.iter().map(Permit::slots).sum()
    }
}

fn expire<V>(t: &mut Tracked<V>, now: Nanos, tombstone_ns: Nanos) {
    t.phase = Phase::Expired;
    t.permits.clear();
    t.until = now.saturating_add(tombstone_ns);
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_common::concurrency::ConcurrencyLimiter;

    fn reservation(spent: Vec<u64>) -> Arc<Reservation<u32>> {
        Arc::new(Reservation {
            request: OwnedRequest {
                domain: "d".into(),
                descriptors: vec![(vec![("k".into(), "v".into())], None)],
                hits_addend: Some(10),
            },
            spent,
            spent_at: 0,
            answer: 7,
        })
    }

    #[test]
    fn reserve_settle_repeat_and_reuse_of_the_id() {
        let f: TrackedRequests<u32> = TrackedRequests::new(10, 1_000);
        let l = ConcurrencyLimiter::new(2);
        assert!(matches!(f.begin_reserve("r", 0, 100), Ok(Begin::New)));
        assert_eq!(
            f.begin_reserve("r", 0, 100).unwrap_err(),
            TrackingError::InProgress("r".into())
        );
        f.admit(
            "r",
            reservation(vec![10, 0]),
            vec![l.try_acquire(1).unwrap()],
            50,
        );
        assert!(matches!(
            f.begin_reserve("r", 1, 100),
            Ok(Begin::Existing(_, 49))
        ));
        let s = f.settle("r", 4, 10).unwrap();
        assert_eq!(
            (s.unused.clone(), s.refunded, s.repeated),
            (vec![6_000_000, 0], 6, false)
        );
        assert_eq!(l.in_flight(), 0, "settling frees the slots");
        // A checked request reusing the id does not revive the settled reservation.
        f.hold("r", vec![l.try_acquire(1).unwrap()], 100);
        let s = f.settle("r", 0, 11).unwrap();
        assert_eq!(
            (s.refunded, s.actual, s.repeated, s.unused.len()),
            (6, 4, true, 0)
        );
        assert_eq!(f.done("r"), 1);
        assert_eq!(l.in_flight(), 0);
        assert_eq!(
            f.settle("x", 1, 0).unwrap_err(),
            TrackingError::NotFound("x".into())
        );
    }

    #[test]
    fn expiry_frees_slots_keeps_tombstones_then_forgets() {
        let f: TrackedRequests<u32> = TrackedRequests::new(10, 1_000);
        let l = ConcurrencyLimiter::new(3);
        f.admit(
            "r",
            reservation(vec![10]),
            vec![l.try_acquire(1).unwrap()],
            50,
        );
        f.hold("c", vec![l.try_acquire(1).unwrap()], 60);
        assert!(matches!(f.begin_reserve("p", 0, 70), Ok(Begin::New)));
        assert_eq!(f.sweep(49), 0);
        assert_eq!(f.sweep(60), 2, "the reservation and the checked request");
        assert_eq!(l.in_flight(), 0);
        assert_eq!(
            f.settle("r", 0, 61).unwrap_err(),
            TrackingError::Expired("r".into())
        );
        assert_eq!(
            f.settle("c", 0, 61).unwrap_err(),
            TrackingError::NotFound("c".into())
        );
        f.sweep(70);
        assert!(
            matches!(f.begin_reserve("p", 71, 80), Ok(Begin::New)),
            "lost pending mark"
        );
        f.abandon("p");
        f.sweep(60 + 1_000);
        assert_eq!(
            f.settle("r", 0, 2_000).unwrap_err(),
            TrackingError::NotFound("r".into())
        );
        assert!(f.is_empty());
    }

    #[test]
    fn the_number_of_tracked_requests_is_bounded() {
        let f: TrackedRequests<u32> = TrackedRequests::new(1, 1_000);
        assert!(matches!(f.begin_reserve("a", 0, 10), Ok(Begin::New)));
        assert_eq!(f.has_room(), Err(TrackingError::TooMany { max: 1 }));
        assert_eq!(
            f.begin_reserve("b", 0, 10).unwrap_err(),
            TrackingError::TooMany { max: 1 }
        );
        f.hold("c", Vec::new(), 5);
        assert_eq!(
            f.settle("c", 0, 1).unwrap_err(),
            TrackingError::NotAReservation("c".into())
        );
    }

    #[test]
    fn owned_requests_round_trip() {
        let r = reservation(vec![]);
        let back = r.request.with_request(OwnedRequest::from_request);
        assert_eq!(back, r.request);
    }
}
