//! Exact units used on the decision path (design §10 "Units and time": fixed-point tokens, integer
//! time).
//!
//! * Tokens are counted in **microtokens** (`u64`): one whole token (one request of cost 1)
//!   is [`MICROS_PER_TOKEN`] microtokens.
//! * Time is counted in **nanoseconds** (`u64`) from the origin of the
//!   [`Clock`](crate::clock::Clock) in use; windows are aligned to that origin.
//!
//! Every conversion here saturates instead of wrapping: a saturated value is always on the
//! conservative side of the decision that uses it.

/// Nanoseconds from a clock origin.
pub type Nanos = u64;

/// Microtokens: 1 token = 1_000_000 microtokens.
pub type Micros = u64;

/// Microtokens in one whole token.
pub const MICROS_PER_TOKEN: u64 = 1_000_000;

/// Nanoseconds in one millisecond.
pub const NANOS_PER_MILLI: u64 = 1_000_000;

/// Nanoseconds in one second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Largest token count a limit may be configured with (capacity, burst or limit): 10^12 tokens.
///
/// Chosen so that every product the algorithms form (`capacity_micros × period_ns`,
/// `time_ns × rate_micros`) stays below `u128::MAX` with a wide margin.
pub const MAX_TOKENS: u64 = 1_000_000_000_000;

/// Longest period a limit may be configured with: 400 days in nanoseconds.
pub const MAX_PERIOD_NS: u64 = 400 * 86_400 * NANOS_PER_SEC;

/// Whole tokens → microtokens, saturating at `u64::MAX` (a saturated cost exceeds every capacity).
#[inline]
pub fn tokens_to_micros(tokens: u64) -> Micros {
    tokens.saturating_mul(MICROS_PER_TOKEN)
}

/// Microtokens → whole tokens, rounded down (what `limit_remaining` reports).
#[inline]
pub fn micros_to_tokens_floor(micros: Micros) -> u64 {
    micros / MICROS_PER_TOKEN
}

/// Nanoseconds → milliseconds, rounded up (a wait is never reported shorter than it is).
#[inline]
pub fn nanos_to_millis_ceil(ns: Nanos) -> u64 {
    ns.div_ceil(NANOS_PER_MILLI)
}

/// Nanoseconds → whole milliseconds, rounded down (an instant as Unix ms: a deadline in ms is
/// never later than the nanosecond one).
#[inline]
pub fn nanos_to_millis_floor(ns: Nanos) -> u64 {
    ns / NANOS_PER_MILLI
}

/// Nanoseconds → whole seconds for an HTTP `Retry-After` (RFC 9110 §10.2.3): rounded up, and
/// at least 1.
#[inline]
pub fn nanos_to_retry_after_secs(ns: Nanos) -> u64 {
    ns.div_ceil(NANOS_PER_SEC).max(1)
}

/// Milliseconds → nanoseconds, saturating.
#[inline]
pub fn millis_to_nanos(ms: u64) -> Nanos {
    ms.saturating_mul(NANOS_PER_MILLI)
}

/// Parts per million in one whole: a share or fraction of `ppm` is `ppm / PPM_PER_WHOLE`.
pub const PPM_PER_WHOLE: u64 = 1_000_000;

/// `value × ppm / 10⁶`, rounded down, saturating at `u64::MAX` (a share of a capacity or a
/// limit, issue 11 item 6: the one home of this conversion). Exact for whole-token values
/// (multiples of [`MICROS_PER_TOKEN`]), which every configured capacity and limit is.
#[inline]
pub fn ppm_of(value: u64, ppm: u32) -> u64 {
    let scaled = u128::from(value) * u128::from(ppm) / u128::from(PPM_PER_WHOLE);
    u64::try_from(scaled).unwrap_or(u64::MAX)
}

/// `part / whole` in parts per million, rounded down, saturating at `u64::MAX` (a share given
/// as a rate of the whole, for instance); a `whole` of 0 counts as 1.
#[inline]
pub fn ppm_in(part: u64, whole: u64) -> u64 {
    let ppm = u128::from(part) * u128::from(PPM_PER_WHOLE) / u128::from(whole.max(1));
    u64::try_from(ppm).unwrap_or(u64::MAX)
}

/// `part / whole` in parts per million, rounded up (the least share whose part of `whole`
/// holds `part`), saturating at `u64::MAX`; a `whole` of 0 counts as 1.
#[inline]
pub fn ppm_in_ceil(part: u64, whole: u64) -> u64 {
    let ppm = (u128::from(part) * u128::from(PPM_PER_WHOLE)).div_ceil(u128::from(whole.max(1)));
    u64::try_from(ppm).unwrap_or(u64::MAX)
}

/// The rate, in units per second, of `amount` units over `ns` nanoseconds, rounded down;
/// saturating at `u64::MAX`; an `ns` of 0 counts as 1.
#[inline]
pub fn per_second(amount: u64, ns: Nanos) -> u64 {
    let r = u128::from(amount) * u128::from(NANOS_PER_SEC) / u128::from(ns.max(1));
    u64::try_from(r).unwrap_or(u64::MAX)
}

/// `ceil(a / b)` on `u128`, for `b > 0`.
#[inline]
pub(crate) fn div_ceil_u128(a: u128, b: u128) -> u128 {
    debug_assert!(b > 0);
    // Same quotient either way; a 64-bit division is inlined where a 128-bit one is a call.
    if (a | b) >> 64 == 0 {
        (a as u64).div_ceil(b as u64) as u128
    } else {
        a.div_ceil(b)
    }
}

