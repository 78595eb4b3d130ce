//! Concurrency slots (seed §25): for rules with `max_in_flight`, one
//! [`ConcurrencyLimiter`] per key. An admitted request takes one slot per capped descriptor and
//! holds it until the gateway says the request is done (or the agent forgets it).
//!
//! Slot acquisition is lock-free (one compare-and-swap); looking a key up takes one shard's read
//! lock just long enough to clone an `Arc`, like the decision core's key tables.

use allot_common::concurrency::{ConcurrencyError, ConcurrencyLimiter, Permit};
use allot_common::config::Rule;
use allot_common::descriptor::Entry;
use allot_common::keyed::ShardedTable;
use allot_common::limiter::Snapshot;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Limiters of one capped rule, by key.
#[derive(Debug)]
pub struct RuleSlots {
    /// The rule's `max_in_flight`.
    pub max: u64,
    /// Version of the config snapshot these slots were built for.
    pub generation: u64,
    /// Most distinct keys held at once (the rule's `max_keys`).
    pub max_keys: u64,
    /// Rule name, for status pages.
    pub rule_name: String,
    /// Per-key limiters; shared with the rule's slots of earlier configs, so the slots held
    /// across a config change stay counted.
    pub table: Arc<ShardedTable<Arc<ConcurrencyLimiter>>>,
}

/// Per domain, per rule index: the rule's slots, `None` for rules without `max_in_flight`.
/// Per domain (only domains with a capped rule), per rule index: the rule's slots. Built by
/// [`Slots::apply`] from one config snapshot.
#[derive(Debug, Default)]
pub struct SlotTables(HashMap<String, Vec<Option<Arc<RuleSlots>>>>);

impl SlotTables {
    /// Whether any rule of `domain` caps concurrency (a quick test before per-descriptor work).
    #[inline]
    pub fn any_capped(&self, domain: &str) -> bool {
        self.0.contains_key(domain)
    }

    /// Takes one slot of the key `entries` of rule `rule_index` in `domain`.
    pub fn acquire(&self, domain: &str, rule_index: u32, entries: &[Entry<'_>]) -> SlotOutcome {
        let Some(Some(rs)) = self.0.get(domain).and_then(|v| v.get(rule_index as usize)) else {
            return SlotOutcome::Uncapped;
        };
        let h = rs.table.hash(entries);
        // Idle limiters are evicted concurrently (see `sweep`); a permit taken on one that was
        // removed in the meantime would not count against its replacement, so confirm the
        // limiter is still the table's after taking the slot, and retry when it is not. A
        // limiter holding a slot is never evicted, so this settles at once.
        for _ in 0..4 {
            let Some(k) = rs.table.get_or_insert_capped(entries, h, rs.max_keys, || {
                ConcurrencyLimiter::at_generation(rs.max, rs.generation)
            }) else {
                return SlotOutcome::Full { max: rs.max };
            };
            // A limiter made by a decision on the previous config during a change of cap takes
            // the newer cap at its next use under the newer config (never the other way).
            if k.value.generation() < rs.generation {
                k.value.set_max(rs.max, rs.generation);
            }
            let permit = match k.value.try_acquire(1) {
                Ok(p) => p,
                Err(ConcurrencyError::Full { max, .. })
                | Err(ConcurrencyError::ExceedsCapacity { max, .. }) => {
                    return SlotOutcome::Full { max }
                }
            };
            if rs
                .table
                .get(entries, h)
                .is_some_and(|x| Arc::ptr_eq(&x, &k))
            {
                return SlotOutcome::Held(permit);
            }
        }
        SlotOutcome::Full { max: rs.max }
    }
}

/// What [`SlotTables::acquire`] found.
#[derive(Debug)]
pub enum SlotOutcome {
    /// The rule has no concurrency cap.
    Uncapped,
    /// A slot was taken; dropping the permit frees it.
    Held(Permit),
    /// Every slot is taken (or the rule's key table is full): the cap that applied.
    Full {
        /// The key's cap.
        max: u64,
    },
}

/// Concurrency limiters of every capped rule of the current config.
#[derive(Debug, Default)]
pub struct Slots {
    tables: ArcSwap<SlotTables>,
    /// Rule id → its slots, so limiters (and the permits on them) survive a config change that
    /// keeps the rule and its cap.
    by_rule: Mutex<HashMap<String, Arc<RuleSlots>>>,
}

fn capped(r: &Rule) -> Option<u64> {
    r.max_in_flight
}

impl Slots {
    /// Rebuilds the per-rule tables for a new config snapshot and returns them. A rule whose
    /// id is unchanged keeps its limiters and the slots held on them; a changed cap moves every
    /// limiter's cap ([`ConcurrencyLimiter::set_max`]), so a request holding a slot across the
    /// change still counts against the new cap.
    pub fn apply(&self, snap: &Snapshot) -> Arc<SlotTables> {
        let mut by_rule = self.by_rule.lock();
        let mut next: HashMap<String, Arc<RuleSlots>> = HashMap::new();
        let mut tables = HashMap::new();
        for d in snap.domains() {
            let v: Vec<Option<Arc<RuleSlots>>> = d
                .config
                .rules
                .iter()
                .map(|r| {
                    let max = capped(r)?;
                    let t = match by_rule.get(&r.id) {
                        Some(t)
                            if t.max == max
                                && t.max_keys == r.max_keys
                                && t.rule_name == r.name =>
                        {
                            t.clone()
                        }
                        old => {
                            let table = old.map_or_else(Arc::default, |o| o.table.clone());
                            table.for_each(|k| k.value.set_max(max, snap.version));
                            Arc::new(RuleSlots {
                                max,
                                generation: snap.version,
                                max_keys: r.max_keys,
                                rule_name: r.name.clone(),
                                table,
                            })
                        }
                    };
                    next.insert(r.id.clone(), t.clone());
                    Some(t)
                })
                .collect();
            if v.iter().any(Option::is_some) {
                tables.insert(d.config.domain.clone(), v);
            }
        }
        *by_rule = next;
        let tables = Arc::new(SlotTables(tables));
        self.tables.store(tables.clone());
        tables
    }

