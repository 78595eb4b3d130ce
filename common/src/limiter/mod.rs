//! The keyed limiter: one decision function that the replay, the agent and any Rust gateway call.
//!
//! A request is decided all-or-nothing (design §10 "All or nothing"): every descriptor is matched
//! to its rule and key, the keys' slots are locked in address order (no deadlock, no lock held by
//! anyone else), every limit is checked, and only when every enforced limit allows does anything
//! spend. Shadow rules (design §10 "All or nothing") are decided and counted exactly like enforced
//! ones but never deny. Config changes (design §10 "Config versions") swap an immutable snapshot;
//! per-key state of a rule whose key shape is unchanged carries over and is transitioned lazily at
//! the snapshot's activation time.
//!
//! One concept per file:
//! * `outcome`: the answer types ([`Outcome`], [`DescriptorStatus`], [`Code`],
//!   [`Reason`], [`LimitInfo`]) and how a decision becomes a status;
//! * `versioned`: config versions ([`Snapshot`], [`SnapshotDomain`]) and [`Limiter::apply`];
//! * `decide`: the general all-or-nothing path, phase by phase, with its control flow in
//!   [`Snapshot::decide_with`]'s dispatcher;
//! * `single`: the single-descriptor fast path, held equal to the general one by a property test;
//! * `refund`: giving back unused cost (design §10 "Refunds"), the one home of refunds;
//! * `null`: the backend of [`Limiter::decide`], where no rule is leased.

mod decide;
mod null;
mod outcome;
mod refund;
mod single;
mod versioned;

pub use outcome::{Code, DescriptorStatus, LimitInfo, Outcome, Reason, TABLE_FULL_RETRY_NS};
pub use versioned::{Snapshot, SnapshotDomain};

use crate::descriptor::{Request, RequestError};
use crate::global::GlobalLimits;
use crate::keyed::KeyTable;
use crate::units::{Micros, Nanos};
use arc_swap::ArcSwap;
use hashbrown::HashMap;
use null::NoGlobal;
use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The keyed limiter. Cheap to share (`Arc<Limiter>`); every method takes `&self`.
///
/// A decision finds the current snapshot through a per-thread cache, checked against the
/// limiter's generation (one plain atomic load) instead of an `ArcSwap` load (about a tenth of
/// a keyed decision in `cargo bench -p allot-common --bench decision`). A thread keeps the last
/// snapshot it decided with until it decides again or exits: an old snapshot (and the key
/// tables of rules it alone still names) may live that long after a config change.
#[derive(Debug)]
pub struct Limiter {
    current: ArcSwap<Snapshot>,
    /// Bumped after every change of `current`.
    generation: AtomicU64,
    /// Unique among the limiters of this process (for the per-thread cache).
    id: u64,
    /// Key tables by rule id across versions; only touched when a config is applied.
    tables: Mutex<Map<String, Arc<KeyTable>>>,
}

/// The snapshot a thread decided with last, and which limiter and generation it belongs to.
struct CachedSnapshot {
    limiter: u64,
    generation: u64,
    snapshot: Arc<Snapshot>,
}

thread_local! {
    static CACHED: RefCell<Option<CachedSnapshot>> = const { RefCell::new(None) };
    /// Decisions running on this thread with a snapshot lent from [`CACHED`] (nested ones
    /// included); while it is non-zero, `CACHED` is never replaced.
    static LENT: Cell<usize> = const { Cell::new(0) };
}

/// One decision's loan of the cached snapshot: counted in [`LENT`] until dropped (unwinding
/// included). Not `Send`: the count is this thread's.
struct Lent(PhantomData<*const ()>);

impl Lent {
    #[inline(always)]
    fn start() -> Self {
        LENT.set(LENT.get() + 1);
        Lent(PhantomData)
    }
}

impl Drop for Lent {
    #[inline(always)]
    fn drop(&mut self) {
        LENT.set(LENT.get() - 1);
    }
}

/// Source of [`Limiter::id`]s.
static NEXT_LIMITER: AtomicU64 = AtomicU64::new(0);

