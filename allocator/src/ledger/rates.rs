//! Rate-carrying allocations (design §9, issue 9 item 4): an allocation may carry, besides the
//! tokens granted at once, a refill rate its holder accrues until its lease ends. The live
//! rates' part of the policy's refill is *diverted* from the buckets to their holders: the
//! global bucket refills at r · (10⁶ − R) / 10⁶ and a region's bucket at r · (part − R_g) / 10⁶,
//! R and R_g being Σ `rate_ppm` of the key's and region's allocations that still accrue. Every
//! change of R re-tunes the buckets at that instant, so what the buckets and the holders get
//! together is exactly the policy's refill: admitted ≤ B + r · (t₂ − t₁) + bound.

use super::division::Demand;
use super::fair_share::fair_part;
use super::sources::{refund_calendar, retune};
use super::{Allocation, KeyId, KeyState, Ledger, Name};
use allot_common::algorithm::{LimitParams, Rate};
use allot_common::config::{Rule, PPM};
use allot_common::units::{millis_to_nanos, Micros};

/// The most of a policy's rate its live allocations carry together, ppm: one ppm stays with the
/// bucket, whose refill rate must stay positive (the decision core has no rate of 0).
pub const MAX_RATE_PPM: u32 = PPM - 1;

/// Whether a limit with `params` can carry rates: a bucket (token bucket or GCRA) whose rate
/// scaled by any ppm is an exact 64-bit ratio (a window has no refill to divert).
pub(super) fn carries_rates(params: &LimitParams) -> bool {
    let fits =
        |r: Rate| r.micros <= u64::MAX / u64::from(PPM) && r.per_ns <= u64::MAX / u64::from(PPM);
    match *params {
        LimitParams::TokenBucket { rate, .. } | LimitParams::Gcra { rate, .. } => fits(rate),
        _ => false,
    }
}

/// `params` with the refill rate `rate`, capacity unchanged (buckets only).
fn with_rate(params: LimitParams, rate: Rate) -> LimitParams {
    match params {
        LimitParams::TokenBucket { capacity, .. } => LimitParams::TokenBucket { capacity, rate },
        LimitParams::Gcra { capacity, .. } => LimitParams::Gcra { capacity, rate },
        other => other,
    }
}

/// The global bucket's parameters when live rates carry `rates_ppm` of the policy's rate: the
/// rate scaled to what is left (at least 1 ppm), capacity unchanged. Parameters that cannot carry
/// rates are returned as they are (live rates of an older policy stay in the bound, design §9).
pub(super) fn diverted(params: LimitParams, rates_ppm: u64) -> LimitParams {
    if rates_ppm == 0 || !carries_rates(&params) {
        return params;
    }
    let left = u64::from(PPM).saturating_sub(rates_ppm).max(1);
    let left = u32::try_from(left).unwrap_or(1);
    match params.refill_rate().scaled(left) {
        Some(r) => with_rate(params, r),
        None => params,
    }
}

/// A region's bucket with part `part_ppm` of the policy when its live rates carry `rates_ppm`:
/// the part's capacity, and the part's rate less the rates (at least 1 ppm: a part lowered by a
/// handoff below its live rates keeps a token rate while they end). `None` for a part of 0.
pub(super) fn region_params(
    params: LimitParams,
    part_ppm: u32,
    rates_ppm: u64,
) -> Option<LimitParams> {
    let scaled = params.scaled(part_ppm)?;
    if rates_ppm == 0 || !carries_rates(&params) {
        return Some(scaled);
    }
    let left = u64::from(part_ppm).saturating_sub(rates_ppm).max(1);
    let left = u32::try_from(left).unwrap_or(1);
    Some(match params.refill_rate().scaled(left) {
        Some(r) => with_rate(scaled, r),
        None => scaled,
    })
}

/// Σ of the live rates of a key over its regions, ppm of its policy's rate.
pub(super) fn key_rate_ppm(ks: &KeyState) -> u64 {
    ks.regions
        .values()
        .map(|r| r.rate_ppm_live)
        .fold(0, u64::saturating_add)
}

/// A denial's retry time `ms` while live rates take `ks`'s refill: the bucket fills slowly
/// then, but a rate frees up within a lease (superseded, released or expired), so ask again
/// after a quarter lease (`ttl_ms`) at the latest (design §9). Without live rates, `ms`.
pub(super) fn rated_retry_ms(ks: &KeyState, ttl_ms: u64, ms: u64) -> u64 {
    if key_rate_ppm(ks) > 0 {
        ms.min((ttl_ms / 4).max(1))
    } else {
        ms
    }
}

