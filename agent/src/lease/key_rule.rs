//! A leased key decides with the settings of the config snapshot deciding now, never with those
//! of the config it was first seen under (seed §28; issue 10 item 12): limit parameters, failure
//! mode, fuse and emergency bucket come from the decision's own rule, and the lease manager's
//! sizing (max grant, TTL, emergency reserve) from the newest rule any decision or config change
//! has shown the key.

use allot_common::algorithm::{
    LimitParams, LimitState, Rate, RateAlgorithm, TokenBucket, TokenBucketState,
};
use allot_common::config::{FailureMode, Rule, RuleLimit, PPM};
use allot_common::units::{ppm_of, Micros, Nanos, MICROS_PER_TOKEN};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What a leased decision needs of its rule, read from the rule of the snapshot deciding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRule {
    /// The rule's limit parameters.
    pub params: LimitParams,
    /// Its failure mode.
    pub failure_mode: FailureMode,
    /// Its local fuse, when configured.
    pub fuse: Option<TokenBucket>,
    /// Largest grant the allocator makes for it, microtokens.
    pub max_grant: Micros,
    /// Lease length it asks for, ms.
    pub ttl_ms: u64,
}

impl KeyRule {
    /// The settings of `rule` (a leased rule, which is limited; an unlimited one reads as one
    /// token a nanosecond, which no leased decision ever uses).
    pub fn of(rule: &Rule) -> Self {
        let params = match rule.limit {
            RuleLimit::Limited { params, .. } => params,
            RuleLimit::Unlimited => LimitParams::TokenBucket {
                capacity: MICROS_PER_TOKEN,
                rate: Rate {
                    micros: MICROS_PER_TOKEN,
                    per_ns: 1,
                },
            },
        };
        KeyRule {
            params,
            failure_mode: rule.failure_mode,
            fuse: match rule.fuse {
                Some(LimitParams::TokenBucket { capacity, rate }) => {
                    Some(TokenBucket { capacity, rate })
                }
                _ => None,
            },
            max_grant: rule.lease.max_grant,
            ttl_ms: rule.lease.ttl_ms,
        }
    }
}

/// The lease sizing of a key (max grant, TTL) for the lease manager, which decides nothing and
/// so has no snapshot of its own: refreshed from every slow-path decision's rule and from every
/// config change.
#[derive(Debug)]
pub struct LeaseSizing {
    max_grant: AtomicU64,
    ttl_ms: AtomicU64,
    /// Time the rule's rate takes to refill one token, ns.
    token_ns: AtomicU64,
    /// Time the rule's rate takes to refill its whole capacity, ns.
    fill_ns: AtomicU64,
    emergency: AtomicBool,
    /// Whether the rule is a bucket (token bucket or GCRA), the only limits whose allocations
    /// can carry a rate (design §9).
    bucket: AtomicBool,
}

/// Whether `rule`'s allocations can carry a rate: a bucket's (a window has no refill to divert).
fn is_bucket(rule: &KeyRule) -> bool {
    matches!(
        rule.params,
        LimitParams::TokenBucket { .. } | LimitParams::Gcra { .. }
    )
}

impl LeaseSizing {
    /// Sizing from `rule`.
    pub fn new(rule: &KeyRule) -> Self {
        LeaseSizing {
            max_grant: AtomicU64::new(rule.max_grant),
            ttl_ms: AtomicU64::new(rule.ttl_ms),
            token_ns: AtomicU64::new(rule.params.time_for(MICROS_PER_TOKEN)),
            fill_ns: AtomicU64::new(fill_time(rule)),
            emergency: AtomicBool::new(rule.failure_mode == FailureMode::Emergency),
            bucket: AtomicBool::new(is_bucket(rule)),
        }
    }

