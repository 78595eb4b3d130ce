//! Property tests on random traces of (time step, cost), with exact integer arithmetic:
//! envelopes (token bucket / GCRA: B + r·(t2 − t1); fixed window: L per aligned window; sliding
//! log: L in every (t − P, t]; sliding-window counter: L per aligned window and the two-bucket
//! estimate ≤ L at every admission), GCRA ≡ token bucket, exact retry_after, and transitions.

use crate::support::{decide, peek, MS, S, TOK};
use allot_common::algorithm::{AlgorithmKind, LimitParams, LimitState, Rate, WindowParams};
use allot_common::units::{Micros, Nanos};
use allot_common::{Decision, RetryAfter};
use proptest::prelude::*;

/// One trace step: advance (or, when `back`, go back) by `dt`, then ask for a cost chosen by
/// `cost_raw` relative to the limit's capacity.
#[derive(Debug, Clone, Copy)]
struct Step {
    dt: Nanos,
    back: bool,
    cost_raw: u64,
}

const PERIODS: [Nanos; 4] = [1_000, S, 7 * S, 60 * S];

fn steps(max_len: usize) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (
            0u64..=64,
            0u64..1000,
            prop::bool::weighted(0.08),
            any::<u64>(),
        ),
        1..=max_len,
    )
    .prop_map(|v| {
        v.into_iter()
            .map(|(k, jitter, back, cost_raw)| Step {
                // Scaled by the period later: k/32 of a period plus a few ns of jitter.
                dt: k * 1_000 + jitter,
                back,
                cost_raw,
            })
            .collect()
    })
}

/// Whole tokens from 0 to capacity + 2 mostly; sometimes an arbitrary microtoken amount.
fn cost_of(raw: u64, cap: Micros) -> Micros {
    if raw % 5 == 0 {
        (raw / 5) % (cap + TOK + 1)
    } else {
        ((raw / 5) % (cap / TOK + 3)) * TOK
    }
}

/// Absolute times for a trace, given the limit's period; time may go backwards (saturating).
fn times(trace: &[Step], period: Nanos) -> Vec<Nanos> {
    let mut t: Nanos = 5 * period;
    trace
        .iter()
        .map(|s| {
            let d = (s.dt / 1_000) as u128 * period as u128 / 32 + (s.dt % 1_000) as u128;
            let d = d as u64;
            t = if s.back {
                t.saturating_sub(d)
            } else {
                t.saturating_add(d)
            };
            t
        })
        .collect()
}

struct Run {
    /// (effective time = latest seen, cost, decision) for every step.
    events: Vec<(Nanos, Micros, Decision)>,
    state: LimitState,
}

fn run(p: &LimitParams, trace: &[Step], period: Nanos) -> Run {
    let ts = times(trace, period);
    let mut state = p.initial_state(ts[0].min(5 * period));
    let mut latest = 0;
    let mut events = Vec::with_capacity(trace.len());
    for (s, &t) in trace.iter().zip(&ts) {
        latest = latest.max(t);
        let cost = cost_of(s.cost_raw, p.capacity());
        let d = decide(p, &mut state, t, cost);
        events.push((latest, cost, d));
    }
    Run { events, state }
}

/// A bucket: config-shaped numbers (whole tokens per unit) or arbitrary exact ratios (odd
/// microtoken capacities, rates and periods), so sub-microtoken arithmetic is exercised too.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    kind: AlgorithmKind,
    cap: Micros,
    rate: Rate,
}

impl Bucket {
    fn params(&self) -> LimitParams {
        Self::of(self.kind, self.cap, self.rate)
    }

    fn of(kind: AlgorithmKind, capacity: Micros, rate: Rate) -> LimitParams {
        match kind {
            AlgorithmKind::Gcra => LimitParams::Gcra { capacity, rate },
            _ => LimitParams::TokenBucket { capacity, rate },
        }
    }

    /// Time scale of a trace step: the time to refill the whole bucket (at least 1 ns).
    fn scale(&self) -> Nanos {
        let t = self.cap as u128 * self.rate.per_ns as u128 / self.rate.micros as u128;
        t.clamp(1, 1_000_000_000_000_000) as u64
    }
}

