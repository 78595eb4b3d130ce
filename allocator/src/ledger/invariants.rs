//! The ledger's invariants as code (the list in the module docs of [`super`]), checked after
//! every applied command in debug builds and after every step of the ledger tests.
//!
//! The check costs O(live allocations + keys × regions + shares + remembered answers): it never
//! walks ended allocations one by one, so it stays cheap however long the ledger has run.

use super::rates::{diverted, key_rate_ppm, promise, MAX_RATE_PPM};
use super::tables::KeyIndex;
use super::{Allocation, AllocationState, KeyBytes, KeyState, Ledger, Name, RegionKeyState};
use allot_common::config::PPM;
use std::collections::BTreeMap;

/// A broken ledger invariant: a bug in the ledger, never a consequence of bad input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ledger invariant broken: {0}")]
pub struct InvariantError(pub String);

/// Σ over live allocations of one (rule id, key, region): count, granted, reported, and the
/// rate (ppm) of those still accruing.
type LiveSums = BTreeMap<(Name, KeyBytes, Name), (u64, u128, u128, u64, usize)>;

fn broken(msg: String) -> Result<(), InvariantError> {
    Err(InvariantError(msg))
}

impl Ledger {
    /// Checks every invariant of the ledger:
    /// * every live allocation has `reported ≤ granted`, an id ≤ `next_id`, an epoch equal to its
    ///   id (epochs come from the never-reused id space, so they strictly increase per policy,
    ///   region and holder), and exactly one deadline entry; every deadline names a live one;
    /// * ended allocations are indexed for forgetting, and no more are kept than the cap;
    /// * per policy key and region, the live count, `granted_live` and `reported_live` equal the
    ///   sums over its live allocations, and `reported_live ≤ granted_live`; a key's live count
    ///   is the sum of its regions';
    /// * per policy Σ configured shares ≤ 100 %, and per key Σ regional parts held (effective
    ///   or reserved) ≤ 100 %;
    /// * the idempotency cache and its time index hold as many entries (that they hold the
    ///   same ones is [`Ledger::check_answer_index`], O(n log n), which tests call);
    /// * the key index (keys per rule, evictable keys by idle time, region and ask counts) is
    ///   exactly the one built from the keys, and a key is filed as evictable exactly when it
    ///   has no live allocation.
    ///
    /// # Errors
    /// [`InvariantError`] naming the first invariant found broken.
    pub fn check_invariants(&self) -> Result<(), InvariantError> {
        let sums = self.check_live_allocations()?;
        self.check_key_totals(&sums)?;
        self.check_share_invariants()?;
        self.check_tables()?;
        self.check_calendar()?;
        self.check_answer_count()
    }

    fn check_answer_count(&self) -> Result<(), InvariantError> {
        if self.requests.len() != self.request_times.len() {
            return broken(format!(
                "{} remembered answers but {} in the time index",
                self.requests.len(),
                self.request_times.len()
            ));
        }
        Ok(())
    }

    /// Checks that the time index of remembered answers is exactly their (time, holder,
    /// request id), which a snapshot's copy rebuilds it from ([`Ledger::completed`]).
    /// O(n log n) in the answers, so not part of [`Ledger::check_invariants`], which runs
    /// after every apply in debug builds; tests call it.
    ///
    /// # Errors
    /// [`InvariantError`] naming the first entry found without its answer.
    pub fn check_answer_index(&self) -> Result<(), InvariantError> {
        self.check_answer_count()?;
        for (at, holder, id) in self.request_times.iter() {
            let remembered = self.requests.get(&(holder.clone(), id.clone()));
            if remembered.map(|answer| answer.0) != Some(*at) {
                return broken(format!(
                    "time index entry ({at}, {holder}, {id}) is not a remembered answer's"
                ));
            }
        }
        Ok(())
    }