    /// Follows `rule` (a store only when a value changed, so busy keys share the line).
    pub fn follow(&self, rule: &KeyRule) {
        if self.max_grant.load(Ordering::Relaxed) != rule.max_grant {
            self.max_grant.store(rule.max_grant, Ordering::Relaxed);
        }
        if self.ttl_ms.load(Ordering::Relaxed) != rule.ttl_ms {
            self.ttl_ms.store(rule.ttl_ms, Ordering::Relaxed);
        }
        let token_ns = rule.params.time_for(MICROS_PER_TOKEN);
        if self.token_ns.load(Ordering::Relaxed) != token_ns {
            self.token_ns.store(token_ns, Ordering::Relaxed);
        }
        let fill = fill_time(rule);
        if self.fill_ns.load(Ordering::Relaxed) != fill {
            self.fill_ns.store(fill, Ordering::Relaxed);
        }
        let emergency = rule.failure_mode == FailureMode::Emergency;
        if self.emergency.load(Ordering::Relaxed) != emergency {
            self.emergency.store(emergency, Ordering::Relaxed);
        }
        let bucket = is_bucket(rule);
        if self.bucket.load(Ordering::Relaxed) != bucket {
            self.bucket.store(bucket, Ordering::Relaxed);
        }
    }

    /// Whether the rule's allocations can carry a rate (a token bucket or a GCRA).
    pub fn carries_rates(&self) -> bool {
        self.bucket.load(Ordering::Relaxed)
    }

    /// The emergency reserve kept out of a grant of `granted` microtokens (issue 10 item 4):
    /// `ppm` parts per million of it, rounded down, when the rule's failure mode is
    /// `emergency`; none otherwise.
    pub fn emergency_reserve(&self, granted: Micros, ppm: u32) -> Micros {
        if !self.emergency.load(Ordering::Relaxed) {
            return 0;
        }
        ppm_of(granted, ppm.min(PPM)).min(granted)
    }

    /// Largest grant, microtokens.
    pub fn max_grant(&self) -> Micros {
        self.max_grant.load(Ordering::Relaxed)
    }

    /// Lease length, ms.
    pub fn ttl_ms(&self) -> u64 {
        self.ttl_ms.load(Ordering::Relaxed)
    }

    /// Time the rule's rate takes to refill one whole token, ns (saturating): the soonest a
    /// bucket the allocator has emptied can grant again.
    pub fn token_ns(&self) -> Nanos {
        self.token_ns.load(Ordering::Relaxed)
    }

    /// Microtokens the rule's rate refills over `ns` nanoseconds, rounded down (whole tokens'
    /// time, so never more than the rate gives; saturating).
    pub fn refill_over(&self, ns: Nanos) -> Micros {
        let per_token = u128::from(self.token_ns().max(1));
        let m = u128::from(MICROS_PER_TOKEN) * u128::from(ns) / per_token;
        u64::try_from(m).unwrap_or(u64::MAX)
    }

    /// How long a key waits before asking again after a grant short of its ask, ns: an eighth
    /// of the time the rule's rate takes to refill its capacity, at most an eighth of
    /// `report_interval` (ns), at least one token's refill time.
    ///
    /// A short grant means the allocator's bucket was empty. Asking again as soon as one token
    /// refills made every token a Raft entry (at 1000/s, one a millisecond: lease-1000 gave
    /// 167–215 entries/s); waiting lets the bucket gather a lump worth an entry, and an eighth
    /// of a fill is far from letting it overflow, so what the rate produces stays grantable.
    /// The fraction is measured (`allot-local --scenario demand --short`, issue 9): a half
    /// gave lease-1000 26 entries/s but slowed part c's eu-west ramp to 6.7 s and eu-busy to
    /// 0.941; a quarter eu-busy 0.958; an eighth 44 entries/s with eu-busy 0.983, part c at
    /// 1.0 s (both as before).
    pub fn short_grant_hold_ns(&self, report_interval: Nanos) -> Nanos {
        let eighth = self.fill_ns.load(Ordering::Relaxed).min(report_interval) / 8;
        eighth.max(self.token_ns()).max(1)
    }
}