fn bucket() -> impl Strategy<Value = Bucket> {
    let kind = prop::sample::select(vec![AlgorithmKind::TokenBucket, AlgorithmKind::Gcra]);
    let config_like = (1u64..=20, prop::sample::select(PERIODS.to_vec()), 1u64..=20).prop_map(
        |(rpu, per, burst)| {
            (
                burst * TOK,
                Rate {
                    micros: rpu * TOK,
                    per_ns: per,
                },
            )
        },
    );
    let odd = (
        1u64..=20 * TOK,
        prop_oneof![1u64..=20, 1u64..=20 * TOK],
        prop_oneof![1u64..=1000, 1u64..=60 * S],
    )
        .prop_map(|(cap, micros, per)| {
            (
                cap,
                Rate {
                    micros,
                    per_ns: per,
                },
            )
        });
    (kind, prop_oneof![config_like, odd]).prop_map(|(kind, (cap, rate))| Bucket { kind, cap, rate })
}

/// A window limit: config-shaped or arbitrary microtoken limits and periods.
fn window() -> impl Strategy<Value = WindowParams> {
    prop_oneof![
        (1u64..=20, prop::sample::select(PERIODS.to_vec())).prop_map(|(rpu, per)| WindowParams {
            limit: rpu * TOK,
            period_ns: per
        }),
        (1u64..=20 * TOK, 1u64..=60 * S)
            .prop_map(|(limit, period_ns)| WindowParams { limit, period_ns }),
    ]
}

fn window_params() -> impl Strategy<Value = (AlgorithmKind, WindowParams)> {
    (
        prop::sample::select(vec![
            AlgorithmKind::FixedWindow,
            AlgorithmKind::SlidingWindow,
            AlgorithmKind::SlidingLog,
        ]),
        window(),
    )
}

fn window_of(kind: AlgorithmKind, w: WindowParams) -> LimitParams {
    match kind {
        AlgorithmKind::FixedWindow => LimitParams::FixedWindow(w),
        AlgorithmKind::SlidingWindow => LimitParams::SlidingWindow(w),
        _ => LimitParams::SlidingLog(w),
    }
}

/// B + r·(t_j − t_i) ≥ admitted cost in [t_i, t_j], for every pair of admitted events, in
/// microtokens × period (exact).
fn assert_bucket_envelope(
    events: &[(Nanos, Micros, Decision)],
    cap: Micros,
    rate_micros: u64,
    per: Nanos,
) {
    let adm: Vec<(Nanos, Micros)> = events
        .iter()
        .filter(|e| e.2.allowed)
        .map(|e| (e.0, e.1))
        .collect();
    for i in 0..adm.len() {
        let mut sum: u128 = 0;
        for j in i..adm.len() {
            sum += adm[j].1 as u128;
            let bound =
                cap as u128 * per as u128 + (adm[j].0 - adm[i].0) as u128 * rate_micros as u128;
            assert!(
                sum * per as u128 <= bound,
                "admitted {sum} µ in [{}, {}] above B + r·dt",
                adm[i].0,
                adm[j].0
            );
        }
    }
}

