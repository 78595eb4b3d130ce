//! The sources a grant (Acquire, design §3) or a central decision (Decide, design §2) draws from:
//! the policy key's global bucket, the region's part of it when the policy has regional shares,
//! and the calendar quota. One home for resolving a request to its limit and key state, for
//! "what is available from each source", for debiting all of them at once and for "when can
//! `need` fit", so that leases and central decisions can never disagree on the quota.

use super::calendar::period_bounds;
use super::division::Demand;
use super::rates::{diverted, key_rate_ppm, region_params};
use super::{Bucket, KeyId, KeyState, Ledger, LedgerError, PolicyKey};
use allot_common::algorithm::LimitParams;
use allot_common::config::{Rule, RuleLimit, Scope};
use allot_common::decision::RetryAfter;
use allot_common::units::{millis_to_nanos, Micros};

/// Longest region, holder or request id, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// Refuses an empty id or one longer than [`MAX_ID_BYTES`].
pub(super) fn check_id(what: &str, v: &str) -> Result<(), LedgerError> {
    if v.is_empty() || v.len() > MAX_ID_BYTES {
        return Err(LedgerError::BadInput {
            field: what.to_string(),
            reason: format!("must be 1 to {MAX_ID_BYTES} bytes, got {}", v.len()),
        });
    }
    Ok(())
}

/// Brings a bucket to `params` at time `at` when its parameters changed (design §10 "Config
/// versions").
pub(super) fn retune(b: &mut Bucket, params: LimitParams, at_ns: u64) {
    if b.params != params {
        let st = std::mem::replace(&mut b.state, params.initial_state(at_ns));
        b.state = params.transition_from(&b.params, st, at_ns);
        b.params = params;
    }
}

/// A request resolved to its limit, with the key's state ready (created and retuned).
pub(super) struct Prepared {
    /// The rule the key matched.
    pub rule: Rule,
    /// (rule id, canonical key).
    pub kid: KeyId,
    /// Policy document version.
    pub version: u64,
    /// The rule's global parameters.
    pub params: LimitParams,
    /// The region's part of the key now (see `division`), ppm; `None` when the policy has no
    /// regional shares.
    pub ppm: Option<u32>,
    /// The region's configured share (its guarantee and weight, or its cap), ppm; `None` when
    /// the policy has no regional shares.
    pub share: Option<u32>,
    /// The key's handoff version (see `handoff`): new allocations are counted under it.
    pub shares_version: u64,
}

impl Prepared {
    /// Why the region has no part now and when to ask again: a share of 0 is final (ask again
    /// after a lease); a part waiting for a handoff frees up when older allocations of other
    /// regions end (ask again after a quarter lease). `None` when the region has a part.
    pub fn no_part(&self, region: &str) -> Option<(u64, String)> {
        if self.ppm != Some(0) {
            return None;
        }
        let rule = &self.rule;
        if self.share == Some(0) {
            return Some((
                rule.lease.ttl_ms,
                format!("region {region:?} has no share of {}", rule.name),
            ));
        }
        Some((
            (rule.lease.ttl_ms / 4).max(1),
            format!(
                "region {region:?}'s part of {} is being handed over from other regions",
                rule.name
            ),
        ))
    }
}

/// What each source holds at one instant, microtokens (`u64::MAX` for an absent source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Available {
    /// The key's global bucket.
    pub global: Micros,
    /// The region's part (`u64::MAX` without regional shares).
    pub region: Micros,
    /// What is left of the calendar quota's current period (`u64::MAX` without a quota).
    pub calendar: Micros,
    /// Start of the calendar period, Unix ms (0 without a quota).
    pub period_start: u64,
    /// End of the calendar period, Unix ms (`u64::MAX` without a quota).
    pub period_end: u64,
}

impl Available {
    /// What can be taken from every source at once: the smallest of them.
    pub fn pool(&self) -> Micros {
        self.global.min(self.region).min(self.calendar)
    }

