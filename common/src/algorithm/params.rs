//! Validated, exact parameters of a limit.

use crate::units::{
    ppm_of, tokens_to_micros, Micros, Nanos, MAX_PERIOD_NS, MAX_TOKENS, NANOS_PER_SEC,
    PPM_PER_WHOLE,
};
use std::fmt;

/// A refill rate as an exact ratio: `micros` microtokens every `per_ns` nanoseconds.
///
/// Kept as a ratio in lowest terms (never divided out) so that rates like 3 per second or 7 per
/// minute accumulate no rounding error however many small steps time advances in (design §10
/// "Units and time").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Rate {
    /// Microtokens added per period; > 0.
    pub micros: u64,
    /// Period in nanoseconds; > 0.
    pub per_ns: u64,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Rate {
    /// `micros` microtokens per `per_ns` nanoseconds, reduced to lowest terms (the same rate;
    /// smaller terms keep the algorithms' products within 64 bits, where division is cheap).
    /// `None` when either term is 0.
    pub fn new(micros: u64, per_ns: u64) -> Option<Rate> {
        Rate::reduced(u128::from(micros), u128::from(per_ns))
    }

    fn reduced(micros: u128, per_ns: u128) -> Option<Rate> {
        if micros == 0 || per_ns == 0 {
            return None;
        }
        let g = gcd(micros, per_ns);
        Some(Rate {
            micros: u64::try_from(micros / g).ok()?,
            per_ns: u64::try_from(per_ns / g).ok()?,
        })
    }

    /// `micros_per_s` microtokens per second, kept as given (not reduced: building one costs
    /// nothing on a decision path, and every method below is exact for any terms of the same
    /// ratio). A rate of 0 is allowed here; [`time_for`](Self::time_for) treats it as 1.
    #[inline]
    pub const fn per_second(micros_per_s: u64) -> Rate {
        Rate {
            micros: micros_per_s,
            per_ns: NANOS_PER_SEC,
        }
    }

    /// Nanoseconds for this rate to produce `cost` microtokens, rounded up (a wait is never
    /// reported shorter than it is); saturates at `u64::MAX`. A zero `micros` term (never built
    /// by [`new`](Self::new)) counts as one microtoken per period, never a division by zero.
    /// Exact: 64-bit where the product fits, else 128-bit.
    #[inline]
    pub fn time_for(self, cost: Micros) -> Nanos {
        let per_micro = self.micros.max(1);
        // A 64-bit division is inlined where a 128-bit one is a library call; same quotient.
        if let Some(units) = cost.checked_mul(self.per_ns) {
            return units.div_ceil(per_micro);
        }
        let ns = (u128::from(cost) * u128::from(self.per_ns)).div_ceil(u128::from(per_micro));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// Microtokens this rate produces over `ns` nanoseconds, rounded down (what accrued is
    /// never overstated); saturates at `u64::MAX`. A zero `per_ns` term counts as 1.
    #[inline]
    pub fn produced(self, ns: Nanos) -> Micros {
        let m = u128::from(self.micros) * u128::from(ns) / u128::from(self.per_ns.max(1));
        u64::try_from(m).unwrap_or(u64::MAX)
    }

    /// `ppm` parts per million of this rate, in microtokens per second, rounded down (a part of
    /// the refill diverted to a holder is never overstated); saturates at `u64::MAX`. Exact: the
    /// product fits in 128 bits for any terms.
    pub fn part_per_s(self, ppm: u32) -> u64 {
        let num = u128::from(self.micros) * u128::from(NANOS_PER_SEC) * u128::from(ppm);
        let den = u128::from(self.per_ns.max(1)) * u128::from(PPM_PER_WHOLE);
        u64::try_from(num / den).unwrap_or(u64::MAX)
    }

    /// What part of this rate `micros_per_s` microtokens per second is, in parts per million,
    /// rounded down; saturates at `u32::MAX` (a rate above this one is more than 10⁶ ppm).
    pub fn ppm_of_per_s(self, micros_per_s: u64) -> u32 {
        // d × per_ns × 10⁶ / (micros × 10⁹) in u128; a product beyond u128 saturates.
        let num = u128::from(micros_per_s) * u128::from(self.per_ns);
        let den = u128::from(self.micros.max(1)) * u128::from(NANOS_PER_SEC);
        let ppm = num
            .checked_mul(u128::from(PPM_PER_WHOLE))
            .map_or(u128::MAX, |n| n / den.max(1));
        u32::try_from(ppm).unwrap_or(u32::MAX)
    }

    /// This rate × `ppm` / 10⁶, exactly (a regional share or an emergency fraction).
    /// `None` at 0 ppm, or when the exact ratio does not fit in 64-bit terms.
    pub fn scaled(self, ppm: u32) -> Option<Rate> {
        Rate::reduced(
            u128::from(self.micros) * u128::from(ppm),
            u128::from(self.per_ns) * u128::from(PPM_PER_WHOLE),
        )
    }
}

/// A windowed limit: at most `limit` microtokens per `period_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct WindowParams {
    /// L in microtokens; > 0.
    pub limit: Micros,
    /// Window length in nanoseconds; > 0.
    pub period_ns: Nanos,
}

