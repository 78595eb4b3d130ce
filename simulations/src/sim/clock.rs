//! Simulated clocks: every node reads the simulation's virtual time through its own oscillator,
//! which may run fast or slow (drift, parts per million) and, for the allocator's wall clock,
//! be stepped (an operator or NTP setting it). Both seams are production's: the allocator's
//! [`allot_allocator::raft::NodeClock`] and the decision core's [`allot_common::clock::Clock`].

use std::cell::Cell;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use allot_common::units::Nanos;

/// Nanoseconds per millisecond.
const NANOS_PER_MS: u64 = 1_000_000;

thread_local! {
    /// The driver's virtual time while no host runs (between steps), ns.
    static DRIVER_NOW: Cell<u64> = const { Cell::new(0) };
}

/// Sets the virtual time reported outside hosts (the driver calls it every step).
pub fn set_driver_now(ns: u64) {
    DRIVER_NOW.with(|c| c.set(ns));
}

/// The simulation's true time, ns since its start: the running host's virtual time, or the
/// driver's between steps.
pub fn true_ns() -> u64 {
    match turmoil::sim_elapsed() {
        Some(d) => u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
        None => DRIVER_NOW.with(Cell::get),
    }
}

/// `t` scaled by an oscillator `ppm` parts per million fast (negative: slow), never negative.
pub fn drifted(t: u64, ppm: i64) -> u64 {
    let t = i128::from(t);
    let scaled = t + t * i128::from(ppm) / 1_000_000;
    u64::try_from(scaled.max(0)).unwrap_or(u64::MAX)
}

/// An allocator node's clocks: monotonic = true time through its oscillator; wall = the Unix
/// epoch of the simulation + monotonic + a step offset the schedule may change.
#[derive(Debug, Clone)]
pub struct SimNodeClock {
    epoch_ms: u64,
    ppm: i64,
    step_ms: Arc<AtomicI64>,
}

impl SimNodeClock {
    /// A clock starting at Unix `epoch_ms`, running `ppm` fast, stepped by what `step_ms` holds.
    pub fn new(epoch_ms: u64, ppm: i64, step_ms: Arc<AtomicI64>) -> Self {
        SimNodeClock {
            epoch_ms,
            ppm,
            step_ms,
        }
    }
}

impl allot_allocator::raft::NodeClock for SimNodeClock {
    fn now_ms(&self) -> u64 {
        let mono_ms = self.monotonic_ns() / NANOS_PER_MS;
        let wall = i128::from(self.epoch_ms)
            + i128::from(mono_ms)
            + i128::from(self.step_ms.load(Ordering::SeqCst));
        u64::try_from(wall.max(0)).unwrap_or(u64::MAX)
    }

    fn monotonic_ns(&self) -> u64 {
        drifted(true_ns(), self.ppm)
    }
}

/// An agent's clock (the production agent's is monotonic, anchored at Unix time once): the
/// simulation's Unix epoch + true time through an oscillator `ppm` fast.
#[derive(Debug, Clone, Copy)]
pub struct AgentClock {
    epoch_ns: Nanos,
    ppm: i64,
}

impl AgentClock {
    /// A clock starting at Unix `epoch_ns` running `ppm` fast.
    pub fn new(epoch_ns: Nanos, ppm: i64) -> Self {
        AgentClock { epoch_ns, ppm }
    }
}

impl allot_common::clock::Clock for AgentClock {
    fn now(&self) -> Nanos {
        self.epoch_ns.saturating_add(drifted(true_ns(), self.ppm))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_scales_exactly_and_never_goes_negative() {
        assert_eq!(drifted(1_000_000_000, 0), 1_000_000_000);
        assert_eq!(drifted(1_000_000_000, 1_000), 1_001_000_000);
        assert_eq!(drifted(1_000_000_000, -1_000), 999_000_000);
        assert_eq!(drifted(u64::MAX, 1_000_000), u64::MAX);
        assert_eq!(drifted(5, -2_000_000), 0);
    }
}