    /// Whether the region's part, not the global bucket, is what runs short.
    pub fn region_is_tighter(&self) -> bool {
        self.region < self.global
    }
}

impl Ledger {
    /// Resolves `key` for a holder in `region` and readies its state at `now` (Unix ms): the
    /// key's state is created (evicting idle keys at the cap), `demand` is recorded as the
    /// holder's latest ask, the key is re-divided among its regions (`division`) and its buckets
    /// are retuned to the policy in force and the region's part.
    ///
    /// # Errors
    /// [`LedgerError::BadInput`] for a malformed key, [`LedgerError::Unlimited`] for an
    /// unlimited limit, [`LedgerError::UnknownDomain`], [`LedgerError::NoMatchingLimit`] or
    /// [`LedgerError::UnknownRegion`] for an unknown domain, rule or region,
    /// [`LedgerError::ScopeLocal`] for a limit with scope local, [`LedgerError::TableFull`] when
    /// the key cap is reached with no idle key, or the key's regions or the region's holders are
    /// at their cap (`tables`); nothing changes then.
    pub(super) fn prepare(
        &mut self,
        key: &PolicyKey,
        region: &str,
        demand: &Demand<'_>,
        now: u64,
    ) -> Result<Prepared, LedgerError> {
        let (rule, kid, version) = self.resolve(key)?;
        let rule: Rule = rule.clone();
        let RuleLimit::Limited { params, .. } = rule.limit else {
            return Err(LedgerError::Unlimited { policy: rule.name });
        };
        if rule.scope == Scope::Local {
            return Err(LedgerError::ScopeLocal { policy: rule.name });
        }
        let share = self.region_share(&rule.id, region)?;
        let activated_ns = millis_to_nanos(self.activated_at(&key.domain));
        let now_ns = millis_to_nanos(now);
        let who = (region, demand.holder);
        if let Some(e) = self.table_full(&kid, &rule, who, demand.allocates, now) {
            if let LedgerError::TableFull { table, .. } = &e {
                self.stats.refused(super::tables::kind_of(table));
            }
            return Err(e);
        }
        if !self.keys.contains_key(&kid) {
            self.make_room(&rule, now)?;
            self.insert_key(kid.clone(), KeyState::new(params, now));
        }
        self.record_ask(&kid, region, demand, &rule, now);
        self.rebalance_key(&kid, now);
        let ks = self.key_mut(&kid)?;
        let ppm = share.map(|_| ks.parts.effective(region));
        let shares_version = ks.parts.version;
        if retune_buckets(ks, region, params, ppm, activated_ns, now_ns) {
            self.index.region_added();
        }
        Ok(Prepared {
            rule,
            kid,
            version,
            params,
            ppm,
            share,
            shares_version,
        })
    }

    /// The state of a key that [`Ledger::prepare`] readied.
    ///
    /// # Errors
    /// [`LedgerError::NoKeyState`] when the key has no state (never after `prepare`).
    pub(super) fn key_mut(&mut self, kid: &KeyId) -> Result<&mut KeyState, LedgerError> {
        self.keys
            .get_mut(kid)
            .ok_or_else(|| LedgerError::NoKeyState {
                policy: kid.0.clone(),
            })
    }
}

/// Brings the key's buckets to the policy in force: the global bucket to `params` less the live
/// rates' part of the refill (it flows to their holders, design §9) as of the policy's
/// activation, and the region's bucket to its part `ppm` (created when the region has a part
/// but no bucket yet). Returns whether `region` is new to the key.
fn retune_buckets(
    ks: &mut KeyState,
    region: &str,
    params: LimitParams,
    ppm: Option<u32>,
    activated_ns: u64,
    now_ns: u64,
) -> bool {
    ks.undiverted = params;
    let diverted_params = diverted(params, key_rate_ppm(ks));
    retune(&mut ks.global, diverted_params, activated_ns);
    let new_region = !ks.regions.contains_key(region);
    let part = ks.regions.entry(region.to_string()).or_default();
    let region_rates = part.rate_ppm_live;
    match (
        ppm.and_then(|p| region_params(params, p, region_rates)),
        &mut part.bucket,
    ) {
        (Some(rp), Some(b)) => retune(b, rp, now_ns),
        (Some(rp), slot @ None) => {
            *slot = Some(Bucket {
                params: rp,
                state: rp.initial_state(now_ns),
            })
        }
        _ => {}
    }
    new_region
}