/// Part of a contended key's rate kept in its bucket, ppm of the rate the holders divide:
/// a quarter.
///
/// When the holders' wants together exceed the rate, a fixed split of the whole refill leaves
/// each holder its own trickle: one holder's burst is denied while another's accrual sits
/// unspent, where one central bucket would have admitted it (design §9, "Traced … the
/// partitioning of a near-limit key's rate": seed 1 of `allot-sim --workload zipf-1000` lost
/// 83 of 2,437 tokens). What stays in the bucket is pooled: any holder that runs short gets it
/// as a lump. A quarter is measured, not derived (`allot-sim --no-faults --workload zipf-1000
/// --rate-leases`, seeds 1–3, admitted): none pooled 2,354 / 2,358 / 2,385; an eighth 2,380 /
/// 2,368 / 2,412; a quarter 2,388 / 2,365 / 2,412; a half 2,393 / 2,363 / 2,413; three
/// quarters 2,391 / 2,365 / 2,415 (the ideal counter 2,437 / 2,411 / 2,449; design §9). Past a
/// quarter the gain is flat, and a larger pool costs more lump Acquires.
pub const POOLED_PPM: u64 = 250_000;

/// What holders with `wants` (ppm of the rate) may divide of `whole` (ppm): all of it while
/// their wants fit or there is one holder (nobody to pool with), else `whole` less the pooled
/// part ([`POOLED_PPM`] of it), which stays in the bucket.
pub(super) fn pooled_whole(whole: u64, wants: &[u64]) -> u64 {
    let total = wants.iter().fold(0u64, |s, &w| s.saturating_add(w));
    if total <= whole || wants.len() < 2 {
        return whole;
    }
    let pooled = u128::from(whole) * u128::from(POOLED_PPM) / u128::from(PPM);
    whole.saturating_sub(u64::try_from(pooled).unwrap_or(whole))
}

/// What `rate_per_s` accrues over `ms` milliseconds, microtokens, rounded down (saturating):
/// the promise of a rate-carrying allocation over its lease.
pub(super) fn promise(rate_per_s: u64, ms: u64) -> Micros {
    Rate::per_second(rate_per_s).produced(millis_to_nanos(ms))
}

impl Allocation {
    /// What the holder may have spent by `now` (Unix ms): the base plus the accrual until
    /// `now` or the accrual's end, never more than `granted`.
    pub fn entitled_at(&self, now: u64) -> Micros {
        let until = now
            .min(self.accrual_end_ms)
            .saturating_sub(self.issued_at_ms);
        self.base
            .saturating_add(promise(self.rate_per_s, until))
            .min(self.granted)
    }
}

/// What a holder asks of the rates, for [`Ledger::rate_part`].
pub(super) struct RateAsk<'a> {
    /// The holder's demand (its want and measured demand).
    pub demand: &'a Demand<'a>,
    /// The rate it asks for, microtokens per second.
    pub want_per_s: u64,
    /// The region's part of the key, ppm; `None` without regional shares.
    pub part: Option<u32>,
    /// How long the rate would accrue, ms.
    pub duration_ms: u64,
    /// The most its promise may add to the region's live totals, microtokens.
    pub room: Micros,
}