/// Time `rule`'s rate takes to refill its capacity, ns (saturating).
fn fill_time(rule: &KeyRule) -> Nanos {
    rule.params.time_for(rule.params.capacity())
}

/// A local token bucket (a fuse, an emergency bucket) whose parameters follow the config: the
/// state is kept with the parameters it was built for and carried over exactly (the decision
/// core's transition) when a decision brings other ones. Boxed, and created at first use: most
/// keys never use their emergency bucket or have no fuse, and every key carries both (8 bytes
/// each instead of 64 inline; issue 13 item 3).
#[derive(Debug, Default)]
pub struct FollowingBucket(Mutex<Option<Box<(TokenBucket, TokenBucketState)>>>);

impl FollowingBucket {
    /// Runs `f` on the state under `bucket` at `now` (created full, or carried over from the
    /// previous parameters).
    pub fn with<R>(
        &self,
        bucket: TokenBucket,
        now: Nanos,
        f: impl FnOnce(&TokenBucket, &mut TokenBucketState) -> R,
    ) -> R {
        let mut g = self.0.lock();
        let (b, st) = &mut **g.get_or_insert_with(|| Box::new((bucket, bucket.initial_state(now))));
        if *b != bucket {
            *st = carried(b, *st, &bucket, now);
            *b = bucket;
        }
        f(b, st)
    }

    /// Gives back `micros` under the parameters the state was last spent with (nothing when it
    /// was never used).
    pub fn refund(&self, now: Nanos, micros: Micros) {
        if let Some(state) = self.0.lock().as_mut() {
            let (b, st) = &mut **state;
            b.refund(st, now, micros);
        }
    }
}