    fn check_live_allocations(&self) -> Result<LiveSums, InvariantError> {
        let mut sums: LiveSums = BTreeMap::new();
        for &(dead_at, id) in &self.deadlines {
            let Some(a) = self.allocations.get(&id) else {
                return Err(InvariantError(format!(
                    "deadline of unknown allocation {id}"
                )));
            };
            if a.state != AllocationState::Live || a.dead_at_ms != dead_at {
                return Err(InvariantError(format!(
                    "deadline ({dead_at}, {id}) does not match allocation {a:?}"
                )));
            }
            if a.reported > a.granted || a.id > self.next_id || a.epoch != a.id {
                return Err(InvariantError(format!(
                    "live allocation out of bounds: {a:?}"
                )));
            }
            check_promise(a)?;
            let e = sums
                .entry((a.rule_id.clone(), a.key.clone(), a.region.clone()))
                .or_default();
            e.0 += 1;
            e.1 += u128::from(a.granted);
            e.2 += u128::from(a.reported);
            e.3 += u64::from(a.rate_ppm);
            e.4 += usize::from(a.rate_ppm > 0);
        }
        let ended = self.allocations.len() - self.deadlines.len().min(self.allocations.len());
        if self.deadlines.len() > self.allocations.len() || ended != self.ended.len() {
            return Err(InvariantError(format!(
                "{} allocations, {} live by deadline, {} indexed as ended",
                self.allocations.len(),
                self.deadlines.len(),
                self.ended.len()
            )));
        }
        if self.ended.len() > super::MAX_ENDED_KEPT {
            return Err(InvariantError(format!(
                "{} ended allocations kept, more than {}",
                self.ended.len(),
                super::MAX_ENDED_KEPT
            )));
        }
        Ok(sums)
    }

    /// Every live allocation charged to a key's current calendar period is counted in that
    /// period's use in full, its rate's promise included (a holder may spend all of it before
    /// it reports): Σ granted ≤ used.
    fn check_calendar(&self) -> Result<(), InvariantError> {
        let mut charged: BTreeMap<(&Name, &KeyBytes), u128> = BTreeMap::new();
        for (_, id) in &self.deadlines {
            let Some(a) = self.allocations.get(id) else {
                continue;
            };
            let Some(start) = a.charged.calendar_period_start else {
                continue;
            };
            let current = self
                .keys
                .get(&(a.rule_id.clone(), a.key.clone()))
                .and_then(|ks| ks.calendar)
                .is_some_and(|(s, _)| s == start);
            if current {
                *charged.entry((&a.rule_id, &a.key)).or_default() += u128::from(a.granted);
            }
        }
        for ((rule, key), sum) in charged {
            let used = self
                .keys
                .get(&(rule.clone(), key.clone()))
                .and_then(|ks| ks.calendar)
                .map_or(0, |(_, u)| u);
            if sum > u128::from(used) {
                return broken(format!(
                    "{rule}: live allocations charged {sum} µtok to the calendar period, which \
                     counts only {used}"
                ));
            }
        }
        Ok(())
    }

    fn check_key_totals(&self, sums: &LiveSums) -> Result<(), InvariantError> {
        let mut seen = 0usize;
        for ((rule, key), ks) in &self.keys {
            let mut key_live = 0u64;
            for (name, r) in &ks.regions {
                let (n, g, rep, rate, accruing) = sums
                    .get(&(rule.clone(), key.clone(), name.clone()))
                    .copied()
                    .unwrap_or_default();
                self.check_region_rates(rule, name, r, (rate, accruing))?;
                if n > 0 {
                    seen += 1;
                }
                if (
                    r.live,
                    u128::from(r.granted_live),
                    u128::from(r.reported_live),
                ) != (n, g, rep)
                {
                    return broken(format!(
                        "{rule} region {name}: totals (live {}, granted {}, reported {}) differ \
                         from the sums over live allocations ({n}, {g}, {rep})",
                        r.live, r.granted_live, r.reported_live
                    ));
                }
                if r.reported_live > r.granted_live {
                    return broken(format!("{rule} region {name}: reported > granted"));
                }
                key_live = key_live.saturating_add(r.live);
            }
            if ks.live != key_live {
                return broken(format!(
                    "{rule}: key live {} ≠ Σ regions {key_live}",
                    ks.live
                ));
            }
            check_key_rates(rule, ks)?;
        }
        if seen != sums.len() {
            return broken("a live allocation has no policy key state".into());
        }
        Ok(())
    }