/// Invariants every decision keeps, whatever the algorithm.
fn assert_decision_shape(events: &[(Nanos, Micros, Decision)], cap: Micros) {
    for &(_, cost, d) in events {
        assert!(d.remaining_micros <= cap);
        assert_eq!(
            d.retry_after == RetryAfter::Never,
            cost > cap,
            "{d:?} cost {cost}"
        );
        assert_eq!(d.allowed, d.retry_after == RetryAfter::Now, "{d:?}");
        if cost == 0 {
            assert!(d.allowed, "a cost of 0 is always allowed");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn buckets_never_admit_more_than_b_plus_r_dt(b in bucket(), trace in steps(200)) {
        let p = b.params();
        let r = run(&p, &trace, b.scale());
        assert_decision_shape(&r.events, b.cap);
        assert_bucket_envelope(&r.events, b.cap, b.rate.micros, b.rate.per_ns);
    }

    #[test]
    fn gcra_and_token_bucket_decide_identically(b in bucket(), trace in steps(200)) {
        let tb = Bucket::of(AlgorithmKind::TokenBucket, b.cap, b.rate);
        let gc = Bucket::of(AlgorithmKind::Gcra, b.cap, b.rate);
        let a = run(&tb, &trace, b.scale());
        let g = run(&gc, &trace, b.scale());
        for (x, y) in a.events.iter().zip(&g.events) {
            prop_assert_eq!(x, y);
        }
        let end = a.events.last().unwrap().0;
        let sc = b.scale();
        for dt in [0, 1, sc / 3, sc, sc + 1, 40 * sc] {
            prop_assert_eq!(peek(&tb, &a.state, end + dt), peek(&gc, &g.state, end + dt));
            prop_assert_eq!(tb.is_idle(&a.state, end + dt), gc.is_idle(&g.state, end + dt));
        }
    }

    #[test]
    fn fixed_window_never_admits_more_than_l_per_aligned_window(w in window(), trace in steps(200)) {
        let p = LimitParams::FixedWindow(w);
        let r = run(&p, &trace, w.period_ns);
        assert_decision_shape(&r.events, w.limit);
        let mut per_window = std::collections::BTreeMap::<u64, u128>::new();
        for &(t, c, d) in &r.events {
            if d.allowed {
                *per_window.entry(t / w.period_ns).or_default() += c as u128;
            }
        }
        for (k, sum) in per_window {
            prop_assert!(sum <= w.limit as u128, "window {} admitted {}", k, sum);
        }
    }

    #[test]
    fn sliding_log_never_admits_more_than_l_in_any_window(w in window(), trace in steps(200)) {
        let p = LimitParams::SlidingLog(w);
        let r = run(&p, &trace, w.period_ns);
        assert_decision_shape(&r.events, w.limit);
        let adm: Vec<(Nanos, Micros)> =
            r.events.iter().filter(|e| e.2.allowed).map(|e| (e.0, e.1)).collect();
        // The heaviest window (t − P, t] ends at an admitted event.
        for &(tj, _) in &adm {
            let sum: u128 = adm
                .iter()
                .filter(|&&(ti, _)| ti <= tj && tj - ti < w.period_ns)
                .map(|&(_, c)| c as u128)
                .sum();
            prop_assert!(sum <= w.limit as u128, "window ending {} admitted {}", tj, sum);
        }
    }

    /// The sliding-window counter is an estimate, so its sound guarantees are: at most L per
    /// aligned window (hence at most 2L in any interval of one period), and at every admission
    /// `current + previous × (1 − elapsed/P) ≤ L` recomputed independently from the admitted log.
    #[test]
    fn sliding_window_counter_keeps_its_estimate_within_l(w in window(), trace in steps(200)) {
        let p = LimitParams::SlidingWindow(w);
        let r = run(&p, &trace, w.period_ns);
        let l = w.limit as u128;
        let pp = w.period_ns as u128;
        assert_decision_shape(&r.events, w.limit);
        let mut per_window = std::collections::BTreeMap::<u64, u128>::new();
        for &(t, c, d) in &r.events {
            if !d.allowed {
                continue;
            }
            let k = t / w.period_ns;
            let cur = per_window.entry(k).or_default();
            *cur += c as u128;
            let cur = *cur;
            let prev = if k == 0 { 0 } else { per_window.get(&(k - 1)).copied().unwrap_or(0) };
            let e = (t % w.period_ns) as u128;
            prop_assert!(cur <= l, "window {} admitted {}", k, cur);
            prop_assert!(cur * pp + prev * (pp - e) <= l * pp, "estimate above L at {}", t);
            prop_assert!(cur + prev <= 2 * l);
        }
    }

    /// retry_after is exact: with no other traffic the same request passes at now + retry_after
    /// and not one nanosecond earlier (every algorithm).
    #[test]
    fn retry_after_is_exact(
        b in bucket(),
        (wk, w) in window_params(),
        use_bucket in any::<bool>(),
        trace in steps(120),
    ) {
        let (p, scale) = if use_bucket { (b.params(), b.scale()) } else { (window_of(wk, w), w.period_ns) };
        let kind = p.kind();
        let ts = times(&trace, scale);
        let mut state = p.initial_state(ts[0]);
        let mut latest = 0;
        for (s, &t) in trace.iter().zip(&ts) {
            latest = latest.max(t);
            let cost = cost_of(s.cost_raw, p.capacity());
            let d = decide(&p, &mut state, t, cost);
            match d.retry_after {
                RetryAfter::Now => prop_assert!(d.allowed),
                RetryAfter::Never => prop_assert!(cost > p.capacity()),
                RetryAfter::After(wait) => {
                    prop_assert!(wait >= 1);
                    let mut at = state.clone();
                    prop_assert!(p.check(&mut at, latest + wait, cost).allowed,
                        "{kind}: not allowed at now + retry_after ({wait})");
                    let mut before = state.clone();
                    prop_assert!(!p.check(&mut before, latest + wait - 1, cost).allowed,
                        "{kind}: already allowed 1 ns before now + retry_after ({wait})");
                }
            }
        }
    }

    /// Splitting an idle interval into any number of steps refills exactly as one step does, and
    /// exactly min(B, B − spent + r·span) (floored to a microtoken).
    #[test]
    fn bucket_refill_is_the_same_in_any_number_of_steps(
        b in bucket(),
        cuts in prop::collection::vec(0u64..1_000_000, 0..200),
        spent in any::<u64>(),
        span_k in 1u64..=64,
    ) {
        let p = b.params();
        let spent = spent % (b.cap + 1);
        let span = b.scale() * span_k / 32;
        let mut one = p.initial_state(0);
        prop_assert!(decide(&p, &mut one, 0, spent).allowed);
        let mut many = one.clone();
        let mut cuts: Vec<Nanos> = cuts
            .into_iter()
            .map(|c| (c as u128 * span as u128 / 1_000_000) as u64)
            .collect();
        cuts.sort_unstable();
        for c in cuts {
            p.check(&mut many, c, 0);
        }
        let a = peek(&p, &one, span);
        let m = peek(&p, &many, span);
        prop_assert_eq!(a, m);
        let expect = ((b.cap - spent) as u128
            + span as u128 * b.rate.micros as u128 / b.rate.per_ns as u128)
            .min(b.cap as u128) as u64;
        prop_assert_eq!(a.remaining_micros, expect);
    }
}

// ---- policy transitions (LimitParams::transition_from) --------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Bucket → bucket: tokens at the change are min(B_new, tokens_old + max(0, B_new − B_old));
    /// from then on at most tokens + r_new·(t − at) and B_new + r_new·(t_j − t_i) are admitted.
    #[test]
    fn bucket_transitions_never_create_more_than_the_new_capacity(
        b1 in bucket(),
        b2 in bucket(),
        before in steps(60),
        after in steps(100),
        gap in 0u64..=64,
    ) {
        let old = b1.params();
        let new = b2.params();
        let r = run(&old, &before, b1.scale());
        let end = r.events.last().unwrap().0;
        let at = end + b1.scale() * gap / 32;
        let old_tokens = peek(&old, &r.state, at).remaining_micros;
        let mut st = new.transition_from(&old, r.state.clone(), at);
        let expect = (old_tokens + b2.cap.saturating_sub(b1.cap)).min(b2.cap);
        let now = peek(&new, &st, at);
        prop_assert_eq!(now.remaining_micros, expect);
        // Continue under the new parameters from `at`.
        let ts = times(&after, b2.scale());
        let base = ts[0];
        let mut events = Vec::new();
        let mut latest = at;
        for (s, t) in after.iter().zip(ts) {
            let t = at + (t - base.min(t));
            latest = latest.max(t);
            let cost = cost_of(s.cost_raw, new.capacity());
            events.push((latest, cost, decide(&new, &mut st, t, cost)));
        }
        assert_bucket_envelope(&events, b2.cap, b2.rate.micros, b2.rate.per_ns);
        let per = b2.rate.per_ns as u128;
        let mut sum: u128 = 0;
        for &(t, c, d) in &events {
            if d.allowed {
                sum += c as u128;
                // The carried level may hold a fraction of a microtoken more than `expect`.
                let bound = (expect as u128 + 1) * per + (t - at) as u128 * b2.rate.micros as u128;
                prop_assert!(sum * per < bound, "more than tokens_at + r·dt");
            }
        }
    }

    /// Window → window of the same algorithm keeps the used count; a new, lower limit never lets
    /// more than itself through in any aligned window; a change of family starts fresh.
    #[test]
    fn window_transitions_keep_counts_and_respect_the_new_limit(
        (k1, w1) in window_params(),
        w2 in window(),
        to_bucket in any::<bool>(),
        before in steps(60),
        after in steps(100),
    ) {
        let old = window_of(k1, w1);
        let new = if to_bucket {
            Bucket::of(AlgorithmKind::TokenBucket, w2.limit, Rate { micros: w2.limit, per_ns: w2.period_ns })
        } else {
            window_of(k1, w2)
        };
        let r = run(&old, &before, w1.period_ns);
        let at = r.events.last().unwrap().0;
        let old_view = peek(&old, &r.state, at);
        let mut st = new.transition_from(&old, r.state.clone(), at);
        let view = peek(&new, &st, at);
        prop_assert!(view.remaining_micros <= new.capacity());
        if to_bucket {
            // Another family: a fresh, full bucket.
            prop_assert_eq!(view.remaining_micros, w2.limit);
            return Ok(());
        }
        let carried = w1.limit - old_view.remaining_micros;
        if k1 == AlgorithmKind::FixedWindow
            || (k1 == AlgorithmKind::SlidingLog && w1.period_ns == w2.period_ns)
        {
            prop_assert_eq!(view.remaining_micros, w2.limit.saturating_sub(carried));
        }
        // Every window of the new limit (the first one counted with the carried count).
        let ts = times(&after, w2.period_ns);
        let base = ts[0];
        let mut per_window = std::collections::BTreeMap::<u64, u128>::new();
        let mut latest = at;
        for (s, t) in after.iter().zip(ts) {
            let t = at + (t - base.min(t));
            latest = latest.max(t);
            let cost = cost_of(s.cost_raw, new.capacity());
            if decide(&new, &mut st, t, cost).allowed {
                *per_window.entry(latest / w2.period_ns).or_default() += cost as u128;
            }
        }
        for (k, sum) in per_window {
            prop_assert!(sum <= w2.limit as u128, "window {} admitted {}", k, sum);
            if k1 == AlgorithmKind::FixedWindow && k == at / w2.period_ns {
                prop_assert!(sum <= w2.limit.saturating_sub(carried) as u128);
            }
        }
    }
}

#[test]
fn transition_numbers_are_exact() {
    let tb = |rpu, b| LimitParams::new(AlgorithmKind::TokenBucket, rpu, S, Some(b)).unwrap();
    let gc = |rpu, b| LimitParams::new(AlgorithmKind::Gcra, rpu, S, Some(b)).unwrap();
    // B 10 → 4 at 1 s with 2 spent at 0 (9 there at 1 s): clamped to 4.
    let old = tb(1, 10);
    let mut s = old.initial_state(0);
    assert!(decide(&old, &mut s, 0, 2 * TOK).allowed);
    let new = tb(1, 4);
    let s2 = new.transition_from(&old, s.clone(), S);
    assert_eq!(peek(&new, &s2, S).remaining_micros, 4 * TOK);
    // B 10 → 15: 9 + 5 = 14 at once.
    let new = gc(1, 15);
    let s3 = new.transition_from(&old, s.clone(), S);
    assert_eq!(peek(&new, &s3, S).remaining_micros, 14 * TOK);
    assert_eq!(peek(&new, &s3, S).reset_after, S);
    // Rate 1/s → 4/s at 1.5 s, 8 spent at 0: 3.5 at 1.5 s, then 4/s: 5.5 at 2 s.
    let mut s = old.initial_state(0);
    assert!(decide(&old, &mut s, 0, 8 * TOK).allowed);
    let new = tb(4, 10);
    let s4 = new.transition_from(&old, s, 1500 * MS);
    assert_eq!(peek(&new, &s4, 2 * S).remaining_micros, 5_500_000);
    // Identical parameters: the state is returned untouched.
    let s5 = old.initial_state(3);
    assert_eq!(old.transition_from(&old, s5.clone(), 99 * S), s5);
}
