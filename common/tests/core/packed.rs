//! The packed per-key state (issue 13 item 4; `allot_common::cell`): a token bucket or GCRA
//! decided with one compare-and-swap of a 128-bit word answers exactly as the reference
//! algorithm on its unpacked state, step by step, for the direct limiter and the keyed limiter
//! (single and multi-descriptor requests, config changes), including where the numbers do not
//! pack and the mutex decides; and under concurrency it never creates a token (conservation
//! checks with time frozen, so every admitted token is accounted for exactly).

use crate::support::{ask, d, dh, limiter, S, TOK};
use allot_common::algorithm::{
    AlgorithmKind, Gcra, LimitParams, LimitState, Rate, RateAlgorithm, TokenBucket,
};
use allot_common::clock::ManualClock;
use allot_common::config::ConfigSet;
use allot_common::direct::DirectLimiter;
use allot_common::units::{Micros, Nanos};
use allot_common::{Code, Decision, Limiter};
use proptest::prelude::*;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// A trace step: move the clock by `dt` (backwards when `back`), then decide `cost`.
fn trace(max: usize) -> impl Strategy<Value = Vec<(Nanos, bool, Micros)>> {
    prop::collection::vec(
        (
            prop_oneof![0u64..1_000, 0u64..10 * S, Just(0)],
            prop::bool::weighted(0.1),
            prop_oneof![(0u64..8).prop_map(|t| t * TOK), 0u64..3 * TOK],
        ),
        1..max,
    )
}

/// The direct limiter against the algorithm on a plain state; `start` is the clock's start.
fn direct_equals_reference<A>(alg: A, start: Nanos, steps: &[(Nanos, bool, Micros)])
where
    A: RateAlgorithm + Clone + Sync,
{
    let clock = ManualClock::new(start);
    let lim = DirectLimiter::new(alg.clone(), clock.clone());
    let mut reference = alg.initial_state(start);
    let mut now = start;
    for (i, &(dt, back, cost)) in steps.iter().enumerate() {
        now = if back {
            now.saturating_sub(dt)
        } else {
            now.saturating_add(dt)
        };
        clock.set(now);
        let want = alg.decide(&mut reference, now, cost);
        assert_eq!(lim.decide(cost), want, "step {i}: now {now} cost {cost}");
    }
}

proptest! {
    /// Token bucket and GCRA, with rates that pack (lowest terms) and rates that do not
    /// (unreduced terms whose full level exceeds 64 bits: the mutex decides), near the start
    /// of time and near its end.
    #[test]
    fn the_packed_direct_limiter_answers_as_the_reference(
        burst in 1u64..2_000,
        per in prop_oneof![Just(1u64), 1u64..1_000, Just(3_600)],
        reduced in any::<bool>(),
        late in any::<bool>(),
        steps in trace(80),
    ) {
        let tokens = burst * TOK;
        let rate = if reduced {
            Rate::new(per * TOK, S).expect("positive")
        } else {
            // 10^9 · 10^12 beyond 64 bits with any burst: never packs.
            Rate { micros: per * TOK * 1_000, per_ns: 1_000 * S * 1_000_000 }
        };
        let start = if late { u64::MAX - 20 * S } else { S };
        direct_equals_reference(TokenBucket { capacity: tokens, rate }, start, &steps);
        direct_equals_reference(Gcra { capacity: tokens, rate }, start, &steps);
    }
}

#[test]
fn a_level_that_does_not_fit_in_64_bits_is_decided_under_the_lock() {
    // capacity × per_ns = 10^18 · 10^3 > 2^64: the state never packs, the answers are the same.
    let alg = TokenBucket {
        capacity: 1_000_000_000_000 * TOK,
        rate: Rate {
            micros: 1,
            per_ns: 1_000,
        },
    };
    assert_eq!(alg.pack(&alg.initial_state(0)), None);
    direct_equals_reference(
        alg,
        0,
        &[(1, false, TOK), (5, false, 3 * TOK), (0, false, 0)],
    );
    // A full level of exactly 2^64 − 1 with the last time at u64::MAX would be the reserved
    // word: that one state stays under the lock too.
    let edge = TokenBucket {
        capacity: u64::MAX,
        rate: Rate {
            micros: 1,
            per_ns: 1,
        },
    };
    assert_eq!(edge.pack(&edge.initial_state(u64::MAX)), None);
    assert!(edge.pack(&edge.initial_state(u64::MAX - 1)).is_some());
    direct_equals_reference(
        edge,
        u64::MAX - 3,
        &[(1, false, 1), (1, false, 1), (9, false, 1)],
    );
}

