//! Raw clock ticks → nanoseconds as one multiply by a fixed-point ratio with a constant shift
//! (the TSC's ticks are not nanoseconds; an OS clock's already are).

use crate::units::Nanos;

/// Fraction bits of [`TickScale`]'s ratio for a counter of up to 1 GHz: `ns = ticks × mult /
/// 2^SHIFT`.
///
/// A constant, so a conversion is one 64×64-bit multiply and a shift by an immediate: no
/// shift by a loaded count on the decision path.
const SHIFT: u32 = 32;

/// Fraction bits for a counter faster than 1 GHz (less than one nanosecond per tick, as a TSC):
/// the nanoseconds are then the high word of the product as it is, with no shift at all, and
/// always fit in 64 bits.
const WIDE_SHIFT: u32 = 64;

/// Ticks measured to derive a ratio from a clock's own conversion ([`TickScale::from_probe`]):
/// 2^48 ticks is at least 2^SHIFT, so the ratio keeps every bit the clock's conversion has
/// (quanta's fraction has at most ~30 bits: it calibrates over at most 200 ms), and at up to
/// 65,536 ns per tick the nanoseconds fit in 64 bits.
pub(crate) const PROBE_TICKS_LOG2: u32 = 48;

/// Nanoseconds per raw tick as the fixed-point ratio `mult / 2^64` (`wide`, a counter faster
/// than 1 GHz) or `mult / 2^32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TickScale {
    /// Nanoseconds per tick × 2^64 when `wide`, else × 2^32.
    mult: u64,
    wide: bool,
}

impl TickScale {
    /// One nanosecond per tick (a clock that already counts nanoseconds).
    #[cfg(test)]
    pub(crate) const IDENTITY: TickScale = TickScale {
        mult: 1 << SHIFT,
        wide: false,
    };

    /// The ratio of a clock that converts 2^[`PROBE_TICKS_LOG2`] ticks to `probe_ns`
    /// nanoseconds. For a clock that converts as `ticks × f / 2^s` (rounded down) with
    /// `s ≤ 32`, [`nanos`](Self::nanos) then gives exactly its answers: the probe is then
    /// exactly `f × 2^(48 − s)`, so `mult` is exactly `f × 2^(64 − s)` (below 2^64 when
    /// `f < 2^s`, under a nanosecond per tick) or `f × 2^(32 − s)`.
    pub(crate) fn from_probe(probe_ns: Nanos) -> TickScale {
        if probe_ns < 1 << PROBE_TICKS_LOG2 {
            TickScale {
                mult: probe_ns << (WIDE_SHIFT - PROBE_TICKS_LOG2),
                wide: true,
            }
        } else {
            TickScale {
                mult: probe_ns >> (PROBE_TICKS_LOG2 - SHIFT),
                wide: false,
            }
        }
    }

