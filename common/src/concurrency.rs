//! Concurrency limiter (design §10 "Concurrency"): at most N units of work in flight; a permit
//! returns its slots when dropped, so an early return or a panic in the caller cannot leak
//! capacity.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The limiter has fewer free slots than asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConcurrencyError {
    /// All slots are in use.
    #[error("{in_flight} of {max} slots in use; {wanted} more requested")]
    Full {
        /// Slots in use.
        in_flight: u64,
        /// The cap.
        max: u64,
        /// Slots requested.
        wanted: u64,
    },
    /// More slots requested than the cap: can never be granted.
    #[error("{wanted} slots requested but the cap is {max}")]
    ExceedsCapacity {
        /// Slots requested.
        wanted: u64,
        /// The cap.
        max: u64,
    },
}

/// At most `max` slots in flight. Lock-free: one compare-and-swap per acquire.
#[derive(Debug)]
pub struct ConcurrencyLimiter {
    /// The cap; a config change may move it while slots are held ([`set_max`](Self::set_max)).
    max: AtomicU64,
    in_flight: AtomicU64,
    /// Config generation the cap is from; it only moves forward ([`set_max`](Self::set_max)).
    generation: AtomicU64,
    /// Serializes cap changes, so the cap and its generation move together.
    changing: parking_lot::Mutex<()>,
}

/// Held slots; dropping it releases them.
#[derive(Debug)]
#[must_use = "dropping the permit releases its slots at once"]
pub struct Permit {
    limiter: Arc<ConcurrencyLimiter>,
    slots: u64,
}

impl ConcurrencyLimiter {
    /// A limiter with `max` slots.
    pub fn new(max: u64) -> Arc<Self> {
        Self::at_generation(max, 0)
    }

    /// A limiter with `max` slots from config generation `generation`.
    pub fn at_generation(max: u64, generation: u64) -> Arc<Self> {
        Arc::new(ConcurrencyLimiter {
            max: AtomicU64::new(max),
            in_flight: AtomicU64::new(0),
            generation: AtomicU64::new(generation),
            changing: parking_lot::Mutex::new(()),
        })
    }

    /// The config generation of the cap.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Moves the cap to `max` if `generation` is newer than the cap's (a config change, design
    /// §10 "Config versions"; a decision still on an older config never moves it back): slots
    /// held now stay held and counted, so a lowered cap admits nothing until the slots in use
    /// fall below it, and a raised one admits only the difference.
    pub fn set_max(&self, max: u64, generation: u64) {
        let _one_at_a_time = self.changing.lock();
        if generation > self.generation.load(Ordering::Acquire) {
            self.max.store(max, Ordering::Release);
            self.generation.store(generation, Ordering::Release);
        }
    }

    /// Slots in use now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The cap.
    pub fn max(&self) -> u64 {
        self.max.load(Ordering::Acquire)
    }

    /// Takes `slots` slots if they are free, without waiting.
    ///
    /// # Errors
    /// [`ConcurrencyError::Full`] when fewer are free; [`ConcurrencyError::ExceedsCapacity`]
    /// when `slots` exceeds the cap. Nothing is taken on error.
    pub fn try_acquire(self: &Arc<Self>, slots: u64) -> Result<Permit, ConcurrencyError> {
        let max = self.max();
        if slots > max {
            return Err(ConcurrencyError::ExceedsCapacity { wanted: slots, max });
        }
        let mut cur = self.in_flight.load(Ordering::Relaxed);
        loop {
            // `slots ≤ max`, so `cur + slots` stays below `cur + max`; `cur` may exceed a cap
            // lowered while its slots were held (then nothing is free).
            if slots > max.saturating_sub(cur) {
                return Err(ConcurrencyError::Full {
                    in_flight: cur,
                    max,
                    wanted: slots,
                });
            }
            match self.in_flight.compare_exchange_weak(
                cur,
                cur + slots,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Ok(Permit {
                        limiter: self.clone(),
                        slots,
                    })
                }
                Err(actual) => cur = actual,
            }
        }
    }
}

impl Permit {
    /// Slots this permit holds.
    pub fn slots(&self) -> u64 {
        self.slots
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limiter
            .in_flight
            .fetch_sub(self.slots, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_release_on_drop() {
        let l = ConcurrencyLimiter::new(3);
        let a = l.try_acquire(2).unwrap();
        assert!(matches!(
            l.try_acquire(2),
            Err(ConcurrencyError::Full { in_flight: 2, .. })
        ));
        let b = l.try_acquire(1).unwrap();
        assert_eq!(l.in_flight(), 3);
        drop(a);
        assert_eq!(l.in_flight(), 1);
        drop(b);
        assert_eq!(l.in_flight(), 0);
        assert!(matches!(
            l.try_acquire(4),
            Err(ConcurrencyError::ExceedsCapacity { .. })
        ));
    }

    #[test]
    fn concurrent_acquires_never_exceed_the_cap() {
        let l = ConcurrencyLimiter::new(5);
        let peak = Arc::new(AtomicU64::new(0));
        std::thread::scope(|s| {
            for _ in 0..4 {
                let l = l.clone();
                let peak = peak.clone();
                s.spawn(move || {
                    for _ in 0..10_000 {
                        if let Ok(p) = l.try_acquire(1) {
                            peak.fetch_max(l.in_flight(), Ordering::Relaxed);
                            drop(p);
                        }
                    }
                });
            }
        });
        assert!(peak.load(Ordering::Relaxed) <= 5);
        assert_eq!(l.in_flight(), 0);
    }
}