const KEYED: &str = "domain: p
descriptors:
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 3, burst: 5, scope: local}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 2, burst: 3, algorithm: gcra, scope: local}
  - key: fw
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: fixed_window, scope: local}
";

/// The config of [`KEYED`] with every limit scaled: `rpu` and burst multiplied by `k`.
fn keyed_config(k: u64) -> ConfigSet {
    let yaml = KEYED
        .replace(
            "requests_per_unit: 3, burst: 5",
            &format!("requests_per_unit: {}, burst: {}", 3 * k, 5 * k),
        )
        .replace(
            "requests_per_unit: 2, burst: 3",
            &format!("requests_per_unit: {}, burst: {}", 2 * k, 3 * k),
        )
        .replace(
            "requests_per_unit: 4,",
            &format!("requests_per_unit: {},", 4 * k),
        );
    ConfigSet::from_yaml(&yaml, Path::new("p.yaml")).expect("valid")
}

/// The parameters of rule `rule` (index) in `config`.
fn params_of(config: &ConfigSet, rule: usize) -> LimitParams {
    let dom = config.domains().next().expect("one domain");
    match dom.rules[rule].limit {
        allot_common::config::RuleLimit::Limited { params, .. } => params,
        allot_common::config::RuleLimit::Unlimited => unreachable!("limited rules only"),
    }
}

/// The reference keyed limiter: per key, the parameters it was decided under and a plain state;
/// a request checks every descriptor and spends on all of them only when all allow; a config
/// change moves every key at the change's time.
#[derive(Default)]
struct Reference {
    keys: HashMap<(usize, u8), (LimitParams, LimitState)>,
}

impl Reference {
    fn decide(
        &mut self,
        cfg: &ConfigSet,
        asks: &[(usize, u8, Micros)],
        now: Nanos,
    ) -> (bool, Vec<Decision>) {
        // Costs per key summed, as the limiter sums descriptors sharing one key.
        let mut total: Vec<((usize, u8), Micros)> = Vec::new();
        for &(r, v, c) in asks {
            match total.iter_mut().find(|(k, _)| *k == (r, v)) {
                Some((_, t)) => *t += c,
                None => total.push(((r, v), c)),
            }
        }
        let mut checks = HashMap::new();
        for &(k, c) in &total {
            let (p, st) = self
                .keys
                .entry(k)
                .or_insert_with(|| (params_of(cfg, k.0), params_of(cfg, k.0).initial_state(now)));
            checks.insert(k, p.check(st, now, c));
        }
        let ok = checks.values().all(|d| d.allowed);
        for &(k, c) in &total {
            let (p, st) = self.keys.get_mut(&k).expect("checked");
            if ok {
                p.spend(st, now, c);
            } else if checks[&k].allowed {
                checks.insert(k, p.check(st, now, 0));
            }
        }
        (ok, asks.iter().map(|&(r, v, _)| checks[&(r, v)]).collect())
    }

    fn apply(&mut self, cfg: &ConfigSet, at: Nanos) {
        for ((rule, _), (p, st)) in self.keys.iter_mut() {
            let new = params_of(cfg, *rule);
            *st = new.transition_from(p, st.clone(), at);
            *p = new;
        }
    }
}

const RULES: [&str; 3] = ["tb", "gcra", "fw"];

/// One step of a keyed trace: a request of 1 to 3 descriptors (rule, value, cost in tokens), or
/// a config change to scale `k`, after `dt` ns.
#[derive(Debug, Clone)]
enum Op {
    Ask(Vec<(usize, u8, u64)>),
    Apply(u64),
}

fn ops() -> impl Strategy<Value = Vec<(Nanos, Op)>> {
    let ask = prop::collection::vec((0..RULES.len(), 0u8..3, 0u64..4), 1..4).prop_map(Op::Ask);
    let op = prop_oneof![8 => ask, 1 => (1u64..4).prop_map(Op::Apply)];
    prop::collection::vec((prop_oneof![0u64..1_000, 0u64..2 * S], op), 1..60)
}