impl Limiter {
    /// Calls `f` with the current snapshot, from this thread's cache when it is still current.
    ///
    /// On a hit the snapshot is lent out of the cache as a plain reference and `f` runs outside
    /// the thread-local's accessor, in this frame: through the accessor, the decision was an
    /// out-of-line call whose whole answer was copied out twice (about a sixth of a keyed
    /// decision's samples, issue 13 item 4). The cache is never replaced while a snapshot is
    /// lent ([`LENT`]), so the `Arc` it holds outlives every loan.
    #[inline(always)]
    fn with_current<R>(&self, f: impl FnOnce(&Snapshot) -> R) -> R {
        let generation = self.generation.load(Ordering::Acquire);
        // `try_with`: a decision made while this thread's locals are torn down finds no
        // cache and loads the snapshot instead of panicking.
        let hit = CACHED
            .try_with(|cell| {
                let c = cell.try_borrow().ok()?;
                let c = c.as_ref()?;
                (c.limiter == self.id && c.generation == generation)
                    .then_some(Arc::as_ptr(&c.snapshot))
            })
            .ok()
            .flatten();
        if let Some(snapshot) = hit {
            let _lent = Lent::start();
            // SAFETY: `CACHED` holds an `Arc` of this snapshot. Only this thread can replace
            // that `Arc` (the cell is thread-local), only below in this function, and never
            // while `LENT` is non-zero, which `_lent` keeps it for as long as `f` runs (a
            // decision nested in `f`, a backend deciding with this limiter too, included).
            return f(unsafe { &*snapshot });
        }
        let snapshot = self.current.load_full();
        if LENT.get() == 0 {
            let _ = CACHED.try_with(|cell| {
                if let Ok(mut c) = cell.try_borrow_mut() {
                    *c = Some(CachedSnapshot {
                        limiter: self.id,
                        generation,
                        snapshot: snapshot.clone(),
                    });
                }
            });
        }
        f(&snapshot)
    }

    /// Decides `req` at `now`, writing one status per descriptor into `statuses` (cleared first;
    /// reuse the buffer and the hot path allocates nothing once every key exists).
    ///
    /// # Errors
    /// [`RequestError`] for an invalid request or unknown domain; nothing is spent then.
    pub fn decide(
        &self,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
    ) -> Result<Outcome, RequestError> {
        self.with_current(|s| s.decide_inner::<NoGlobal>(req, now, statuses, None))
    }

    /// As [`decide`](Self::decide), but descriptors whose rule has `scope: global` are decided
    /// by `global` (an agent's leased allocations) instead of local state. Their reservations
    /// are cancelled when any enforced descriptor denies, so the request stays all-or-nothing.
    ///
    /// # Errors
    /// As [`decide`](Self::decide).
    pub fn decide_with<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: &G,
    ) -> Result<Outcome, RequestError> {
        self.with_current(|s| s.decide_inner(req, now, statuses, Some(global)))
    }

    /// Gives back unused cost of an admitted request with the current config version; see
    /// [`Snapshot::refund`] (design §10 "Refunds"), the one home of refunds.
    ///
    /// # Errors
    /// [`RequestError`] for an invalid request or unknown domain (nothing changes).
    pub fn refund<G: GlobalLimits>(
        &self,
        req: &Request<'_>,
        unused: &[Micros],
        spent_at: Nanos,
        now: Nanos,
        global: Option<&G>,
    ) -> Result<(), RequestError> {
        self.current
            .load()
            .refund(req, unused, spent_at, now, global)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigSet;
    use crate::decision::{Decision, RetryAfter};
    use crate::descriptor::{Descriptor, Entry};
    use crate::global::{GlobalDecision, GlobalKey};
    use crate::units::MICROS_PER_TOKEN;
    use proptest::prelude::*;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;
    use std::path::Path;

    const POLICY: &str = "domain: p
descriptors:
  - key: tb
    rate_limit: {unit: second, requests_per_unit: 3, burst: 5, scope: local}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 2, burst: 3, algorithm: gcra, scope: local}
  - key: fw
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: fixed_window, scope: local}
  - key: sw
    rate_limit: {unit: second, requests_per_unit: 4, algorithm: sliding_window, scope: local}
  - key: sl
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: sliding_log, scope: local}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1, burst: 2, scope: local}
  - key: few
    rate_limit: {unit: second, requests_per_unit: 1, burst: 1, max_keys: 2, scope: local}
  - key: free
    rate_limit: {unlimited: true}
  - key: global
    rate_limit: {unit: second, requests_per_unit: 1, burst: 4}
  - key: gshadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1, burst: 4}