    /// Whether any rule of `domain` caps concurrency, in the current tables.
    #[inline]
    pub fn any_capped(&self, domain: &str) -> bool {
        self.tables.load().any_capped(domain)
    }

    /// Forgets limiters with no slot in use (bounds memory under random keys); returns how many.
    pub fn sweep(&self) -> u64 {
        let rules: Vec<Arc<RuleSlots>> = self.by_rule.lock().values().cloned().collect();
        rules
            .iter()
            .map(|r| r.table.retain(|k| k.value.in_flight() > 0))
            .sum()
    }

    /// Slots in use per capped rule: (rule name, keys held, slots in use).
    pub fn usage(&self) -> Vec<(String, u64, u64)> {
        let rules: Vec<Arc<RuleSlots>> = self.by_rule.lock().values().cloned().collect();
        rules
            .iter()
            .map(|r| {
                let mut used = 0u64;
                r.table.for_each(|k| used += k.value.in_flight());
                (r.rule_name.clone(), r.table.len(), used)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_common::config::ConfigSet;
    use allot_common::limiter::Limiter;
    use std::path::Path;

    fn config(cap: u64) -> ConfigSet {
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 9, scope: local, max_in_flight: {cap}}}\n  - key: free\n    rate_limit: {{unit: second, requests_per_unit: 9, scope: local}}\n"
        );
        ConfigSet::from_yaml(&yaml, Path::new("p")).unwrap()
    }

    fn limiter(cap: u64) -> Limiter {
        Limiter::new(config(cap), 0)
    }

    #[test]
    fn slots_per_key_full_release_and_idle_eviction() {
        let l = limiter(2);
        let s = Slots::default();
        let t = s.apply(&l.snapshot());
        let a = [Entry {
            key: "k",
            value: "a",
        }];
        let b = [Entry {
            key: "k",
            value: "b",
        }];
        assert!(s.any_capped("d") && !s.any_capped("other"));
        assert!(t.any_capped("d") && !t.any_capped("other"));
        assert!(matches!(t.acquire("d", 1, &a), SlotOutcome::Uncapped));
        let p1 = t.acquire("d", 0, &a);
        let p2 = t.acquire("d", 0, &a);
        assert!(matches!(p1, SlotOutcome::Held(_)) && matches!(p2, SlotOutcome::Held(_)));
        // The cap of rule 0 is 2; rule 1 has none (Uncapped above).
        assert!(matches!(
            t.acquire("d", 0, &a),
            SlotOutcome::Full { max: 2 }
        ));
        assert!(
            matches!(t.acquire("d", 0, &b), SlotOutcome::Held(_)),
            "keys are separate"
        );
        // b's permit was dropped at once: its limiter is idle and is forgotten; a's is not.
        assert_eq!(s.sweep(), 1);
        assert_eq!(
            s.usage(),
            vec![(
                l.snapshot().domain("d").unwrap().config.rules[0]
                    .name
                    .clone(),
                1,
                2
            )]
        );
        // A config change that keeps the rule and its cap keeps the limiters (and their use).
        let t = s.apply(&l.snapshot());
        assert!(matches!(t.acquire("d", 0, &a), SlotOutcome::Full { .. }));
        drop((p1, p2));
        assert!(matches!(t.acquire("d", 0, &a), SlotOutcome::Held(_)));
    }

    #[test]
    fn slots_held_across_a_change_of_cap_count_against_the_new_cap() {
        let s = Slots::default();
        let l = limiter(3);
        let t = s.apply(&l.snapshot());
        // Later versions of the same limiter's config, with the cap at `cap`.
        let cap = |cap: u64| {
            l.apply(config(cap), 0);
            l.snapshot()
        };
        let a = [Entry {
            key: "k",
            value: "a",
        }];
        let held: Vec<_> = (0..2).map(|_| t.acquire("d", 0, &a)).collect();
        assert!(held.iter().all(|p| matches!(p, SlotOutcome::Held(_))));
        // Raised to 5: the two held still count, so three more and no more.
        let t = s.apply(&cap(5));
        let more: Vec<_> = (0..3).map(|_| t.acquire("d", 0, &a)).collect();
        assert!(more.iter().all(|p| matches!(p, SlotOutcome::Held(_))));
        assert!(matches!(
            t.acquire("d", 0, &a),
            SlotOutcome::Full { max: 5 }
        ));
        // Lowered to 1 with five held: nothing until they fall below 1.
        let t = s.apply(&cap(1));
        drop(more);
        assert!(matches!(
            t.acquire("d", 0, &a),
            SlotOutcome::Full { max: 1 }
        ));
        drop(held);
        assert!(matches!(t.acquire("d", 0, &a), SlotOutcome::Held(_)));
        assert_eq!(s.usage()[0].2, 0, "the permit above was dropped at once");
    }
}