/// `st` (of `old`) as the state of `new` at `now`, by the core's exact transition.
fn carried(
    old: &TokenBucket,
    st: TokenBucketState,
    new: &TokenBucket,
    now: Nanos,
) -> TokenBucketState {
    let as_params = |b: &TokenBucket| LimitParams::TokenBucket {
        capacity: b.capacity,
        rate: b.rate,
    };
    match as_params(new).transition_from(&as_params(old), LimitState::TokenBucket(st), now) {
        LimitState::TokenBucket(s) => s,
        _ => new.initial_state(now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_common::units::NANOS_PER_SEC;

    fn bucket(tokens: u64, per_s: u64) -> TokenBucket {
        TokenBucket {
            capacity: tokens * MICROS_PER_TOKEN,
            rate: Rate {
                micros: per_s * MICROS_PER_TOKEN,
                per_ns: NANOS_PER_SEC,
            },
        }
    }

    #[test]
    fn a_following_bucket_carries_its_state_to_new_parameters() {
        let f = FollowingBucket::default();
        let t = MICROS_PER_TOKEN;
        // 10 tokens, 8 spent.
        f.with(bucket(10, 1), 0, |b, st| b.spend(st, 0, 8 * t));
        // Capacity 4 now: what is left (2) fits, nothing is created.
        let left = f.with(bucket(4, 1), 0, |b, st| b.check(st, 0, 0).remaining_micros);
        assert_eq!(left, 2 * t);
        f.refund(0, 10 * t);
        let left = f.with(bucket(4, 1), 0, |b, st| b.check(st, 0, 0).remaining_micros);
        assert_eq!(left, 4 * t, "a refund never lifts it above the capacity");
        // A refund before any use gives nothing anywhere.
        let g = FollowingBucket::default();
        g.refund(0, u64::MAX);
        assert_eq!(
            g.with(bucket(3, 1), 0, |b, st| b.check(st, 0, 0).remaining_micros),
            3 * t
        );
    }

    #[test]
    fn sizing_follows_the_rule() {
        let mut r = KeyRule {
            params: LimitParams::TokenBucket {
                capacity: 1,
                rate: Rate {
                    micros: 1,
                    per_ns: 1,
                },
            },
            failure_mode: FailureMode::Deny,
            fuse: None,
            max_grant: 5,
            ttl_ms: 7,
        };
        let s = LeaseSizing::new(&r);
        r.max_grant = u64::MAX;
        r.ttl_ms = 0;
        s.follow(&r);
        assert_eq!((s.max_grant(), s.ttl_ms()), (u64::MAX, 0));
        assert_eq!(
            s.emergency_reserve(u64::MAX, 500_000),
            0,
            "failure mode deny"
        );
        r.failure_mode = FailureMode::Emergency;
        s.follow(&r);
        assert_eq!(s.emergency_reserve(1_000, 100_000), 100);
        assert_eq!(s.emergency_reserve(u64::MAX, 1_000_000), u64::MAX);
        assert_eq!(
            s.emergency_reserve(u64::MAX, u32::MAX),
            u64::MAX,
            "at most the grant"
        );
        assert_eq!(s.emergency_reserve(0, 100_000), 0);
        assert_eq!(s.emergency_reserve(9, 100_000), 0, "rounded down");
    }

    #[test]
    fn a_short_grant_holds_an_eighth_of_a_fill_at_most_an_eighth_interval() {
        let t = MICROS_PER_TOKEN;
        let rule = |capacity: u64, per_s: u64| KeyRule {
            params: LimitParams::TokenBucket {
                capacity,
                rate: Rate::per_second(per_s),
            },
            failure_mode: FailureMode::Deny,
            fuse: None,
            max_grant: capacity,
            ttl_ms: 2_000,
        };
        let second = 1_000_000_000;
        // Search: 1000/s, burst 1000: a fill is 1 s, an eighth 125 ms.
        let search = LeaseSizing::new(&rule(1_000 * t, 1_000 * t));
        assert_eq!(search.short_grant_hold_ns(second), 125_000_000);
        // Acme: 10/s, burst 40: a fill is 4 s, capped at the interval's eighth.
        let acme = LeaseSizing::new(&rule(40 * t, 10 * t));
        assert_eq!(acme.short_grant_hold_ns(second), 125_000_000);
        assert_eq!(acme.short_grant_hold_ns(8 * second), 500_000_000);
        // One microtoken a second: never sooner than one token refills (10^6 s).
        let slow = LeaseSizing::new(&rule(t, 1));
        assert_eq!(slow.short_grant_hold_ns(second), 1_000_000 * second);
        // Extremes saturate, never overflow or reach 0.
        let huge = LeaseSizing::new(&rule(u64::MAX, 1));
        assert_eq!(huge.short_grant_hold_ns(u64::MAX), u64::MAX / 8);
        let fast = LeaseSizing::new(&rule(1, u64::MAX));
        assert_eq!(fast.short_grant_hold_ns(0), 1);
        // It follows the rule.
        fast.follow(&rule(1_000 * t, 1_000 * t));
        assert_eq!(fast.short_grant_hold_ns(second), 125_000_000);
    }

    #[test]
    fn refill_over_a_time_is_whole_tokens_time_rounded_down_and_saturates() {
        let t = MICROS_PER_TOKEN;
        let rule = |per_s: u64| KeyRule {
            params: LimitParams::TokenBucket {
                capacity: 100 * t,
                rate: Rate::per_second(per_s),
            },
            failure_mode: FailureMode::Deny,
            fuse: None,
            max_grant: 100 * t,
            ttl_ms: 2_000,
        };
        let ms = 1_000_000;
        // 100/s: a token every 10 ms; a hold of 125 ms refills 12.5 tokens.
        let tenants = LeaseSizing::new(&rule(100 * t));
        assert_eq!(tenants.refill_over(125 * ms), 12 * t + t / 2);
        assert_eq!(tenants.refill_over(0), 0);
        // 3/s: a token every 333,333,334 ns (rounded up), so a second refills a little under 3.
        let slow = LeaseSizing::new(&rule(3 * t));
        assert_eq!(slow.refill_over(1_000 * ms), 2_999_999);
        // Extremes saturate.
        let fast = LeaseSizing::new(&rule(u64::MAX));
        assert_eq!(fast.refill_over(u64::MAX), u64::MAX);
    }
}
