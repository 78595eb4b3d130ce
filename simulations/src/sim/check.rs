//! The invariants of issue 12 item 2, checked on what the driver observes while the run goes
//! (ledgers of every live node, the allocations every agent holds) and, for the admission
//! bound, on every window [t₁, t₂) of the run's answers against the bound the most advanced
//! node reported at t₁.

use std::collections::BTreeMap;

use allot_allocator::ledger::{AllocationState, Ledger, PolicyKey};
use allot_common::units::{Micros, MICROS_PER_TOKEN, NANOS_PER_SEC};

use super::workload::Contract;
use crate::arrivals::{Key, Record, RequestAnswer};

/// Nanoseconds per millisecond.
const NS_PER_MS: u64 = 1_000_000;
/// How long an agent may hold a grant the most advanced ledger does not know, once that ledger
/// applied every log entry that can hold it, before it counts as lost (again).
const LOST_AFTER_NS: u64 = 1_000 * NS_PER_MS;

/// A key and region of one cluster generation: (generation, rule id, canonical key, region).
type KeyRegion = (u32, String, Vec<u8>, String);

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// When it was observed, ns of simulated time.
    pub at_ns: u64,
    /// Which invariant.
    pub kind: &'static str,
    /// What was seen.
    pub detail: String,
}

/// What the ledger says of one allocation, fixed at grant.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Granted {
    holder: String,
    rule_id: String,
    key: Vec<u8>,
    region: String,
    epoch: u64,
    issued_at_ms: u64,
}

/// What the driver last saw of one allocation an agent holds.
#[derive(Debug, Clone)]
struct Held {
    generation: u32,
    epoch: u64,
    /// Its base, µtokens (the ledger's `base`; its `granted` also counts the promise).
    base: Micros,
    /// Spend seen at the first observation at or past its local deadline.
    spent_at_deadline: Option<Micros>,
    /// Since when the most advanced ledger has not known it.
    unknown_since: Option<u64>,
    /// The highest log index any node held when it was first seen: its grant was answered
    /// after its entry committed, so the entry is at or below this index.
    log_bound: u64,
}

/// A snapshot of one allocation an agent holds, as observed.
#[derive(Debug, Clone, Copy)]
pub struct HeldView {
    /// Allocation id.
    pub id: u64,
    /// Epoch.
    pub epoch: u64,
    /// Granted, µtokens: the base plus what its rate can accrue (design §9).
    pub granted: Micros,
    /// Granted at once, µtokens: what the ledger records as the allocation's base.
    pub base: Micros,
    /// Spent so far, µtokens.
    pub spent: Micros,
    /// Its local deadline, agent clock ns.
    pub deadline: u64,
    /// Whether the agent closed it (a Release composed: nothing more is spent from it).
    pub closed: bool,
}

/// The bound and calendar quota the most advanced node reported for a key at one instant.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ns: u64,
    bound: Micros,
    calendar_remaining: Option<Micros>,
}