/// What each source of `ks` holds for `region` at `now` (Unix ms), refilling the buckets.
pub(super) fn available(ks: &mut KeyState, region: &str, rule: &Rule, now: u64) -> Available {
    let now_ns = millis_to_nanos(now);
    let g = &mut ks.global;
    let global = g.params.check(&mut g.state, now_ns, 0).remaining_micros;
    let region = match ks.regions.get_mut(region).and_then(|r| r.bucket.as_mut()) {
        Some(b) => b.params.check(&mut b.state, now_ns, 0).remaining_micros,
        None => u64::MAX,
    };
    let (period_start, period_end, calendar) = match rule.quota {
        Some(q) => {
            let (start, end) = period_bounds(q.period, now);
            let used = match ks.calendar {
                Some((s, u)) if s == start => u,
                _ => 0,
            };
            (start, end, q.limit.saturating_sub(used))
        }
        None => (0, u64::MAX, u64::MAX),
    };
    Available {
        global,
        region,
        calendar,
        period_start,
        period_end,
    }
}

/// Debits `amount` microtokens from every source of `ks` for `region` at `now` (Unix ms).
/// The caller checked that `amount ≤ at.pool()`.
pub(super) fn debit(
    ks: &mut KeyState,
    region: &str,
    rule: &Rule,
    at: &Available,
    now: u64,
    amount: Micros,
) {
    debug_assert!(amount <= at.pool(), "debit {amount} above the pool");
    let now_ns = millis_to_nanos(now);
    let gp = ks.global.params;
    gp.spend(&mut ks.global.state, now_ns, amount);
    if let Some(b) = ks.regions.get_mut(region).and_then(|r| r.bucket.as_mut()) {
        let p = b.params;
        p.spend(&mut b.state, now_ns, amount);
    }
    if rule.quota.is_some() {
        let used = match ks.calendar {
            Some((s, u)) if s == at.period_start => u,
            _ => 0,
        };
        ks.calendar = Some((at.period_start, used.saturating_add(amount)));
    }
}

/// What to do with a need above a bucket's capacity when computing a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OverCapacity {
    /// Wait for a full bucket instead (a grant can be smaller than what was asked).
    Clamp,
    /// Answer [`RetryAfter::Never`] (a decision is all or nothing).
    Never,
}

/// When `need` microtokens fit into both buckets of `ks` for `region` (the later of the two), from
/// the decision core's exact refill (design §10 "Algorithms"). The calendar quota is the caller's:
/// its wait is the period's end.
pub(super) fn wait_for(
    ks: &mut KeyState,
    region: &str,
    now: u64,
    need: Micros,
    over: OverCapacity,
) -> RetryAfter {
    let now_ns = millis_to_nanos(now);
    let fit = |cap: Micros| match over {
        OverCapacity::Clamp => need.min(cap),
        OverCapacity::Never => need,
    };
    let g = &mut ks.global;
    let cap = g.params.capacity();
    let mut wait = g.params.check(&mut g.state, now_ns, fit(cap)).retry_after;
    if let Some(b) = ks.regions.get_mut(region).and_then(|r| r.bucket.as_mut()) {
        let cap = b.params.capacity();
        wait = wait.max(b.params.check(&mut b.state, now_ns, fit(cap)).retry_after);
    }
    wait
}
