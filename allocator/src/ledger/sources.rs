//! The sources a grant (Acquire, design §3) or a central decision (Decide, design §2) draws from:
//! the policy key's global bucket, the region's part of it when the policy has regional shares,
//! and the calendar quota. One home for resolving a request to its limit and key state, for
//! "what is available from each source", for debiting all of them at once and for "when can
//! `need` fit", so that leases and central decisions can never disagree on the quota.

use super::calendar::period_bounds;
use super::division::Demand;
use super::rates::{diverted, key_rate_ppm, region_params};
use super::{Bucket, KeyId, KeyState, Ledger, LedgerError, Name, PolicyKey};
use allot_common::algorithm::LimitParams;
use allot_common::config::{Rule, RuleLimit, Scope, SharesMode};
use allot_common::decision::RetryAfter;
use allot_common::units::{millis_to_nanos, Micros};
use std::collections::BTreeMap;

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
    /// Whether the region may borrow beyond its part what the other regions do not keep
    /// (`shares_mode: weighted` with regional shares; design §5 "Borrowing").
    pub borrows: bool,
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
        if self.borrows {
            // Weighted: while its part comes by handoff, it borrows what others do not keep.
            return None;
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
    /// What the region may take: its own part's bucket, or in weighted mode more, borrowed
    /// from the global bucket beyond what the other regions keep (`u64::MAX` without regional
    /// shares).
    pub region: Micros,
    /// The region's own bucket (0 while its part is 0, `u64::MAX` without regional shares): a
    /// debit takes from it first, and only what exceeds it is borrowed.
    pub own_region: Micros,
    /// What the other regions keep from the global bucket for their own demand, microtokens
    /// (0 unless the region borrows).
    pub kept: Micros,
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
        let kid = self.shared_key(kid, &rule, params, now)?;
        self.record_ask(&kid, region, demand, &rule, now);
        self.rebalance_key(&kid, now);
        let region_name = self.names.intern(region);
        let ks = self.key_mut(&kid)?;
        let ppm = share.map(|_| ks.parts.effective(region));
        let shares_version = ks.parts.version;
        if retune_buckets(ks, region_name, params, ppm, activated_ns, now_ns) {
            self.index.region_added();
        }
        let borrows = share.is_some() && rule.shares_mode == SharesMode::Weighted;
        Ok(Prepared {
            rule,
            kid,
            version,
            params,
            ppm,
            share,
            shares_version,
            borrows,
        })
    }

    /// The key id of `kid` as the key table holds it, so every table that names the key shares
    /// its rule id and bytes; a new key's state is created first (making room at the cap).
    ///
    /// # Errors
    /// [`LedgerError::TableFull`] from [`Ledger::make_room`]; nothing changes then.
    fn shared_key(
        &mut self,
        kid: KeyId,
        rule: &Rule,
        params: LimitParams,
        now: u64,
    ) -> Result<KeyId, LedgerError> {
        if let Some((shared, _)) = self.keys.get_key_value(&kid) {
            return Ok(shared.clone());
        }
        self.make_room(rule, now)?;
        let kid = (self.names.intern(&kid.0), kid.1);
        self.insert_key(kid.clone(), KeyState::new(params, now));
        Ok(kid)
    }

    /// The state of a key that [`Ledger::prepare`] readied.
    ///
    /// # Errors
    /// [`LedgerError::NoKeyState`] when the key has no state (never after `prepare`).
    pub(super) fn key_mut(&mut self, kid: &KeyId) -> Result<&mut KeyState, LedgerError> {
        self.keys
            .get_mut(kid)
            .map(|ks| &mut **ks)
            .ok_or_else(|| LedgerError::NoKeyState {
                policy: kid.0.to_string(),
            })
    }
}