/// Collects observations and violations of one run.
#[derive(Debug, Default)]
pub struct Checker {
    generation: u32,
    granted: BTreeMap<(u32, u64), Granted>,
    /// Epochs by key and region, by allocation id.
    epochs: BTreeMap<KeyRegion, BTreeMap<u64, u64>>,
    /// By agent, allocation id and local deadline (ids start again at 1 after a state loss;
    /// the deadline tells two grants of one id apart).
    held: BTreeMap<(usize, u64, u64), Held>,
    samples: Vec<Vec<Sample>>,
    /// State losses: when, and each key's bound just before.
    losses: Vec<(u64, Vec<Micros>)>,
    /// The highest Raft log index any node of this generation was seen to hold.
    log_high: u64,
    /// Violations found, in order.
    pub violations: Vec<Violation>,
    /// Times `check_invariants` ran on a node.
    pub invariant_checks: u64,
    /// The largest bound a node reported for one key, µtokens.
    pub max_bound: Micros,
    /// Per key, the largest bound a node reported, µtokens.
    pub max_bound_by_key: Vec<Micros>,
    /// Per key, the stranded tokens the most advanced ledger counts in this generation, µtokens.
    stranded_now: Vec<Micros>,
    /// Stranded tokens of earlier generations (before state losses), µtokens.
    stranded_before: Micros,
    /// The observation instant `unreported_sum` is being summed for, ns.
    unreported_at: u64,
    /// Σ over the agents observed at `unreported_at` of spent − reported, µtokens.
    unreported_sum: Micros,
    /// The longest an allocation of any key can be spent after its grant (ttl + drift), ns:
    /// a grant held after a state loss whose Acquire may have been sent before it is the lost
    /// cluster's, not a grant the new one lost.
    pub lease_life_ns: u64,
    /// The largest spend the agents had made and the most advanced ledger had not been
    /// reported at one observation instant (every key), µtokens: the delay part of the bound
    /// (design §6, Σ rᵢ·Δ).
    pub max_unreported: Micros,
}

impl Checker {
    /// A checker for `keys` keys.
    pub fn new(keys: usize) -> Self {
        Checker {
            samples: vec![Vec::new(); keys],
            max_bound_by_key: vec![0; keys],
            stranded_now: vec![0; keys],
            ..Checker::default()
        }
    }

    fn violation(&mut self, at_ns: u64, kind: &'static str, detail: String) {
        if self.violations.len() < 1_000 {
            self.violations.push(Violation {
                at_ns,
                kind,
                detail,
            });
        }
    }

    /// The cluster lost its whole state at `at_ns`: a new generation of ids begins.
    pub fn state_lost(&mut self, at_ns: u64) {
        let before = self
            .samples
            .iter()
            .map(|s| s.last().map_or(0, |x| x.bound))
            .collect();
        self.losses.push((at_ns, before));
        self.generation += 1;
        self.log_high = 0;
        let lost: Micros = self
            .stranded_now
            .iter()
            .fold(0, |a, s| a.saturating_add(*s));
        self.stranded_before = self.stranded_before.saturating_add(lost);
        self.stranded_now.iter_mut().for_each(|s| *s = 0);
    }

    /// Records the last log index of every live node (called before any node can crash, so an
    /// entry a node appended is seen before the node goes down).
    pub fn observe_logs(&mut self, last_indexes: impl IntoIterator<Item = u64>) {
        self.log_high = last_indexes.into_iter().fold(self.log_high, u64::max);
    }

    /// Records the stranded tokens the most advanced ledger `l` counts for every key (the
    /// counts only grow within a generation; a lagging ledger's smaller count is ignored).
    pub fn read_stranded(&mut self, keys: &[Key], l: &Ledger) {
        for (i, k) in keys.iter().enumerate() {
            let pk = PolicyKey {
                domain: k.domain.clone(),
                entries: k.entries.clone(),
            };
            if let Ok(s) = l.status(&pk, l.last_ms()) {
                let stranded = s
                    .regions
                    .iter()
                    .map(|r| r.stranded)
                    .fold(0, u64::saturating_add);
                self.stranded_now[i] = self.stranded_now[i].max(stranded);
            }
        }
    }

    /// Tokens stranded so far over every key and cluster generation, µtokens.
    pub fn stranded(&self) -> Micros {
        self.stranded_now
            .iter()
            .fold(self.stranded_before, |a, s| a.saturating_add(*s))
    }