/// Which algorithm a limit uses (the `algorithm` field of a rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum AlgorithmKind {
    /// Token bucket with lazy refill (design §10 "Algorithms").
    TokenBucket,
    /// Generic cell rate algorithm (design §10 "Algorithms"): same envelope as the token bucket.
    Gcra,
    /// Fixed window aligned to the clock origin (design §10 "Algorithms").
    FixedWindow,
    /// Two-bucket sliding-window counter (design §10 "Algorithms").
    SlidingWindow,
    /// Exact sliding log (design §10 "Algorithms").
    SlidingLog,
}

impl AlgorithmKind {
    /// Every kind, in the order the config documentation lists them.
    pub const ALL: [AlgorithmKind; 5] = [
        AlgorithmKind::TokenBucket,
        AlgorithmKind::Gcra,
        AlgorithmKind::FixedWindow,
        AlgorithmKind::SlidingWindow,
        AlgorithmKind::SlidingLog,
    ];

    /// The config spelling (`token_bucket`, `gcra`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            AlgorithmKind::TokenBucket => "token_bucket",
            AlgorithmKind::Gcra => "gcra",
            AlgorithmKind::FixedWindow => "fixed_window",
            AlgorithmKind::SlidingWindow => "sliding_window",
            AlgorithmKind::SlidingLog => "sliding_log",
        }
    }

    /// Parses the config spelling; `None` for anything else.
    pub fn parse(s: &str) -> Option<AlgorithmKind> {
        AlgorithmKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Whether `burst` applies (buckets) or the limit is a count per window.
    pub fn is_bucket(self) -> bool {
        matches!(self, AlgorithmKind::TokenBucket | AlgorithmKind::Gcra)
    }
}

impl fmt::Display for AlgorithmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The parameters of one limit, fully validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum LimitParams {
    /// Capacity B (microtokens) refilled at `rate`.
    TokenBucket {
        /// B in microtokens.
        capacity: Micros,
        /// r.
        rate: Rate,
    },
    /// GCRA with the same (B, r) envelope as a token bucket.
    Gcra {
        /// B in microtokens (burst tolerance τ = (B − 1)·I for cost 1).
        capacity: Micros,
        /// r = 1 / emission interval.
        rate: Rate,
    },
    /// Fixed window.
    FixedWindow(WindowParams),
    /// Two-bucket sliding-window counter.
    SlidingWindow(WindowParams),
    /// Exact sliding log.
    SlidingLog(WindowParams),
}

/// Why a set of numbers cannot make a limit; the config layer adds the file and field path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    /// `requests_per_unit` is 0 or above [`MAX_TOKENS`].
    #[error("requests_per_unit must be between 1 and {max}, got {got}")]
    Rate {
        /// The value given.
        got: u64,
        /// The largest accepted.
        max: u64,
    },
    /// `burst` is 0 or above [`MAX_TOKENS`].
    #[error("burst must be between 1 and {max}, got {got}")]
    Burst {
        /// The value given.
        got: u64,
        /// The largest accepted.
        max: u64,
    },
    /// The period (unit × unit_multiplier) is 0 or above [`MAX_PERIOD_NS`].
    #[error("period must be between 1 ns and {max} ns, got {got} ns")]
    Period {
        /// The period in nanoseconds (saturated).
        got: u64,
        /// The largest accepted.
        max: u64,
    },
}