impl Ledger {
    /// The rate to grant, ppm of the policy's rate: what is asked, at most the key's and the
    /// region's free rate (Σ live rates stay ≤ [`MAX_RATE_PPM`] and ≤ the part − 1), at most
    /// the holder's max-min fair part of the region's rate among the holders that asked within
    /// the last lease (their measured demand, else their want spread over one lease: a holder
    /// whose first ask measured nothing still has a claim, so the first holders to ask rates do
    /// not take the region's whole rate until they renew), and small enough that its promise
    /// fits `room`. While those holders' wants exceed the rate, they divide it less the pooled
    /// part ([`pooled_whole`]), which refills the bucket for lumps.
    pub(super) fn rate_part(
        &self,
        kid: &KeyId,
        region: &str,
        rule: &Rule,
        params: &LimitParams,
        ask: &RateAsk<'_>,
    ) -> u32 {
        if ask.want_per_s == 0 || !carries_rates(params) {
            return 0;
        }
        let Some(ks) = self.keys.get(kid) else {
            return 0;
        };
        let whole = u64::from(ask.part.unwrap_or(PPM).min(PPM)).saturating_sub(1);
        let held_region = ks.regions.get(region).map_or(0, |r| r.rate_ppm_live);
        let want = u64::from(params.refill_rate().ppm_of_per_s(ask.want_per_s));
        let ttl = rule.lease.ttl_ms;
        let now = self.last_ms;
        let mut wants: Vec<u64> = self
            .demands
            .get(&(kid.clone(), Name::from(region)))
            .into_iter()
            .flat_map(|m| m.iter())
            .filter(|(h, x)| *h != ask.demand.holder && x.at_ms.saturating_add(ttl) > now)
            .map(|(_, x)| u64::from(params.refill_rate().ppm_of_per_s(x.rate_per_s(ttl))))
            .collect();
        wants.push(want);
        let me = wants.len() - 1;
        let divisible = pooled_whole(whole, &wants);
        let free_key =
            pooled_whole(u64::from(MAX_RATE_PPM), &wants).saturating_sub(key_rate_ppm(ks));
        let free_region = divisible.saturating_sub(held_region);
        let fair = fair_part(divisible, &wants, me);
        // The promise must fit the live totals: rate_per_s × duration / 1000 ≤ room.
        let max_per_s = u128::from(ask.room) * 1000 / u128::from(ask.duration_ms.max(1));
        let max_per_s = u64::try_from(max_per_s).unwrap_or(u64::MAX);
        let fits = u64::from(params.refill_rate().ppm_of_per_s(max_per_s));
        let ppm = want.min(free_key).min(free_region).min(fair).min(fits);
        u32::try_from(ppm).unwrap_or(0)
    }

    /// Ends, at `now`, the accrual of `holder`'s live allocations of `kid` in `region` that
    /// still accrue: their rate leaves the live sums and their `granted` shrinks to the base
    /// plus what accrued until `now` (never below what was reported). The holder stopped their
    /// accrual before it sent the Acquire that supersedes them (design §9).
    pub(super) fn supersede(&mut self, kid: &KeyId, region: &str, holder: &str, now: u64) {
        let ids: Vec<u64> = match self.keys.get(kid).and_then(|k| k.regions.get(region)) {
            Some(r) => r
                .rated
                .range((Name::from(holder), 0)..=(Name::from(holder), u64::MAX))
                .map(|(_, id)| *id)
                .collect(),
            None => return,
        };
        if ids.is_empty() {
            return;
        }
        for id in ids {
            let Some(a) = self.allocations.get_mut(&id) else {
                continue;
            };
            let ppm = a.rate_ppm;
            a.accrual_end_ms = a.accrual_end_ms.min(now);
            let granted = a.entitled_at(now).max(a.reported);
            let shrink = a.granted.saturating_sub(granted);
            debug_assert!(granted <= a.granted, "a superseded allocation never grows");
            a.granted = granted;
            a.rate_ppm = 0;
            let charged = a.charged.calendar_period_start;
            if let Some(ks) = self.keys.get_mut(kid) {
                // The unaccrued promise was charged to the calendar quota at grant.
                refund_calendar(ks, charged, shrink);
            }
            if let Some(r) = self
                .keys
                .get_mut(kid)
                .and_then(|k| k.regions.get_mut(region))
            {
                r.granted_live = r.granted_live.saturating_sub(shrink);
                r.rate_ppm_live = r.rate_ppm_live.saturating_sub(u64::from(ppm));
                r.rated.remove(&(Name::from(holder), id));
            }
        }
        self.retune_rates(kid, region, now);
    }