    /// Checks one live node's ledger at `now_ns`: its own invariants, no spend claimed beyond a
    /// grant, and every allocation's grant facts equal to what any node showed before (an id
    /// never names two grants; a committed grant never changes across leader changes); epochs
    /// of a key never go back as ids grow.
    pub fn observe_ledger(&mut self, now_ns: u64, node: &str, l: &Ledger) {
        self.invariant_checks += 1;
        if let Err(e) = l.check_invariants() {
            self.violation(now_ns, "ledger-invariants", format!("{node}: {e}"));
        }
        let v = l.violations();
        if v.count > 0 {
            self.violation(
                now_ns,
                "spend-beyond-grant",
                format!(
                    "{node}: {} reports claimed {} µtokens beyond their grants",
                    v.count, v.excess
                ),
            );
        }
        let g = self.generation;
        for a in l.allocations() {
            let facts = Granted {
                holder: a.holder.to_string(),
                rule_id: a.rule_id.to_string(),
                key: a.key.to_vec(),
                region: a.region.to_string(),
                epoch: a.epoch,
                issued_at_ms: a.issued_at_ms,
            };
            match self.granted.get(&(g, a.id)) {
                Some(known) if *known != facts => {
                    let detail =
                        format!("{node}: allocation {} was {known:?}, now {facts:?}", a.id);
                    self.violation(now_ns, "allocation-id-reused", detail);
                }
                Some(_) => {}
                None => {
                    self.check_epoch(now_ns, g, a.id, &facts);
                    self.granted.insert((g, a.id), facts);
                }
            }
        }
    }

    fn check_epoch(&mut self, now_ns: u64, g: u32, id: u64, f: &Granted) {
        let ids = self
            .epochs
            .entry((g, f.rule_id.clone(), f.key.clone(), f.region.clone()))
            .or_default();
        let before = ids.range(..id).next_back().map(|(i, e)| (*i, *e));
        let after = ids.range(id + 1..).next().map(|(i, e)| (*i, *e));
        ids.insert(id, f.epoch);
        if let Some((i, e)) = before.filter(|(_, e)| *e > f.epoch) {
            let detail = format!(
                "allocation {id} has epoch {} below allocation {i}'s {e}",
                f.epoch
            );
            self.violation(now_ns, "epoch-went-back", detail);
        }
        if let Some((i, e)) = after.filter(|(_, e)| *e < f.epoch) {
            let detail = format!(
                "allocation {i} has epoch {e} below allocation {id}'s {}",
                f.epoch
            );
            self.violation(now_ns, "epoch-went-back", detail);
        }
    }