";

    /// A leased backend that holds a fixed number of microtokens per key (never refilled).
    #[derive(Default)]
    struct FakeGlobal {
        left: RefCell<HashMap<String, Micros>>,
        /// The allocator is unreachable: every key is denied by its failure mode.
        down: std::cell::Cell<bool>,
    }

    impl FakeGlobal {
        fn decide(
            &self,
            key: GlobalKey<'_>,
            cost: Micros,
            take: bool,
        ) -> GlobalDecision<(String, Micros)> {
            let name = format!("{}={}", key.entries[0].key, key.entries[0].value);
            let mut left = self.left.borrow_mut();
            let l = left.entry(name.clone()).or_insert(3 * MICROS_PER_TOKEN);
            let allowed = *l >= cost && !self.down.get();
            if allowed && take {
                *l -= cost;
            }
            GlobalDecision {
                decision: Decision {
                    allowed,
                    remaining_micros: *l,
                    reset_after: 7,
                    retry_after: if allowed {
                        RetryAfter::Now
                    } else {
                        RetryAfter::After(11)
                    },
                },
                reservation: (allowed && take).then_some((name, cost)),
                cold: !allowed,
                unreachable: self.down.get(),
            }
        }
    }

    impl GlobalLimits for FakeGlobal {
        type Reservation = (String, Micros);
        fn reserve(
            &self,
            key: GlobalKey<'_>,
            cost: Micros,
            _: Nanos,
        ) -> GlobalDecision<Self::Reservation> {
            self.decide(key, cost, true)
        }
        fn peek(
            &self,
            key: GlobalKey<'_>,
            cost: Micros,
            _: Nanos,
        ) -> GlobalDecision<Self::Reservation> {
            self.decide(key, cost, false)
        }
        fn cancel(&self, (name, cost): Self::Reservation) {
            *self.left.borrow_mut().get_mut(&name).expect("reserved") += cost;
        }
        fn refund(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) {}
    }

    /// The general path alone, for the tests that hold [`decide_one`] to it.
    fn general_path<G: GlobalLimits>(
        snap: &Snapshot,
        req: &Request<'_>,
        now: Nanos,
        statuses: &mut Vec<DescriptorStatus>,
        global: Option<&G>,
    ) -> Result<Outcome, RequestError> {
        let dom = snap.domain_of(req)?;
        statuses.clear();
        Ok(snap.decide_general_in(dom, req, now, statuses, global))
    }

    fn config(burst: u32) -> ConfigSet {
        let yaml = format!(
            "domain: p\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 1, burst: {burst}}}\n"
        );
        ConfigSet::from_yaml(&yaml, Path::new("p.yaml")).expect("valid")
    }

    /// A decision that loaded the snapshot before a config change (as one in flight does)
    /// decides with the newer parameters the key already moved to; it never moves the key
    /// back, which would undo a lowered burst and then raise it again.
    #[test]
    fn a_stale_snapshot_never_moves_a_key_back() {
        let l = Limiter::new(config(10), 0);
        let entries = [Entry {
            key: "k",
            value: "a",
        }];
        let descriptors = [Descriptor {
            entries: &entries,
            hits_addend: None,
        }];
        let req = Request {
            domain: "p",
            descriptors: &descriptors,
            hits_addend: None,
        };
        let mut st = Vec::new();
        // The key exists: 10 - 1 = 9 left.
        assert_eq!(l.decide(&req, 0, &mut st).unwrap().code, Code::Ok);
        let old = l.snapshot();
        // Burst lowered to 5 at t = 1 µs: the key is clamped to 5; every decision below, with
        // the old snapshot or the new, spends from those 5.
        l.apply(config(5), 1_000);
        for (snap, left) in [(&old, 4), (&l.snapshot(), 2)] {
            let o = general_path(snap, &req, 1_000, &mut st, None::<&NoGlobal>).unwrap();
            assert_eq!((o.code, st[0].remaining), (Code::Ok, left));
            let o = snap
                .decide_inner(&req, 1_000, &mut st, None::<&NoGlobal>)
                .unwrap();
            assert_eq!((o.code, st[0].remaining), (Code::Ok, left - 1));
        }
    }

    /// A leased descriptor denied by its failure mode (the allocator unreachable) is reported
    /// as such, on the single-descriptor path and the general one, and only while it is denied.
    #[test]
    fn a_failure_mode_denial_says_the_allocator_was_unreachable() {
        let l = Limiter::new(
            ConfigSet::from_yaml(POLICY, Path::new("p.yaml")).unwrap(),
            0,
        );
        let g = FakeGlobal::default();
        g.down.set(true);
        let (ge, te) = (
            [Entry {
                key: "global",
                value: "a",
            }],
            [Entry {
                key: "tb",
                value: "a",
            }],
        );
        let one = [Descriptor {
            entries: &ge,
            hits_addend: None,
        }];
        let two = [
            Descriptor {
                entries: &te,
                hits_addend: None,
            },
            Descriptor {
                entries: &ge,
                hits_addend: None,
            },
        ];
        let mut st = Vec::new();
        for ds in [&one[..], &two[..]] {
            let req = Request {
                domain: "p",
                descriptors: ds,
                hits_addend: None,
            };
            let o = l.decide_with(&req, 0, &mut st, &g).unwrap();
            assert_eq!(o.code, Code::OverLimit);
            let last = st.last().unwrap();
            assert_eq!(
                (last.code, last.reason),
                (Code::OverLimit, Reason::AllocatorUnreachable)
            );
        }
        assert_eq!(
            st[0].reason,
            Reason::WithinLimit,
            "the local descriptor is not"
        );
        g.down.set(false);
        let req = Request {
            domain: "p",
            descriptors: &one,
            hits_addend: None,
        };
        l.decide_with(&req, 0, &mut st, &g).unwrap();
        assert_eq!(st[0].reason, Reason::WithinLimit);
    }

    const KEYS: [&str; 11] = [
        "tb", "gcra", "fw", "sw", "sl", "shadow", "few", "free", "global", "gshadow", "none",
    ];

    proptest! {
        /// The single-descriptor path answers exactly as the general path does, step by step,
        /// for every algorithm, shadow mode, a full key table, unlimited and unmatched rules,
        /// and leased descriptors, with costs from 0 to beyond capacity.
        #[test]
        fn single_descriptor_path_equals_the_general_path(
            ops in proptest::collection::vec((0..KEYS.len(), 0..4usize, 0u64..7, 0u64..700_000_000), 1..60),
        ) {
            let config = || ConfigSet::from_yaml(POLICY, Path::new("p.yaml")).expect("valid");
            let (fast, general) = (Limiter::new(config(), 0), Limiter::new(config(), 0));
            let (gf, gg) = (FakeGlobal::default(), FakeGlobal::default());
            let values = ["a", "b", "c", "d"];
            let (mut sf, mut sg) = (Vec::new(), Vec::new());
            let mut now = 0;
            for (k, v, cost, dt) in ops {
                now += dt;
                let entries = [Entry { key: KEYS[k], value: values[v] }];
                let descriptors = [Descriptor { entries: &entries, hits_addend: Some(cost) }];
                let req = Request { domain: "p", descriptors: &descriptors, hits_addend: None };
                let a = fast.decide_with(&req, now, &mut sf, &gf);
                let b = general_path(&general.snapshot(), &req, now, &mut sg, Some(&gg));
                prop_assert_eq!(a, b);
                prop_assert_eq!(&sf, &sg);
            }
            // Only the two leased rules reached the backend.
            prop_assert!(gf.left.borrow().keys().all(|k| k.starts_with("global=") || k.starts_with("gshadow=")));
        }
    }

    /// Decides, in domain `p`, one descriptor of one entry; with `global` as its backend when
    /// given. Returns the outcome and the descriptor's status.
    fn decide_entry(
        l: &Limiter,
        (key, value): (&str, &str),
        now: Nanos,
        global: Option<&Reentrant<'_>>,
    ) -> (Outcome, DescriptorStatus) {
        let entries = [Entry { key, value }];
        let descriptors = [Descriptor {
            entries: &entries,
            hits_addend: None,
        }];
        let req = Request {
            domain: "p",
            descriptors: &descriptors,
            hits_addend: None,
        };
        let mut statuses = Vec::new();
        let out = match global {
            Some(g) => l.decide_with(&req, now, &mut statuses, g),
            None => l.decide(&req, now, &mut statuses),
        };
        (out.expect("valid"), statuses[0])
    }

    /// A backend that, inside the outer decision, applies a new config to the same limiter and
    /// decides with it: the nested decision misses the per-thread cache while the outer one
    /// still runs on the snapshot lent from it, so the cache must not be replaced then
    /// (`LENT`); afterwards the next decision takes the new version into the cache.
    struct Reentrant<'l> {
        limiter: &'l Limiter,
        nested_version: Cell<Option<u64>>,
    }

    impl GlobalLimits for Reentrant<'_> {
        type Reservation = ();
        fn reserve(&self, key: GlobalKey<'_>, _: Micros, now: Nanos) -> GlobalDecision<()> {
            self.peek(key, 0, now)
        }
        fn peek(&self, _: GlobalKey<'_>, _: Micros, now: Nanos) -> GlobalDecision<()> {
            let yaml = POLICY.replace("burst: 5", "burst: 6");
            let v = self.limiter.apply(
                ConfigSet::from_yaml(&yaml, Path::new("p.yaml")).expect("valid"),
                now,
            );
            let (out, _) = decide_entry(self.limiter, ("tb", "n"), now, None);
            assert_eq!(
                out.policy_version, v,
                "the nested decision uses the new version"
            );
            let cached = CACHED.with(|c| c.borrow().as_ref().map(|c| c.generation));
            let current = self.limiter.generation.load(Ordering::Acquire);
            assert_ne!(
                cached,
                Some(current),
                "the lent snapshot's cache entry was kept"
            );
            self.nested_version.set(Some(v));
            let decision = Decision {
                allowed: true,
                remaining_micros: 0,
                reset_after: 0,
                retry_after: RetryAfter::Now,
            };
            GlobalDecision {
                decision,
                reservation: Some(()),
                cold: false,
                unreachable: false,
            }
        }
        fn cancel(&self, (): ()) {}
        fn refund(&self, _: GlobalKey<'_>, _: Micros, _: Nanos) {}
    }

    #[test]
    fn a_config_change_inside_a_decision_leaves_its_lent_snapshot_alone() {
        let limiter = Limiter::new(
            ConfigSet::from_yaml(POLICY, Path::new("p.yaml")).expect("valid"),
            0,
        );
        // Fill this thread's cache with version 0.
        let (first, _) = decide_entry(&limiter, ("tb", "a"), 1, None);
        let backend = Reentrant {
            limiter: &limiter,
            nested_version: Cell::new(None),
        };
        let (outer, status) = decide_entry(&limiter, ("global", "a"), 2, Some(&backend));
        let nested = backend.nested_version.get().expect("the backend decided");
        assert_eq!(
            outer.policy_version, first.policy_version,
            "decided on the lent snapshot"
        );
        assert!(nested > outer.policy_version);
        assert_eq!(status.code, Code::Ok);
        LENT.with(|l| assert_eq!(l.get(), 0, "every loan ended"));
        // The next decision at depth 0 replaces the cache with the current version.
        let (after, _) = decide_entry(&limiter, ("tb", "a"), 3, None);
        assert_eq!(after.policy_version, nested);
        let cached = CACHED.with(|c| c.borrow().as_ref().map(|c| c.generation));
        assert_eq!(cached, Some(limiter.generation.load(Ordering::Acquire)));
    }
}