    fn check_tables(&self) -> Result<(), InvariantError> {
        for ((rule, _), ks) in &self.keys {
            if ks.idle_at_ms.is_some() == (ks.live > 0) {
                return broken(format!(
                    "{rule}: a key with {} live allocations has idle time {:?}",
                    ks.live, ks.idle_at_ms
                ));
            }
        }
        let asks = self.demands.values().map(|m| m.len() as u64).sum();
        if self.index != KeyIndex::of(&self.keys, asks) {
            return broken("the key index differs from the keys it indexes".into());
        }
        if !self.admin.consistent() {
            return broken("admin answers and their time queue differ".into());
        }
        Ok(())
    }

    /// The region's live rate sum is the sum over its accruing allocations, each of them
    /// indexed by holder, and every indexed one is live and accruing (design §9).
    fn check_region_rates(
        &self,
        rule: &str,
        name: &str,
        r: &RegionKeyState,
        (rate, accruing): (u64, usize),
    ) -> Result<(), InvariantError> {
        if r.rate_ppm_live != rate {
            return broken(format!(
                "{rule} region {name}: live rate {} ≠ Σ accruing allocations {rate}",
                r.rate_ppm_live
            ));
        }
        for (holder, id) in &r.rated {
            let ok = self.allocations.get(id).is_some_and(|a| {
                a.state == AllocationState::Live && a.rate_ppm > 0 && a.holder == *holder
            });
            if !ok {
                return broken(format!(
                    "{rule} region {name}: rated ({holder}, {id}) is not a live accruing allocation"
                ));
            }
        }
        if r.rated.len() != accruing {
            return broken(format!(
                "{rule} region {name}: {} indexed rates for {accruing} accruing allocations",
                r.rated.len()
            ));
        }
        Ok(())
    }

    fn check_share_invariants(&self) -> Result<(), InvariantError> {
        for ((rule, _), ks) in &self.keys {
            let held: u64 = ks
                .parts
                .by_region
                .values()
                .map(|p| u64::from(p.effective_ppm.max(p.reserved_ppm)))
                .sum();
            if held > u64::from(PPM) {
                return broken(format!(
                    "{rule}: regional parts hold {held} ppm, more than 100%"
                ));
            }
        }
        for (rule, ps) in &self.shares {
            let total: u64 = ps.regions.values().map(|s| u64::from(s.target_ppm)).sum();
            if total > u64::from(PPM) {
                return broken(format!(
                    "{rule}: shares add up to {total} ppm, more than 100%"
                ));
            }
        }
        Ok(())
    }
}

/// An allocation's `granted` is its base plus its rate's promise up to the accrual's end (never
/// below what was reported), and a rate that still accrues ends with the lease (design §9).
fn check_promise(a: &Allocation) -> Result<(), InvariantError> {
    let accrual = a.accrual_end_ms.saturating_sub(a.issued_at_ms);
    let expected = a
        .base
        .saturating_add(promise(a.rate_per_s, accrual))
        .max(a.reported);
    if a.granted != expected || a.base > a.granted {
        return broken(format!(
            "allocation {}: granted {} ≠ base {} + promise of {} µtok/s over {accrual} ms",
            a.id, a.granted, a.base, a.rate_per_s
        ));
    }
    if a.rate_ppm > 0 && (a.accrual_end_ms != a.expires_at_ms || a.rate_per_s == 0) {
        return broken(format!(
            "allocation {}: an accruing rate must end with its lease: {a:?}",
            a.id
        ));
    }
    Ok(())
}

/// Σ live rates of a key ≤ [`MAX_RATE_PPM`] (below the policy's rate), and its global bucket
/// refills at exactly what they leave of the policy's rate (design §9).
fn check_key_rates(rule: &str, ks: &KeyState) -> Result<(), InvariantError> {
    let total = key_rate_ppm(ks);
    if total > u64::from(MAX_RATE_PPM) {
        return broken(format!(
            "{rule}: live rates carry {total} ppm, more than {MAX_RATE_PPM}"
        ));
    }
    if ks.global.params != diverted(ks.undiverted, total) {
        return broken(format!(
            "{rule}: the global bucket refills at {:?}, not what {total} ppm of live rates leave \
             of {:?}",
            ks.global.params, ks.undiverted
        ));
    }
    Ok(())
}