    /// Checks what agent `agent` (named `holder`) holds at `now_ns` (its clock reads
    /// `agent_now`) against the most advanced ledger `l` and the index of the last entry it
    /// applied: every grant it holds is one the ledger made to it (not lost, not another's),
    /// nothing reported exceeds what it spent, and no allocation is spent after its local
    /// deadline.
    ///
    /// A grant is lost only if a ledger that applied every entry that can hold it does not know
    /// it. A committed entry is only late on the surviving nodes when the leader crashes
    /// before they learn it committed: they apply it once a new leader commits an entry of its
    /// term, an election later (`allot-sim --seed 863`: 1.75 s, openraft's leader lease plus
    /// election timeout).
    pub fn observe_agent(
        &mut self,
        now_ns: u64,
        agent: usize,
        holder: &str,
        agent_now: u64,
        held: &[HeldView],
        l: Option<(&Ledger, u64)>,
    ) {
        let g = self.generation;
        let mut found: Vec<(&'static str, String)> = Vec::new();
        if now_ns != self.unreported_at {
            self.unreported_at = now_ns;
            self.unreported_sum = 0;
        }
        // The agent's clock less true time (drift aside), to place a state loss on it.
        let offset = i128::from(agent_now) - i128::from(now_ns);
        let last_loss = self.losses.last().map(|(at, _)| i128::from(*at) + offset);
        let life = i128::from(self.lease_life_ns);
        for h in held {
            // Sent before the last loss (its deadline is less than a lease life after it):
            // possibly granted by the lost cluster, whose ids the new one reuses.
            let before_loss = last_loss.is_some_and(|l| i128::from(h.deadline) - life < l);
            let generation = if before_loss { g.saturating_sub(1) } else { g };
            let entry = self.held.entry((agent, h.id, h.deadline)).or_insert(Held {
                generation,
                epoch: h.epoch,
                base: h.base,
                spent_at_deadline: None,
                unknown_since: None,
                log_bound: self.log_high,
            });
            if agent_now >= h.deadline {
                match entry.spent_at_deadline {
                    None => entry.spent_at_deadline = Some(h.spent),
                    Some(s) if h.spent > s => {
                        let detail = format!(
                            "{holder}: allocation {} spent {} µtokens after its local deadline",
                            h.id,
                            h.spent - s
                        );
                        entry.spent_at_deadline = Some(h.spent);
                        found.push(("spent-after-deadline", detail));
                    }
                    Some(_) => {}
                }
            }
            let (Some((l, applied)), true) = (l, entry.generation == g) else {
                continue;
            };
            match l.allocation(h.id) {
                None if agent_now < h.deadline && applied >= entry.log_bound => {
                    let since = *entry.unknown_since.get_or_insert(now_ns);
                    if now_ns - since >= LOST_AFTER_NS {
                        entry.unknown_since = Some(now_ns);
                        let detail = format!(
                            "{holder} holds allocation {} the ledger does not know",
                            h.id
                        );
                        found.push(("grant-lost", detail));
                    }
                }
                None => {}
                Some(a) => {
                    entry.unknown_since = None;
                    if matches!(a.state, AllocationState::Live) {
                        let unreported = h.spent.saturating_sub(a.reported);
                        self.unreported_sum = self.unreported_sum.saturating_add(unreported);
                    }
                    if a.holder != holder || a.epoch != entry.epoch || a.base != entry.base {
                        let detail = format!(
                            "{holder} holds allocation {} (epoch {}, base {} µtokens), the ledger's is \
                             {}'s (epoch {}, base {})",
                            h.id, entry.epoch, entry.base, a.holder, a.epoch, a.base
                        );
                        found.push(("grant-duplicated", detail));
                    } else if !matches!(a.state, AllocationState::Live)
                        && !h.closed
                        && agent_now < h.deadline
                    {
                        let detail = format!(
                            "allocation {} ended ({:?}) while {holder} still spends it (spent {})",
                            h.id, a.state, h.spent
                        );
                        found.push(("ended-behind-holder", detail));
                    } else if a.reported > h.spent {
                        let detail = format!(
                            "allocation {}: the ledger recorded {} µtokens, {holder} spent {}",
                            h.id, a.reported, h.spent
                        );
                        found.push(("stale-report-accepted", detail));
                    }
                }
            }
        }
        self.max_unreported = self.max_unreported.max(self.unreported_sum);
        for (kind, detail) in found {
            self.violation(now_ns, kind, detail);
        }
    }

    /// Records the bound and calendar quota the most advanced ledger `l` reports for every key
    /// at `now_ns` (in ledger time `l.last_ms()`).
    pub fn sample_bounds(&mut self, now_ns: u64, keys: &[Key], l: &Ledger) {
        for (i, k) in keys.iter().enumerate() {
            let pk = PolicyKey {
                domain: k.domain.clone(),
                entries: k.entries.clone(),
            };
            let (bound, calendar_remaining) = match l.status(&pk, l.last_ms()) {
                Ok(s) => {
                    let stranded = s.regions.iter().map(|r| r.stranded);
                    let stranded = stranded.fold(0, u64::saturating_add);
                    self.stranded_now[i] = self.stranded_now[i].max(stranded);
                    (
                        s.regions
                            .iter()
                            .map(|r| r.overshoot_bound)
                            .fold(0, u64::saturating_add),
                        s.calendar_remaining,
                    )
                }
                // No state for the key: nothing granted, nothing spent.
                Err(_) => (0, None),
            };
            self.max_bound = self.max_bound.max(bound);
            self.max_bound_by_key[i] = self.max_bound_by_key[i].max(bound);
            self.samples[i].push(Sample {
                at_ns: now_ns,
                bound,
                calendar_remaining,
            });
        }
    }

    /// Checks every window [t₁, t₂) of `records` (answers of the run) for key `k` against
    /// B + r·(t₂ − t₁) + bound(t₁), and the calendar quota against remaining(t₁) + bound(t₁).
    /// Across a state loss the recreated bucket and quota start full (one B, one quota more)
    /// and the allocations live just before stay spendable (their bound) until they die.
    /// Returns the worst overshoot over B + r·Δ as a fraction of the bound, in ppm (0: none).
    ///
    /// An admission takes effect somewhere between its send and its answer (a leased spend at
    /// the answer, after any wait for a grant; a central decision when the allocator applies
    /// it), so a window counts the admissions surely inside it: sent at or after t₁, answered
    /// by t₂. (Counted at its send time, a request that waited for a grant stamped after it
    /// was sent looked like an overdraw: `allot-sim --seed 484`.)
    pub fn check_bounds(&mut self, k: usize, c: Contract, records: &[&Record]) -> u64 {
        // (sent, answered, cost) in the order of answers.
        let mut admitted: Vec<(u64, u64, Micros)> = records
            .iter()
            .filter(|r| r.answer == RequestAnswer::Admitted)
            .map(|r| {
                let cost = u64::from(r.cost) * MICROS_PER_TOKEN;
                (r.sent_ns, r.answered_ns.max(r.sent_ns), cost)
            })
            .collect();
        admitted.sort_by_key(|&(sent, answered, _)| (answered, sent));
        let samples = std::mem::take(&mut self.samples[k]);
        let mut worst_ppm = 0u64;
        for s in &samples {
            let (carry, losses_after) = self.loss_terms(k, s.at_ns, c);
            let mut total: u128 = 0;
            let first = admitted.partition_point(|&(_, answered, _)| answered < s.at_ns);
            let inside = admitted[first..]
                .iter()
                .filter(|&&(sent, ..)| sent >= s.at_ns);
            for &(_, t, cost) in inside.clone() {
                total += u128::from(cost);
                let dt = u128::from(t - s.at_ns);
                let refill = u128::from(c.rate_per_s) * dt / u128::from(NANOS_PER_SEC);
                let spans = losses_after.iter().filter(|at| **at <= t).count() as u128;
                let allowed = u128::from(c.burst) * (1 + spans)
                    + refill
                    + u128::from(s.bound)
                    + u128::from(carry);
                let over_contract =
                    total.saturating_sub(u128::from(c.burst) * (1 + spans) + refill);
                let bound = u128::from(s.bound) + u128::from(carry);
                if over_contract > 0 {
                    let ppm = over_contract * 1_000_000 / bound.max(1);
                    worst_ppm = worst_ppm.max(u64::try_from(ppm).unwrap_or(u64::MAX));
                }
                if total > allowed {
                    let detail = format!(
                        "key {k}: {total} µtokens admitted in [{}ms, {}ms], allowed {allowed} \
                         (B {} + r·Δ {refill} + bound {bound})",
                        s.at_ns / NS_PER_MS,
                        t / NS_PER_MS,
                        c.burst
                    );
                    self.violation(t, "admitted-beyond-bound", detail);
                    break;
                }
            }
            if let (Some(quota), Some(left)) = (c.quota, s.calendar_remaining) {
                let after: u128 = inside.map(|&(.., cost)| u128::from(cost)).sum();
                let fresh = u128::from(quota) * losses_after.len() as u128;
                let allowed = u128::from(left) + u128::from(s.bound) + u128::from(carry) + fresh;
                if after > allowed {
                    let detail = format!(
                        "key {k}: {after} µtokens admitted after {}ms, calendar remaining {left} \
                         + bound {}",
                        s.at_ns / NS_PER_MS,
                        s.bound
                    );
                    self.violation(s.at_ns, "calendar-beyond-bound", detail);
                }
            }
        }
        self.samples[k] = samples;
        worst_ppm
    }

    /// For a window starting at `t1`: the bound carried from a state loss whose old allocations
    /// may still be spent at t1, and the times of the losses after t1.
    fn loss_terms(&self, k: usize, t1: u64, c: Contract) -> (Micros, Vec<u64>) {
        let life = c.lease_life_ms * NS_PER_MS;
        let mut carry = 0u64;
        let mut after = Vec::new();
        for (at, before) in &self.losses {
            if *at >= t1 {
                // Its old allocations live at t₁ are in bound(t₁) already; a loss at t₁ itself
                // was sampled from the old ledger just before (its fresh bucket and quota come
                // after the sample).
                after.push(*at);
            } else if *at < t1 && t1 < at + life {
                // (A sample at the loss's instant was read from the old ledger: its bound
                // already counts them.)
                carry = carry.saturating_add(before[k]);
            }
        }
        (carry, after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arrivals::Record;

    const T: Micros = MICROS_PER_TOKEN;
    const C: Contract = Contract {
        burst: 40 * T,
        rate_per_s: 10 * T,
        quota: Some(100 * T),
        lease_life_ms: 2_250,
    };

    fn admitted(sent_ms: u64, cost: u32) -> Record {
        answered(sent_ms, sent_ms, cost)
    }

    fn answered(sent_ms: u64, answered_ms: u64, cost: u32) -> Record {
        Record {
            sent_ns: sent_ms * NS_PER_MS,
            agent: 0,
            key: 0,
            cost,
            answer: RequestAnswer::Admitted,
            latency_us: (answered_ms - sent_ms) * 1_000,
            answered_ns: answered_ms * NS_PER_MS,
        }
    }

    fn checker_with_bound(bound: Micros, left: Micros) -> Checker {
        let mut c = Checker::new(1);
        c.samples[0].push(Sample {
            at_ns: 0,
            bound,
            calendar_remaining: Some(left),
        });
        c
    }

    #[test]
    fn admissions_beyond_burst_rate_and_bound_are_caught_and_within_are_not() {
        // B 40 + bound 8 at once, then 10/s: 48 tokens at t = 0 and 10 more by 1 s pass.
        let within = [admitted(0, 48), admitted(1_000, 10)];
        let mut c = checker_with_bound(8 * T, 100 * T);
        let ppm = c.check_bounds(0, C, &within.iter().collect::<Vec<_>>());
        assert!(c.violations.is_empty(), "{:?}", c.violations);
        assert_eq!(ppm, 1_000_000, "the whole bound was used");
        // One token more than the refill allows by 999 ms.
        let beyond = [admitted(0, 48), admitted(999, 10)];
        let mut c = checker_with_bound(8 * T, 100 * T);
        c.check_bounds(0, C, &beyond.iter().collect::<Vec<_>>());
        assert_eq!(c.violations.len(), 1);
        assert_eq!(c.violations[0].kind, "admitted-beyond-bound");
    }

    #[test]
    fn an_admission_counts_from_its_answer_and_only_in_windows_it_was_sent_in() {
        // Seed 484's shape: B 40 at t = 0, 10/s; the last token's request waits for a grant
        // the ledger can make only at 1 s (40 + 10 tokens produced by then).
        let mut c = checker_with_bound(0, 100 * T);
        let waited = [admitted(0, 40), admitted(900, 9), answered(997, 1_080, 1)];
        c.check_bounds(0, C, &waited.iter().collect::<Vec<_>>());
        assert!(c.violations.is_empty(), "{:?}", c.violations);
        // Answered within its window and still over B + r·Δ: caught at its answer.
        let mut c = checker_with_bound(0, 100 * T);
        let over = [admitted(0, 40), admitted(900, 9), answered(997, 999, 2)];
        c.check_bounds(0, C, &over.iter().collect::<Vec<_>>());
        assert_eq!(c.violations.len(), 1, "{:?}", c.violations);
        assert_eq!(c.violations[0].at_ns, 999 * NS_PER_MS);
        // Sent before a sample and answered after it: not counted in the window from it (it
        // may have taken effect before), only in the windows from earlier samples.
        let mut c = checker_with_bound(100 * T, 100 * T);
        c.samples[0].push(Sample {
            at_ns: 500 * NS_PER_MS,
            bound: 0,
            calendar_remaining: None,
        });
        let across = [answered(400, 600, 40), admitted(600, 40)];
        c.check_bounds(0, C, &across.iter().collect::<Vec<_>>());
        assert!(c.violations.is_empty(), "{:?}", c.violations);
    }

    #[test]
    fn the_calendar_quota_plus_the_bound_is_the_most_admitted_after_a_sample() {
        let rs = [admitted(0, 10), admitted(5_000, 10), admitted(10_000, 3)];
        let mut c = checker_with_bound(2 * T, 20 * T);
        c.check_bounds(0, C, &rs.iter().collect::<Vec<_>>());
        assert_eq!(c.violations.len(), 1, "{:?}", c.violations);
        assert_eq!(c.violations[0].kind, "calendar-beyond-bound");
    }

    #[test]
    fn a_state_loss_allows_a_fresh_bucket_and_carries_the_bound_before_it() {
        let mut c = checker_with_bound(0, 100 * T);
        c.samples[0].push(Sample {
            at_ns: 1_000 * NS_PER_MS,
            bound: 8 * T,
            calendar_remaining: None,
        });
        c.state_lost(1_000 * NS_PER_MS);
        // 40 spent before the loss, then the old 8 and a fresh 40 right after it.
        let rs = [admitted(0, 40), admitted(1_000, 48)];
        c.check_bounds(0, C, &rs.iter().collect::<Vec<_>>());
        assert!(c.violations.is_empty(), "{:?}", c.violations);
    }

    #[test]
    fn a_grant_is_lost_only_once_the_ledger_applied_past_its_entry() {
        // Seed 863's shape: the leader answered a grant whose entry (index ≤ 571) the survivors
        // hold but have not applied; nothing is lost while they wait for a new leader.
        let held = HeldView {
            id: 183,
            epoch: 183,
            granted: 2 * T,
            base: 2 * T,
            spent: 2 * T,
            deadline: u64::MAX,
            closed: false,
        };
        let empty = Ledger::default();
        let mut c = Checker::new(1);
        c.observe_logs([571, 568]);
        for ms in (0..=2_000).step_by(10) {
            c.observe_agent(ms * NS_PER_MS, 0, "g4", 0, &[held], Some((&empty, 570)));
        }
        assert!(c.violations.is_empty(), "{:?}", c.violations);
        // Applied past every entry that can hold it and still unknown: lost.
        for ms in (2_010..=3_010).step_by(10) {
            c.observe_agent(ms * NS_PER_MS, 0, "g4", 0, &[held], Some((&empty, 572)));
        }
        assert_eq!(c.violations.len(), 1, "{:?}", c.violations);
        assert_eq!(c.violations[0].kind, "grant-lost");
    }

    #[test]
    fn spending_after_the_local_deadline_is_caught() {
        let mut c = Checker::new(1);
        let held = |spent| HeldView {
            id: 7,
            epoch: 1,
            granted: 8 * T,
            base: 8 * T,
            spent,
            deadline: 100,
            closed: false,
        };
        c.observe_agent(0, 0, "g1", 50, &[held(T)], None);
        c.observe_agent(1, 0, "g1", 100, &[held(2 * T)], None);
        assert!(c.violations.is_empty());
        c.observe_agent(2, 0, "g1", 150, &[held(3 * T)], None);
        assert_eq!(c.violations.len(), 1);
        assert_eq!(c.violations[0].kind, "spent-after-deadline");
    }
}