proptest! {
    /// The keyed limiter (packed buckets, a window under the lock) answers every request as the
    /// reference does, descriptor by descriptor, across config changes that move every key.
    #[test]
    fn the_keyed_limiter_answers_as_the_reference(ops in ops()) {
        let mut cfg = keyed_config(1);
        let lim = Limiter::new(keyed_config(1), 0);
        let mut reference = Reference::default();
        let mut now = S;
        for (dt, op) in ops {
            now += dt;
            match op {
                Op::Apply(k) => {
                    cfg = keyed_config(k);
                    lim.apply(keyed_config(k), now);
                    reference.apply(&cfg, now);
                }
                Op::Ask(asks) => {
                    let values = ["a", "b", "c"];
                    let descs: Vec<_> = asks
                        .iter()
                        .map(|&(r, v, c)| dh(&[(RULES[r], values[v as usize])], c))
                        .collect();
                    let (out, st) = ask(&lim, "p", &descs, None, now).expect("valid");
                    let micro: Vec<_> = asks.iter().map(|&(r, v, c)| (r, v, c * TOK)).collect();
                    let (ok, want) = reference.decide(&cfg, &micro, now);
                    prop_assert_eq!(out.code == Code::Ok, ok);
                    for (i, w) in want.iter().enumerate() {
                        prop_assert_eq!(st[i].remaining, w.remaining_tokens(), "descriptor {}", i);
                        prop_assert_eq!(st[i].reset_after, w.reset_after, "descriptor {}", i);
                        prop_assert_eq!(st[i].retry_after, w.retry_after, "descriptor {}", i);
                    }
                }
            }
        }
    }
}

const THREADS: u64 = 4;