impl LimitParams {
    /// Builds validated parameters: `requests_per_unit` tokens per `period_ns`, with `burst`
    /// tokens of capacity for buckets (defaults to `requests_per_unit`; ignored for windows).
    ///
    /// # Errors
    /// [`ParamsError`] when a number is zero or beyond the supported range.
    pub fn new(
        kind: AlgorithmKind,
        requests_per_unit: u64,
        period_ns: Nanos,
        burst: Option<u64>,
    ) -> Result<LimitParams, ParamsError> {
        if requests_per_unit == 0 || requests_per_unit > MAX_TOKENS {
            return Err(ParamsError::Rate {
                got: requests_per_unit,
                max: MAX_TOKENS,
            });
        }
        if period_ns == 0 || period_ns > MAX_PERIOD_NS {
            return Err(ParamsError::Period {
                got: period_ns,
                max: MAX_PERIOD_NS,
            });
        }
        // Both terms are > 0 here, so the reduction exists.
        let rate = Rate::new(tokens_to_micros(requests_per_unit), period_ns).unwrap_or(Rate {
            micros: tokens_to_micros(requests_per_unit),
            per_ns: period_ns,
        });
        let burst = burst.unwrap_or(requests_per_unit);
        if kind.is_bucket() && (burst == 0 || burst > MAX_TOKENS) {
            return Err(ParamsError::Burst {
                got: burst,
                max: MAX_TOKENS,
            });
        }
        let window = WindowParams {
            limit: tokens_to_micros(requests_per_unit),
            period_ns,
        };
        Ok(match kind {
            AlgorithmKind::TokenBucket => LimitParams::TokenBucket {
                capacity: tokens_to_micros(burst),
                rate,
            },
            AlgorithmKind::Gcra => LimitParams::Gcra {
                capacity: tokens_to_micros(burst),
                rate,
            },
            AlgorithmKind::FixedWindow => LimitParams::FixedWindow(window),
            AlgorithmKind::SlidingWindow => LimitParams::SlidingWindow(window),
            AlgorithmKind::SlidingLog => LimitParams::SlidingLog(window),
        })
    }