/// Brings the key's buckets to the policy in force: the global bucket to `params` less the live
/// rates' part of the refill (it flows to their holders, design §9) as of the policy's
/// activation, and the region's bucket to its part `ppm` (created when the region has a part
/// but no bucket yet). Returns whether `region` is new to the key.
fn retune_buckets(
    ks: &mut KeyState,
    region: Name,
    params: LimitParams,
    ppm: Option<u32>,
    activated_ns: u64,
    now_ns: u64,
) -> bool {
    ks.undiverted = params;
    let diverted_params = diverted(params, key_rate_ppm(ks));
    retune(&mut ks.global, diverted_params, activated_ns);
    let new_region = !ks.regions.contains_key(region.as_str());
    let part = ks.regions.entry_or_default(region);
    let region_rates = part.rate_ppm_live;
    match (
        ppm.and_then(|p| region_params(params, p, region_rates)),
        &mut part.bucket,
    ) {
        (Some(rp), Some(b)) => retune(b, rp, now_ns),
        (Some(rp), slot @ None) => {
            *slot = Some(Box::new(Bucket {
                params: rp,
                state: rp.initial_state(now_ns),
            }))
        }
        _ => {}
    }
    new_region
}

/// How a region draws on a key (see [`available`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Draw<'a> {
    /// The region's part now, ppm (`None` without regional shares).
    pub part: Option<u32>,
    /// In weighted mode, the most each region keeps of its own bucket when another borrows
    /// ([`Ledger::region_keeps`]: all of it while it is busy, nothing once idle); `None` in cap
    /// mode.
    pub lend: Option<&'a BTreeMap<String, Micros>>,
}

impl Ledger {
    /// How a region draws on the key `t`: its part, and in weighted mode what each region
    /// keeps when another borrows ([`Ledger::region_keeps`]).
    pub(super) fn draw_for(
        &self,
        t: &Prepared,
        now: u64,
    ) -> (Option<u32>, Option<BTreeMap<String, Micros>>) {
        let lend = t.borrows.then(|| self.region_keeps(&t.kid, &t.rule, now));
        (t.ppm, lend)
    }
}

/// Level of a region's own bucket at `now_ns`: 0 while its part is 0 (a bucket left from a
/// larger part is not drawn on), `u64::MAX` when there is none (no regional shares).
fn own_level(ks: &mut KeyState, region: &str, part: Option<u32>, now_ns: u64) -> Micros {
    if part == Some(0) {
        return 0;
    }
    match ks.regions.get_mut(region).and_then(|r| r.bucket.as_mut()) {
        Some(b) => b.params.check(&mut b.state, now_ns, 0).remaining_micros,
        None if part.is_some() => 0,
        None => u64::MAX,
    }
}

/// What the regions other than `region` keep of the global bucket at `now_ns`: each busy one
/// keeps what its own bucket holds, at most its entry in `lend`; an idle region keeps nothing.
/// Tokens of idle regions' parts may be borrowed (design §5 "Borrowing").
fn kept_by_others(
    ks: &mut KeyState,
    region: &str,
    lend: &BTreeMap<String, Micros>,
    now_ns: u64,
) -> Micros {
    let mut kept: Micros = 0;
    for (name, r) in ks.regions.iter_mut() {
        if name == region {
            continue;
        }
        let (Some(b), Some(&want)) = (r.bucket.as_mut(), lend.get(name.as_str())) else {
            continue;
        };
        let level = b.params.check(&mut b.state, now_ns, 0).remaining_micros;
        kept = kept.saturating_add(level.min(want));
    }
    kept
}