    /// `ticks` in nanoseconds, rounded down; saturates at `u64::MAX` (never wraps to a
    /// smaller time, however many ticks).
    #[inline]
    pub(crate) fn nanos(self, ticks: u64) -> Nanos {
        let product = u128::from(ticks) * u128::from(self.mult);
        if self.wide {
            // mult < 2^64, so the high word is below `ticks`: it fits.
            (product >> WIDE_SHIFT) as u64
        } else {
            u64::try_from(product >> SHIFT).unwrap_or(u64::MAX)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// quanta's conversion: `(ticks × f) >> s`, truncated to 64 bits as it does.
    fn quanta_like(ticks: u64, f: u64, s: u32) -> u64 {
        ((u128::from(ticks) * u128::from(f)) >> s) as u64
    }

    /// (f, s) of counters from 24 MHz (aarch64's) to 2.5 GHz, calibrated over up to 2^32 ticks.
    const RATIOS: [(u64, u32); 5] = [
        (1 << 29, 29),       // 1 GHz: one ns per tick
        (13_700_000, 25),    // ~2.45 GHz TSC
        (107_374_182, 28),   // ~2.5 GHz, fraction of 28 bits
        (3_435_973_836, 32), // 1.25 GHz with a 32-bit fraction
        (43_690_667, 20),    // 24 MHz: ~41.7 ns per tick
    ];

    #[test]
    fn identity_is_exact_to_the_last_tick() {
        for t in [0, 1, 999, 1 << 32, u64::MAX - 1, u64::MAX] {
            assert_eq!(TickScale::IDENTITY.nanos(t), t);
        }
        let probe = 1u64 << PROBE_TICKS_LOG2;
        assert_eq!(TickScale::from_probe(probe), TickScale::IDENTITY);
    }

    #[test]
    fn a_probed_ratio_answers_as_the_clock_it_was_probed_from() {
        let ticks = [
            0,
            1,
            2,
            3,
            1_000,
            123_456_789,
            1 << 40,
            1 << 47,
            999_999_999_999,
        ];
        for (f, s) in RATIOS {
            let scale = TickScale::from_probe(quanta_like(1 << PROBE_TICKS_LOG2, f, s));
            for t in ticks {
                assert_eq!(
                    scale.nanos(t),
                    quanta_like(t, f, s),
                    "f {f} s {s} ticks {t}"
                );
            }
        }
    }

    #[test]
    fn the_largest_tick_counts_saturate_instead_of_wrapping() {
        // A slow counter: u64::MAX ticks are far beyond u64::MAX ns.
        let slow = TickScale::from_probe(quanta_like(1 << PROBE_TICKS_LOG2, 43_690_667, 20));
        assert_eq!(slow.nanos(u64::MAX), u64::MAX);
        assert_eq!(slow.nanos(u64::MAX / 2), u64::MAX);
        assert!(slow.nanos(u64::MAX / 64) < u64::MAX);
        // A fast one: u64::MAX ticks fit, rounded down.
        let fast = TickScale::from_probe(quanta_like(1 << PROBE_TICKS_LOG2, 13_700_000, 25));
        assert!(fast.wide);
        let want = (u128::from(u64::MAX) * u128::from(fast.mult)) >> WIDE_SHIFT;
        assert_eq!(u128::from(fast.nanos(u64::MAX)), want);
        assert_eq!(fast.nanos(u64::MAX), quanta_like(u64::MAX, 13_700_000, 25));
        assert!(fast.nanos(u64::MAX) < u64::MAX);
    }

    #[test]
    fn a_counter_faster_than_1_ghz_takes_the_wide_ratio_and_one_ns_per_tick_does_not() {
        let ghz = |f, s| TickScale::from_probe(quanta_like(1 << PROBE_TICKS_LOG2, f, s)).wide;
        assert!(ghz(13_700_000, 25)); // ~2.45 GHz
        assert!(ghz(107_374_182, 28)); // ~2.5 GHz
        assert!(ghz(3_435_973_836, 32)); // 1.25 GHz
        assert!(!ghz(1 << 29, 29)); // exactly 1 ns per tick
        assert!(!ghz(43_690_667, 20)); // 24 MHz

        // Just under 1 ns per tick: the largest wide ratio, exact to the last tick.
        let s = TickScale::from_probe((1 << PROBE_TICKS_LOG2) - 1);
        assert!(s.wide);
        assert_eq!(s.mult, u64::MAX - 0xffff);
        for t in [0, 1, 1 << 32, u64::MAX - 1, u64::MAX] {
            let want = (u128::from(t) * u128::from(s.mult)) >> 64;
            assert_eq!(u128::from(s.nanos(t)), want);
            assert!(s.nanos(t) <= t);
        }
    }

    #[test]
    fn more_ticks_are_never_fewer_nanoseconds() {
        for (f, s) in RATIOS {
            let scale = TickScale::from_probe(quanta_like(1 << PROBE_TICKS_LOG2, f, s));
            let mut ticks: Vec<u64> = (0..64)
                .flat_map(|b| [(1u64 << b) - 1, 1 << b, (1u64 << b) + 1])
                .chain([u64::MAX - 1, u64::MAX])
                .collect();
            ticks.sort_unstable();
            let mut prev = 0;
            for t in ticks {
                let ns = scale.nanos(t);
                assert!(ns >= prev, "f {f} s {s}: {t} ticks gave {ns} < {prev}");
                prev = ns;
            }
        }
    }

    /// A clock's ratio `(f, s)`: `s` ≤ 32 (quanta's calibration spans well under 2^32 ticks)
    /// and `f` below 2^16 ns per tick (`f < 2^(s+16)`: the probe of 2^48 ticks then fits
    /// in 64 bits); 1 ns per tick and the edges around it included.
    fn ratio() -> impl Strategy<Value = (u64, u32)> {
        (0u32..=32, any::<u64>(), 0u8..6).prop_map(|(s, x, mode)| {
            let one = 1u64 << s;
            let f = match mode {
                0 => x % one.max(1),                     // faster than 1 GHz
                1 => one,                                // exactly 1 ns per tick
                2 => one - 1,                            // just under
                3 => one + 1,                            // just over
                4 => x % (one << 16),                    // anything up to 65,536 ns per tick
                _ => one + x % (one.saturating_mul(64)), // up to 64 ns per tick
            };
            (f, s)
        })
    }

    fn ticks() -> impl Strategy<Value = u64> {
        prop_oneof![
            any::<u64>(),
            0u64..1_000_000,
            0u64..(1 << 48),
            (u64::MAX - 1_000)..=u64::MAX,
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

        /// The probed ratio gives quanta's `(ticks × f) >> s` exactly wherever that fits in 64
        /// bits, and u64::MAX (not quanta's wrapped value) where it does not.
        #[test]
        fn a_probed_ratio_is_quantas_truncation((f, s) in ratio(), t in ticks()) {
            let scale = TickScale::from_probe(quanta_like(1 << PROBE_TICKS_LOG2, f, s));
            let exact = (u128::from(t) * u128::from(f)) >> s;
            let want = u64::try_from(exact).unwrap_or(u64::MAX);
            prop_assert_eq!(scale.nanos(t), want, "f {} s {} ticks {}", f, s, t);
            if exact <= u128::from(u64::MAX) {
                prop_assert_eq!(scale.nanos(t), quanta_like(t, f, s));
            }
        }

        /// More ticks are never fewer nanoseconds, for any ratio at all (from any probe).
        #[test]
        fn nanos_are_monotone_in_ticks(
            probe in prop_oneof![any::<u64>(), (0u64..(1 << 49)), ratio().prop_map(|(f, s)| quanta_like(1 << PROBE_TICKS_LOG2, f, s))],
            a in ticks(),
            b in ticks(),
        ) {
            let scale = TickScale::from_probe(probe);
            let (lo, hi) = (a.min(b), a.max(b));
            prop_assert!(scale.nanos(lo) <= scale.nanos(hi), "probe {} ticks {} {}", probe, lo, hi);
            prop_assert!(scale.nanos(hi.saturating_add(1)) >= scale.nanos(hi));
        }
    }
}