/// Four threads deciding cost 1 on `lim` with time frozen; returns how many were admitted.
fn race(lim: &(dyn Fn(Micros) -> Decision + Sync)) -> u64 {
    let admitted = AtomicU64::new(0);
    std::thread::scope(|sc| {
        for _ in 0..THREADS {
            sc.spawn(|| {
                for _ in 0..1_000 {
                    if lim(TOK).allowed {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    admitted.into_inner()
}

#[test]
fn concurrent_packed_decisions_create_no_token_on_one_key() {
    // Four threads, one packed bucket, time frozen: exactly the capacity passes, and what is
    // left is exactly what was not admitted.
    let p =
        LimitParams::new(AlgorithmKind::TokenBucket, 1, 86_400 * S, Some(2_000)).expect("valid");
    let rate = p.refill_rate();
    let clock = ManualClock::new(S);
    let tb = DirectLimiter::new(
        TokenBucket {
            capacity: 2_000 * TOK,
            rate,
        },
        clock.clone(),
    );
    assert!(tb
        .algorithm()
        .pack(&tb.algorithm().initial_state(S))
        .is_some());
    assert_eq!(race(&|c| tb.decide(c)), 2_000);
    assert_eq!(tb.decide(0).remaining_micros, 0);
    let gcra = DirectLimiter::new(
        Gcra {
            capacity: 2_000 * TOK,
            rate,
        },
        clock,
    );
    assert!(gcra
        .algorithm()
        .pack(&gcra.algorithm().initial_state(S))
        .is_some());
    assert_eq!(race(&|c| gcra.decide(c)), 2_000);
    assert_eq!(gcra.decide(0).remaining_micros, 0);
}

const CONSERVED: &str = "domain: m
descriptors:
  - key: a
    rate_limit: {unit: day, requests_per_unit: 1, burst: BA}
  - key: b
    rate_limit: {unit: day, requests_per_unit: 1, burst: BB, algorithm: gcra}
";

fn conserved(raise: u64) -> ConfigSet {
    let yaml = CONSERVED
        .replace("BA", &(300 + raise).to_string())
        .replace("BB", &(500 + raise).to_string());
    ConfigSet::from_yaml(&yaml, Path::new("m.yaml")).expect("valid")
}

#[test]
fn concurrent_mixed_requests_and_config_changes_conserve_every_token() {
    // Time is frozen (nothing refills), so every token of a key is either left or admitted.
    // Threads send (a, b) together, a alone and b alone while another raises both bursts by
    // one token at a time (a raise adds the increase): at the end each key's admitted tokens
    // are exactly its final burst minus what is left. A spend on `a` for a pair that `b`
    // denied, a spend lost between a compare-and-swap and a lock, or a raise applied twice
    // would all break the equality.
    const RAISES: u64 = 50;
    for round in 0..20 {
        let l = Limiter::new(conserved(0), 0);
        // Both keys exist (and hold their state packed) before the race.
        for key in ["a", "b"] {
            let (o, _) = ask(&l, "m", &[dh(&[(key, "v")], 0)], None, 1).unwrap();
            assert_eq!(o.code, Code::Ok);
        }
        let (pairs, only_a, only_b) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        std::thread::scope(|sc| {
            for th in 0..3u64 {
                let (l, pairs, only_a, only_b) = (&l, &pairs, &only_a, &only_b);
                sc.spawn(move || {
                    for _ in 0..400 {
                        let (descs, count) = match th {
                            0 => (vec![d(&[("a", "v")]), d(&[("b", "v")])], pairs),
                            1 => (vec![d(&[("a", "v")])], only_a),
                            _ => (vec![d(&[("b", "v")])], only_b),
                        };
                        let (o, _) = ask(l, "m", &descs, None, 1).unwrap();
                        if o.code == Code::Ok {
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
            sc.spawn(|| {
                for raise in 1..=RAISES {
                    l.apply(conserved(raise), 1);
                }
            });
        });
        let left = |key| {
            let (_, st) = ask(&l, "m", &[dh(&[(key, "v")], 0)], None, 1).unwrap();
            st[0].remaining
        };
        let (pairs, only_a, only_b) =
            (pairs.into_inner(), only_a.into_inner(), only_b.into_inner());
        assert_eq!(
            pairs + only_a,
            300 + RAISES - left("a"),
            "round {round}: key a"
        );
        assert_eq!(
            pairs + only_b,
            500 + RAISES - left("b"),
            "round {round}: key b"
        );
    }
}

#[test]
fn a_decision_with_an_older_snapshot_decides_with_the_key_s_newer_parameters() {
    // Lowering the burst moves the key at once; a decision still holding the old snapshot
    // (in flight across the change) spends from the lowered bucket, never from the old one.
    let l = limiter(
        "domain: p\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1, burst: 10, scope: local}\n",
        0,
    );
    let (o, _) = ask(&l, "p", &[d(&[("k", "a")])], None, 0).unwrap();
    assert_eq!(o.code, Code::Ok);
    let old = l.snapshot();
    l.apply(
        crate::support::config(
            "domain: p\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1, burst: 5, scope: local}\n",
        ),
        1_000,
    );
    let entries = [allot_common::descriptor::Entry {
        key: "k",
        value: "a",
    }];
    let descriptors = [allot_common::descriptor::Descriptor {
        entries: &entries,
        hits_addend: None,
    }];
    let req = allot_common::descriptor::Request {
        domain: "p",
        descriptors: &descriptors,
        hits_addend: None,
    };
    let mut st = Vec::new();
    let global = NoLeases;
    for left in [4, 3, 2, 1, 0] {
        let o = old.decide_with(&req, 1_000, &mut st, &global).unwrap();
        assert_eq!((o.code, st[0].remaining), (Code::Ok, left));
    }
    assert_eq!(
        old.decide_with(&req, 1_000, &mut st, &global).unwrap().code,
        Code::OverLimit
    );
}

/// A backend for `Snapshot::decide_with` on a config with no leased rule (never called).
struct NoLeases;

impl allot_common::global::GlobalLimits for NoLeases {
    type Reservation = ();
    fn reserve(
        &self,
        _: allot_common::global::GlobalKey<'_>,
        _: Micros,
        _: Nanos,
    ) -> allot_common::global::GlobalDecision<()> {
        unreachable!("no leased rule")
    }
    fn peek(
        &self,
        key: allot_common::global::GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> allot_common::global::GlobalDecision<()> {
        self.reserve(key, cost, now)
    }
    fn cancel(&self, _: ()) {}
    fn refund(&self, _: allot_common::global::GlobalKey<'_>, _: Micros, _: Nanos) {}
}