/// What each source of `ks` holds for `region` at `now` (Unix ms), refilling the buckets. In
/// weighted mode (`draw.lend`) the region may take the larger of its own bucket and what the
/// global bucket holds beyond what the other regions keep: a region's part is its guarantee,
/// not a cap on tokens no one else is asking for. Every grant still debits the global bucket,
/// so the contract holds whatever is borrowed.
pub(super) fn available(
    ks: &mut KeyState,
    region: &str,
    rule: &Rule,
    now: u64,
    draw: Draw<'_>,
) -> Available {
    let now_ns = millis_to_nanos(now);
    let g = &mut ks.global;
    let global = g.params.check(&mut g.state, now_ns, 0).remaining_micros;
    let own_region = own_level(ks, region, draw.part, now_ns);
    let (region, kept) = match draw.lend {
        Some(lend) if draw.part.is_some() => {
            let kept = kept_by_others(ks, region, lend, now_ns);
            (own_region.max(global.saturating_sub(kept)), kept)
        }
        _ => (own_region, 0),
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
        own_region,
        kept,
        calendar,
        period_start,
        period_end,
    }
}

/// Debits `amount` microtokens from every source of `ks` for `region` at `now` (Unix ms): the
/// region's own bucket gives what it holds of it (the rest is borrowed, see [`available`]).
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
    let own = amount.min(at.own_region);
    if own > 0 {
        if let Some(b) = ks.regions.get_mut(region).and_then(|r| r.bucket.as_mut()) {
            let p = b.params;
            p.spend(&mut b.state, now_ns, own);
        }
    }
    charge_calendar(ks, rule, at.period_start, amount);
}

/// Charges `amount` microtokens to the calendar quota's period starting at `period_start` (Unix
/// ms), when the rule has a quota. A rate-carrying allocation is charged its whole promise at
/// grant, as its base is: the holder may spend all of it before the calendar hears again.
pub(super) fn charge_calendar(ks: &mut KeyState, rule: &Rule, period_start: u64, amount: Micros) {
    if rule.quota.is_some() {
        let used = match ks.calendar {
            Some((s, u)) if s == period_start => u,
            _ => 0,
        };
        ks.calendar = Some((period_start, used.saturating_add(amount)));
    }
}

/// Gives `amount` microtokens back to the calendar quota, only while the period a grant was
/// charged to (`charged`, its start in Unix ms) is still current; `None` (no quota) does nothing.
pub(super) fn refund_calendar(ks: &mut KeyState, charged: Option<u64>, amount: Micros) {
    if let (Some(charged), Some((start, used))) = (charged, ks.calendar.as_mut()) {
        if charged == *start {
            *used = used.saturating_sub(amount);
        }
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
/// the decision core's exact refill (design §10 "Algorithms"). A region that borrows (`at.kept`
/// known, weighted mode) can also be served once the global bucket holds `need` beyond what the
/// others keep, whichever of that and its own bucket comes first; such a region never waits
/// "forever" on its own part. The calendar quota is the caller's: its wait is the period's end.
pub(super) fn wait_for(
    ks: &mut KeyState,
    region: &str,
    now: u64,
    need: Micros,
    over: OverCapacity,
    borrows: bool,
    at: &Available,
) -> RetryAfter {
    let now_ns = millis_to_nanos(now);
    let fit = |n: Micros, cap: Micros| match over {
        OverCapacity::Clamp => n.min(cap),
        OverCapacity::Never => n,
    };
    let g = &mut ks.global;
    let cap = g.params.capacity();
    let global = g
        .params
        .check(&mut g.state, now_ns, fit(need, cap))
        .retry_after;
    let borrowed = borrows.then(|| {
        let n = need.saturating_add(at.kept).min(cap);
        g.params.check(&mut g.state, now_ns, n).retry_after
    });
    let own = match ks.regions.get_mut(region).and_then(|r| r.bucket.as_mut()) {
        // A region with no part has no bucket of its own to wait for.
        Some(_) if borrows && at.own_region == 0 => None,
        Some(b) => {
            let cap = b.params.capacity();
            Some(
                b.params
                    .check(&mut b.state, now_ns, fit(need, cap))
                    .retry_after,
            )
        }
        None => None,
    };
    let region_wait = match (own, borrowed) {
        (Some(o), Some(b)) => o.min(b),
        (Some(o), None) => o,
        (None, Some(b)) => b,
        (None, None) => RetryAfter::Now,
    };
    global.max(region_wait)
}
