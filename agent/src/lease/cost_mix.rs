//! Whether a key's requests differ in cost (issue 9, weighted costs), for the choice of
//! spending a grant at once or at a pace (see `HeldAllocation::paced`).

use allot_common::units::Micros;
use std::sync::atomic::{AtomicU64, Ordering};

/// Whether the requests seen differ in cost: the first cost noted (microtokens) in the low 63
/// bits, and the top bit set for good once another cost differs from it.
///
/// A key over its limit with requests of one cost admits the same requests whether its
/// grants are spent at once or at a pace; with costs that differ, the central counter's
/// refill lets the cheap requests in between the dear ones, and only a paced grant does the
/// same (`HeldAllocation::paced`). Pacing costs the key a lag of one pace, so it is kept for
/// the keys it changes anything for. Sticky for the key's life in the agent's table.
#[derive(Debug, Default)]
pub struct CostMix(AtomicU64);

const COSTS_DIFFER: u64 = 1 << 63;

impl CostMix {
    /// Notes a request of `cost` microtokens (costs from 2⁶³ on count as one; a cost of 0, a
    /// check that spends nothing, is no cost).
    pub fn note(&self, cost: Micros) {
        let cost = cost.min(COSTS_DIFFER - 1);
        let seen = self.0.load(Ordering::Relaxed);
        if cost == 0 || seen & COSTS_DIFFER != 0 || seen == cost {
            return;
        }
        if seen == 0 {
            // The first cost; a race with another first cost only delays the verdict by one.
            let _ = self
                .0
                .compare_exchange(0, cost, Ordering::Relaxed, Ordering::Relaxed);
        } else {
            self.0.fetch_or(COSTS_DIFFER, Ordering::Relaxed);
        }
    }

    /// Whether two noted costs ever differed.
    pub fn differs(&self) -> bool {
        self.0.load(Ordering::Relaxed) & COSTS_DIFFER != 0
    }
}

#[cfg(test)]
mod tests {
    use super::CostMix;
    use allot_common::units::MICROS_PER_TOKEN as T;

    #[test]
    fn costs_differ_once_two_in_a_row_differ_and_for_good() {
        let m = CostMix::default();
        assert!(!m.differs());
        for _ in 0..3 {
            m.note(2_000_000);
        }
        assert!(!m.differs(), "one cost, however often");
        m.note(8_000_000);
        assert!(m.differs());
        m.note(2_000_000);
        m.note(2_000_000);
        assert!(m.differs(), "sticky");
        // A check of cost 0 is no cost, before or after a cost; costs at the top saturate
        // to one.
        let zero = CostMix::default();
        zero.note(0);
        zero.note(T);
        zero.note(0);
        zero.note(T);
        assert!(!zero.differs());
        let top = CostMix::default();
        top.note(0);
        top.note(u64::MAX);
        top.note(u64::MAX - 1);
        top.note(1 << 63);
        assert!(!top.differs());
        top.note(1);
        assert!(top.differs());
    }
}