    /// Re-tunes `kid`'s global bucket and `region`'s bucket to the rates live now, at `now`
    /// (Unix ms): the refill under the old rates counts up to `now`, the new rates from `now`.
    pub(super) fn retune_rates(&mut self, kid: &KeyId, region: &str, now: u64) {
        let has_shares = self
            .shares
            .get(kid.0.as_str())
            .is_some_and(|p| !p.regions.is_empty());
        let Some(ks) = self.keys.get_mut(kid) else {
            return;
        };
        let now_ns = millis_to_nanos(now);
        let params = ks.undiverted;
        let total = key_rate_ppm(ks);
        retune(&mut ks.global, diverted(params, total), now_ns);
        let part = ks.parts.effective(region);
        if let Some(r) = ks.regions.get_mut(region) {
            let rp = has_shares
                .then(|| region_params(params, part, r.rate_ppm_live))
                .flatten();
            if let (Some(rp), Some(b)) = (rp, r.bucket.as_mut()) {
                retune(b, rp, now_ns);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_common::units::{MICROS_PER_TOKEN as T, NANOS_PER_SEC};

    fn bucket(tokens_per_s: u64, burst: u64) -> LimitParams {
        LimitParams::TokenBucket {
            capacity: burst * T,
            rate: Rate::new(tokens_per_s * T, NANOS_PER_SEC).unwrap(),
        }
    }

    #[test]
    fn contended_holders_divide_the_rate_less_a_pooled_quarter() {
        // Wants that fit, or a lone holder: the whole is divided.
        assert_eq!(pooled_whole(999_999, &[400_000, 500_000]), 999_999);
        assert_eq!(pooled_whole(999_999, &[2_000_000]), 999_999);
        assert_eq!(pooled_whole(999_999, &[]), 999_999);
        // Two holders wanting more than the whole: a quarter stays in the bucket.
        assert_eq!(pooled_whole(999_999, &[600_000, 500_000]), 750_000);
        assert_eq!(pooled_whole(499_999, &[300_000, 300_000]), 375_000);
        // Extremes: saturating sums, no overflow in the quarter.
        assert_eq!(
            pooled_whole(u64::MAX, &[u64::MAX, u64::MAX]),
            u64::MAX,
            "sum saturates"
        );
        assert_eq!(
            pooled_whole(u64::MAX - 1, &[u64::MAX, u64::MAX]),
            13_835_058_055_282_163_711
        );
        assert_eq!(pooled_whole(0, &[1, 1]), 0);
        assert_eq!(pooled_whole(1, &[1, 1]), 1);
    }

    #[test]
    fn rates_are_exact_parts_of_the_policy_rate() {
        let p = bucket(10, 40);
        assert_eq!(p.refill_rate().part_per_s(500_000), 5 * T);
        assert_eq!(p.refill_rate().part_per_s(0), 0);
        assert_eq!(p.refill_rate().part_per_s(PPM), 10 * T);
        // 10¹² tokens/s: 10¹⁸ µtok/s fits in u64.
        let huge = bucket(1_000_000_000_000, 1);
        assert!(carries_rates(&huge));
        assert_eq!(huge.refill_rate().part_per_s(PPM), 1_000_000_000_000 * T);
        assert_eq!(promise(u64::MAX, u64::MAX), u64::MAX, "saturates");
        assert_eq!(promise(10 * T, 60_000), 600 * T);
        assert_eq!(promise(3, 999), 2, "rounded down");
    }

    #[test]
    fn the_bucket_keeps_what_the_rates_leave_and_at_least_one_ppm() {
        let p = bucket(10, 40);
        assert_eq!(diverted(p, 0), p);
        let LimitParams::TokenBucket { capacity, rate } = diverted(p, 250_000) else {
            panic!("a bucket stays a bucket");
        };
        assert_eq!(capacity, 40 * T);
        assert_eq!(rate, Rate::new(75 * T / 10, NANOS_PER_SEC).unwrap());
        let LimitParams::TokenBucket { rate, .. } = diverted(p, u64::MAX) else {
            panic!();
        };
        assert_eq!(rate, Rate::new(10, NANOS_PER_SEC).unwrap(), "1 ppm of 10/s");
        // A region at half the key with a quarter of the key's rate carried: a quarter left.
        let LimitParams::TokenBucket { capacity, rate } =
            region_params(p, 500_000, 250_000).unwrap()
        else {
            panic!();
        };
        assert_eq!(capacity, 20 * T);
        assert_eq!(rate, Rate::new(25 * T / 10, NANOS_PER_SEC).unwrap());
        assert_eq!(region_params(p, 0, 0), None);
        // Windows carry no rates.
        let w = LimitParams::FixedWindow(allot_common::algorithm::WindowParams {
            limit: 60 * T,
            period_ns: 60 * NANOS_PER_SEC,
        });
        assert!(!carries_rates(&w));
        assert_eq!(diverted(w, 500_000), w);
    }
}
