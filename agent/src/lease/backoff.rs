//! Backoff with jitter after a failed allocator call (issue 9 item 3): agents that lost the
//! allocator at the same moment must not come back at the same moment. The random source is a
//! seeded SplitMix64, so a test fixes the seed and gets the same delays every run.

use std::time::Duration;

/// Exponential backoff with "equal jitter": after the `k`-th failure in a row the wait is
/// uniform in `[d/2, d]` where `d = base · 2^(k−1)`, capped at `base · 2^MAX_DOUBLINGS`.
#[derive(Debug, Clone)]
pub struct Backoff {
    base_ms: u64,
    failures: u32,
    rng: SplitMix64,
}

/// The delay stops doubling after this many failures in a row (8× the base at most).
const MAX_DOUBLINGS: u32 = 3;

impl Backoff {
    /// Backoff from `base_ms` (the error backoff) with random source `seed`.
    pub fn new(base_ms: u64, seed: u64) -> Self {
        Backoff {
            base_ms,
            failures: 0,
            rng: SplitMix64(seed),
        }
    }

    /// A call failed: how long to wait before the next one.
    pub fn failed(&mut self) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let doublings = (self.failures - 1).min(MAX_DOUBLINGS);
        let d = self.base_ms.saturating_mul(1 << doublings);
        let half = d / 2;
        // Uniform in [0, d − half]; `% (n + 1)` with n = u64::MAX would overflow, so clamp.
        let spread = (d - half)
            .checked_add(1)
            .map_or(self.rng.next(), |n| self.rng.next() % n);
        Duration::from_millis(half.saturating_add(spread))
    }

    /// A call succeeded: the next failure starts from the base again.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a small, fast, seedable generator.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A seed for `agent_id`: FNV-1a of the id, so agents of one fleet draw different delays.
pub fn seed_for(agent_id: &str) -> u64 {
    agent_id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_within_equal_jitter_and_reset_on_success() {
        let mut b = Backoff::new(100, 7);
        let ms = |d: Duration| d.as_millis() as u64;
        let first = ms(b.failed());
        assert!((50..=100).contains(&first), "{first}");
        let second = ms(b.failed());
        assert!((100..=200).contains(&second), "{second}");
        let third = ms(b.failed());
        assert!((200..=400).contains(&third), "{third}");
        for _ in 0..10 {
            let capped = ms(b.failed());
            assert!((400..=800).contains(&capped), "{capped}");
        }
        b.succeeded();
        assert!(ms(b.failed()) <= 100);
    }

    #[test]
    fn the_same_seed_gives_the_same_delays_and_others_differ() {
        let run = |seed| {
            let mut b = Backoff::new(1_000, seed);
            (0..5).map(|_| b.failed()).collect::<Vec<_>>()
        };
        assert_eq!(run(seed_for("gw-1")), run(seed_for("gw-1")));
        assert_ne!(run(seed_for("gw-1")), run(seed_for("gw-2")));
    }

    #[test]
    fn extremes_never_overflow() {
        let mut zero = Backoff::new(0, 1);
        assert_eq!(zero.failed(), Duration::ZERO);
        let mut huge = Backoff::new(u64::MAX, u64::MAX);
        for _ in 0..10 {
            assert!(huge.failed() >= Duration::from_millis(u64::MAX / 2));
        }
    }
}