    /// The algorithm these parameters are for.
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            LimitParams::TokenBucket { .. } => AlgorithmKind::TokenBucket,
            LimitParams::Gcra { .. } => AlgorithmKind::Gcra,
            LimitParams::FixedWindow(_) => AlgorithmKind::FixedWindow,
            LimitParams::SlidingWindow(_) => AlgorithmKind::SlidingWindow,
            LimitParams::SlidingLog(_) => AlgorithmKind::SlidingLog,
        }
    }

    /// Largest cost that can ever pass, in microtokens.
    pub fn capacity(&self) -> Micros {
        match self {
            LimitParams::TokenBucket { capacity, .. } | LimitParams::Gcra { capacity, .. } => {
                *capacity
            }
            LimitParams::FixedWindow(w)
            | LimitParams::SlidingWindow(w)
            | LimitParams::SlidingLog(w) => w.limit,
        }
    }

    /// The long-run refill rate: a bucket's `rate`; for a window, `limit` microtokens per
    /// `period_ns` (kept as given, not reduced: this is on the agent's decide path and every
    /// use of it is exact for any terms of the same ratio).
    #[inline]
    pub fn refill_rate(&self) -> Rate {
        match *self {
            LimitParams::TokenBucket { rate, .. } | LimitParams::Gcra { rate, .. } => rate,
            LimitParams::FixedWindow(w)
            | LimitParams::SlidingWindow(w)
            | LimitParams::SlidingLog(w) => Rate {
                micros: w.limit,
                per_ns: w.period_ns,
            },
        }
    }

    /// Nanoseconds for the [`refill_rate`](Self::refill_rate) to produce `cost` microtokens:
    /// [`Rate::time_for`] of it (rounded up, saturating).
    #[inline]
    pub fn time_for(&self, cost: Micros) -> Nanos {
        self.refill_rate().time_for(cost)
    }

    /// These parameters scaled by a share of `ppm` parts per million (a region's share of a
    /// policy, design §5): capacity or limit × ppm / 10⁶ (rounded down, saturating; exact for
    /// whole-token limits), the rate scaled as an exact ratio, window periods unchanged.
    /// `None` at 0 ppm, or when the scaled rate does not fit in 64-bit terms.
    pub fn scaled(&self, ppm: u32) -> Option<LimitParams> {
        if ppm == 0 {
            return None;
        }
        let window = |w: WindowParams| WindowParams {
            limit: ppm_of(w.limit, ppm),
            period_ns: w.period_ns,
        };
        Some(match *self {
            LimitParams::TokenBucket { capacity, rate } => LimitParams::TokenBucket {
                capacity: ppm_of(capacity, ppm),
                rate: rate.scaled(ppm)?,
            },
            LimitParams::Gcra { capacity, rate } => LimitParams::Gcra {
                capacity: ppm_of(capacity, ppm),
                rate: rate.scaled(ppm)?,
            },
            LimitParams::FixedWindow(w) => LimitParams::FixedWindow(window(w)),
            LimitParams::SlidingWindow(w) => LimitParams::SlidingWindow(window(w)),
            LimitParams::SlidingLog(w) => LimitParams::SlidingLog(window(w)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_kept_in_lowest_terms_and_scale_exactly() {
        let r = Rate::new(10_000_000, 1_000_000_000).unwrap();
        assert_eq!(
            r,
            Rate {
                micros: 1,
                per_ns: 100
            }
        );
        // 3 per second stays 3/10⁹ µ… exactly: 3 000 000 µtok per 10⁹ ns = 3 per 1000 ns.
        assert_eq!(
            Rate::new(3_000_000, 1_000_000_000).unwrap(),
            Rate {
                micros: 3,
                per_ns: 1_000
            }
        );
        // 50% of 10/s is 5/s; 35% of 1000/s is 350/s; 0 ppm is no rate.
        assert_eq!(
            r.scaled(500_000).unwrap(),
            Rate::new(5_000_000, 1_000_000_000).unwrap()
        );
        let k = Rate::new(1_000_000_000, 1_000_000_000).unwrap();
        assert_eq!(
            k.scaled(350_000).unwrap(),
            Rate::new(350_000_000, 1_000_000_000).unwrap()
        );
        assert_eq!(r.scaled(0), None);
        assert_eq!(Rate::new(0, 5), None);
        // A ratio whose exact terms do not fit in 64 bits is refused, not rounded.
        let odd = Rate::new(999_999_999_999_999_989, 999_999_999_999_999_967).unwrap();
        assert_eq!(odd.scaled(333_333), None);
    }

    #[test]
    fn params_reduce_their_rate() {
        let p = LimitParams::new(AlgorithmKind::TokenBucket, 10, 1_000_000_000, Some(40)).unwrap();
        assert_eq!(
            p,
            LimitParams::TokenBucket {
                capacity: 40_000_000,
                rate: Rate {
                    micros: 1,
                    per_ns: 100
                }
            }
        );
    }

    fn bucket(micros: u64, per_ns: u64) -> LimitParams {
        LimitParams::TokenBucket {
            capacity: u64::MAX,
            rate: Rate { micros, per_ns },
        }
    }

    #[test]
    fn time_for_is_exact_across_the_64_bit_boundary() {
        // One token a second: a token takes exactly 1 s; at 3 microtokens per 10 ns one
        // microtoken takes 3.33 ns, rounded up to 4.
        assert_eq!(
            bucket(1_000_000, 1_000_000_000).time_for(1_000_000),
            1_000_000_000
        );
        assert_eq!(bucket(3, 10).time_for(1), 4);
        // cost × per_ns beyond u64: the 128-bit path gives the same exact quotient.
        assert_eq!(bucket(u64::MAX, 2).time_for(u64::MAX), 2);
        assert_eq!(bucket(u64::MAX / 2, 1).time_for(u64::MAX), 3);
        // A quotient beyond u64 saturates; nothing costs nothing.
        assert_eq!(bucket(1, u64::MAX).time_for(u64::MAX), u64::MAX);
        assert_eq!(bucket(1, u64::MAX).time_for(0), 0);
        // A zero rate is treated as one microtoken per period, never a division by zero.
        assert_eq!(bucket(0, 7).time_for(5), 35);
    }

    #[test]
    fn a_window_refills_its_limit_per_period() {
        let w = LimitParams::new(AlgorithmKind::FixedWindow, 4, 1_000_000_000, None).unwrap();
        assert_eq!(
            w.refill_rate(),
            Rate {
                micros: 4_000_000,
                per_ns: 1_000_000_000
            }
        );
        // A quarter of the window's limit takes a quarter of its period.
        assert_eq!(w.time_for(1_000_000), 250_000_000);
        let b = bucket(7, 9);
        assert_eq!(
            b.refill_rate(),
            Rate {
                micros: 7,
                per_ns: 9
            }
        );
    }

    #[test]
    fn scaling_by_a_share_is_exact_and_keeps_the_shape() {
        let tb = LimitParams::new(AlgorithmKind::TokenBucket, 10, 1_000_000_000, Some(40)).unwrap();
        assert_eq!(
            tb.scaled(250_000),
            LimitParams::new(AlgorithmKind::TokenBucket, 10, 4_000_000_000, Some(10)).ok()
        );
        let sw = LimitParams::new(AlgorithmKind::SlidingWindow, 8, 60_000_000_000, None).unwrap();
        assert_eq!(
            sw.scaled(500_000),
            LimitParams::new(AlgorithmKind::SlidingWindow, 4, 60_000_000_000, None).ok()
        );
        assert_eq!(tb.scaled(1_000_000), Some(tb));
        assert_eq!(tb.scaled(0), None);
        // Extremes: a capacity of u64::MAX above the whole saturates; a rate whose exact
        // scaled terms leave 64 bits is refused, not rounded.
        let huge = bucket(1, 1);
        let LimitParams::TokenBucket { capacity, rate } = huge.scaled(u32::MAX).unwrap() else {
            panic!("a bucket stays a bucket");
        };
        assert_eq!(capacity, u64::MAX);
        assert_eq!(rate, Rate::new(u64::from(u32::MAX), 1_000_000).unwrap());
        assert_eq!(
            bucket(999_999_999_999_999_989, 999_999_999_999_999_967).scaled(333_333),
            None
        );
    }

    #[test]
    fn per_second_rates_produce_wait_and_divide_exactly_at_the_extremes() {
        // 3 µtok/s: 1 µtok takes ⌈10⁹ / 3⌉ ns; 1 s produces 3, 999 ms produces 2 (rounded down).
        let r = Rate::per_second(3);
        assert_eq!(r.time_for(1), 333_333_334);
        assert_eq!(r.produced(NANOS_PER_SEC), 3);
        assert_eq!(r.produced(999_000_000), 2);
        // A rate of 0 waits as if it were 1 µtok per period and produces nothing.
        assert_eq!(Rate::per_second(0).time_for(2), 2 * NANOS_PER_SEC);
        assert_eq!(Rate::per_second(0).produced(u64::MAX), 0);
        // Saturation, never a wrap.
        assert_eq!(Rate::per_second(u64::MAX).produced(u64::MAX), u64::MAX);
        assert_eq!(Rate::per_second(1).time_for(u64::MAX), u64::MAX);
        // A part of a refill rate in µtok/s and back: 10 tokens/s, half of it.
        let ten = Rate::new(10_000_000, NANOS_PER_SEC).unwrap();
        assert_eq!(ten.part_per_s(500_000), 5_000_000);
        assert_eq!(ten.ppm_of_per_s(5_000_000), 500_000);
        assert_eq!(ten.ppm_of_per_s(0), 0);
        assert_eq!(ten.ppm_of_per_s(u64::MAX), u32::MAX);
        let extreme = Rate::new(u64::MAX, 1).unwrap();
        assert_eq!(extreme.part_per_s(u32::MAX), u64::MAX);
        // Rounded down both ways: a part and its ppm never come back larger.
        for (micros, per_ns) in [(1, 3), (7, 1_000), (3_000_000, 1_000), (u64::MAX, 7)] {
            let rate = Rate::new(micros, per_ns).unwrap();
            for ppm in [1, 333_333, 1_000_000, u32::MAX] {
                let per_s = rate.part_per_s(ppm);
                if per_s < u64::MAX {
                    assert!(rate.ppm_of_per_s(per_s) <= ppm, "{rate:?} {ppm}");
                }
            }
        }
    }
}