/// `a / b` (rounded down), exact; `b` must be > 0. Uses a 64-bit division when both fit.
#[inline]
pub(crate) fn div_u128(a: u128, b: u128) -> u128 {
    debug_assert!(b > 0);
    if (a | b) >> 64 == 0 {
        (a as u64 / b as u64) as u128
    } else {
        a / b
    }
}

/// Marks the branch that calls it as rarely taken, so the compiler keeps a branch there (the
/// common side's data then does not wait for the test, as it would in a conditional move).
/// (`std::hint::cold_path` needs Rust 1.95.)
#[cold]
#[inline(never)]
pub(crate) fn cold() {}

/// Narrows a `u128` to `u64`, saturating.
#[inline]
pub(crate) fn sat_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_floor_rounds_down_at_the_extremes() {
        assert_eq!(nanos_to_millis_floor(0), 0);
        assert_eq!(nanos_to_millis_floor(999_999), 0);
        assert_eq!(nanos_to_millis_floor(1_999_999), 1);
        assert_eq!(nanos_to_millis_floor(u64::MAX), u64::MAX / NANOS_PER_MILLI);
    }

    #[test]
    fn ppm_of_is_exact_and_saturates_at_the_extremes() {
        // Half of 3 tokens is 1.5 tokens; 0 ppm of anything is 0; 10⁶ ppm is the whole.
        assert_eq!(ppm_of(3 * MICROS_PER_TOKEN, 500_000), 1_500_000);
        assert_eq!(ppm_of(u64::MAX, 0), 0);
        assert_eq!(ppm_of(0, u32::MAX), 0);
        assert_eq!(ppm_of(u64::MAX, 1_000_000), u64::MAX);
        // Floor: 1 microtoken × 999_999 ppm is 0.999999, which rounds down.
        assert_eq!(ppm_of(1, 999_999), 0);
        // Above the whole, the product leaves u64: saturate, never wrap.
        assert_eq!(ppm_of(u64::MAX, 2_000_000), u64::MAX);
        assert_eq!(ppm_of(u64::MAX, u32::MAX), u64::MAX);
    }

    #[test]
    fn conversions_saturate_instead_of_overflowing() {
        assert_eq!(tokens_to_micros(u64::MAX), u64::MAX);
        assert_eq!(tokens_to_micros(u32::MAX as u64), 4_294_967_295_000_000);
        assert_eq!(millis_to_nanos(u64::MAX), u64::MAX);
        assert_eq!(sat_u64(u128::MAX), u64::MAX);
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one_second() {
        assert_eq!(nanos_to_retry_after_secs(0), 1);
        assert_eq!(nanos_to_retry_after_secs(1), 1);
        assert_eq!(nanos_to_retry_after_secs(NANOS_PER_SEC), 1);
        assert_eq!(nanos_to_retry_after_secs(NANOS_PER_SEC + 1), 2);
        assert_eq!(nanos_to_retry_after_secs(4_500_000_000), 5);
        assert_eq!(
            nanos_to_retry_after_secs(u64::MAX),
            u64::MAX.div_ceil(NANOS_PER_SEC)
        );
    }

    #[test]
    fn millis_round_up() {
        assert_eq!(nanos_to_millis_ceil(0), 0);
        assert_eq!(nanos_to_millis_ceil(1), 1);
        assert_eq!(nanos_to_millis_ceil(NANOS_PER_MILLI), 1);
        assert_eq!(
            nanos_to_millis_ceil(u64::MAX),
            u64::MAX.div_ceil(NANOS_PER_MILLI)
        );
    }

    #[test]
    fn narrow_division_fast_path_is_exact() {
        let m = u64::MAX as u128;
        let vals = [
            0,
            1,
            2,
            3,
            7,
            999_999,
            1_000_000,
            m - 1,
            m,
            m + 1,
            m * 3 + 2,
            u128::MAX,
        ];
        for a in vals {
            for b in vals.into_iter().filter(|&b| b > 0) {
                assert_eq!(div_u128(a, b), a / b, "{a} / {b}");
                assert_eq!(div_ceil_u128(a, b), a.div_ceil(b), "{a} /^ {b}");
            }
        }
    }

    #[test]
    fn extreme_products_fit_in_u128() {
        // capacity × period and time × rate, the two largest products the algorithms form.
        let cap = tokens_to_micros(MAX_TOKENS) as u128;
        assert!(cap.checked_mul(MAX_PERIOD_NS as u128).is_some());
        assert!((u64::MAX as u128).checked_mul(cap).is_some());
        assert!((u64::MAX as u128)
            .checked_mul(cap)
            .and_then(|v| v.checked_add(cap * MAX_PERIOD_NS as u128))
            .is_some());
    }

    #[test]
    fn shares_and_per_second_rates_round_as_stated_and_saturate() {
        assert_eq!(ppm_in(1, 3), 333_333);
        assert_eq!(ppm_in_ceil(1, 3), 333_334);
        assert_eq!(ppm_in(3, 3), PPM_PER_WHOLE);
        assert_eq!(ppm_in(5, 0), 5 * PPM_PER_WHOLE);
        assert_eq!(ppm_in(u64::MAX, 1), u64::MAX);
        assert_eq!(ppm_in_ceil(u64::MAX, 1), u64::MAX);
        assert_eq!(ppm_in_ceil(MICROS_PER_TOKEN, 3 * MICROS_PER_TOKEN), 333_334);
        assert_eq!(per_second(5, 2 * NANOS_PER_SEC), 2);
        assert_eq!(per_second(1, 0), NANOS_PER_SEC);
        assert_eq!(per_second(u64::MAX, 1), u64::MAX);
        assert_eq!(per_second(u64::MAX, u64::MAX), 1_000_000_000);
    }
}
