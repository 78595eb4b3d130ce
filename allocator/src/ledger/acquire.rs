//! Acquire: grant = min(want, max grant, fair part, region headroom, bucket tokens, calendar
//! remainder), debited from every one of them at grant time (design §3). The sources and what
//! they hold are [`super::sources`]'s.

use super::division::{sooner, Demand};
use super::fair_share::fair_part;
use super::rates::{promise, rated_retry_ms, RateAsk};
use super::sources::{
    available, charge_calendar, check_id, debit, wait_for, Available, Draw, OverCapacity, Prepared,
};
use super::{
    Acquire, Allocation, AllocationState, ChargedTo, Denial, Grant, Ledger, LedgerError, Response,
};
use allot_common::algorithm::LimitParams;
use allot_common::decision::RetryAfter;
use allot_common::units::{
    millis_to_nanos, nanos_to_millis_ceil, nanos_to_millis_floor, MAX_TOKENS, MICROS_PER_TOKEN,
};

impl Ledger {
    pub(super) fn acquire(&mut self, a: &Acquire, now: u64) -> Response {
        if let Some(r) = self.recall(&a.holder, &a.request_id, "an Acquire", |r| {
            matches!(r, Response::Granted(_) | Response::Denied(_))
        }) {
            return r;
        }
        let r = match self.try_acquire(a, now) {
            Ok(r) => r,
            Err(e) => return Response::Rejected(e),
        };
        self.remember(&a.holder, &a.request_id, now, &r);
        r
    }

    fn try_acquire(&mut self, a: &Acquire, now: u64) -> Result<Response, LedgerError> {
        check_id("region", &a.region)?;
        check_id("holder", &a.holder)?;
        check_id("request_id", &a.request_id)?;
        if a.want == 0 || a.want > MAX_TOKENS * MICROS_PER_TOKEN {
            return Err(LedgerError::BadInput {
                field: "want".into(),
                reason: format!(
                    "must be from 1 to {} microtokens, got {}",
                    MAX_TOKENS * MICROS_PER_TOKEN,
                    a.want
                ),
            });
        }
        let demand = Demand {
            holder: &a.holder,
            want: a.want,
            demand_per_s: a.demand_per_s,
            allocates: true,
        };
        let t = self.prepare(&a.key, &a.region, &demand, now)?;
        let r = self.grant(a, &demand, &t, now);
        self.reindex_key(&t.kid, now);
        r
    }

    /// The grant or denial for `a` of the key `prepare` readied as `t`, phase by phase: end the
    /// holder's earlier accrual, refuse what cannot be granted at all, size the base and the
    /// rate, then deny or record the allocation.
    fn grant(
        &mut self,
        a: &Acquire,
        demand: &Demand<'_>,
        t: &Prepared,
        now: u64,
    ) -> Result<Response, LedgerError> {
        // Granted or denied, this Acquire ends the accrual of the holder's earlier rates for
        // the key (the holder froze them before sending it; design §9).
        self.supersede(&t.kid, &a.region, &a.holder, now);
        if let Some(refusal) = self.refuse_outright(a, t, now) {
            return Ok(refusal);
        }
        let base = self.size_base(a, demand, t, now)?;
        let expires = lease_end(t, now);
        let rate = self.size_rate(a, demand, t, &base, expires.saturating_sub(now));
        if base.grant == 0 && (rate.ppm == 0 || rate.per_s < a.want_rate_per_s) {
            self.note_denied(&t.kid, &a.region, &a.holder, now);
        }
        if base.grant == 0 && rate.ppm == 0 {
            return self.denied(t, a, &base.avail, now);
        }
        self.record_grant(a, t, &base, &rate, expires, now)
    }

    /// The denial of an Acquire that nothing can be granted to whatever the buckets hold: the
    /// region has no part of the key, or a window ends within the drift margin.
    fn refuse_outright(&mut self, a: &Acquire, t: &Prepared, now: u64) -> Option<Response> {
        let (rule, version) = (&t.rule, t.version);
        if let Some((retry_after_ms, reason)) = t.no_part(&a.region) {
            self.note_denied(&t.kid, &a.region, &a.holder, now);
            return Some(Response::Denied(Denial {
                retry_after_ms,
                reason,
                policy_version: version,
                handoff_ms: 0,
            }));
        }
        let left_ms = window_left_ms(&t.params, millis_to_nanos(now))?;
        // A window's allocation ends with its window, and an agent stops spending one drift
        // margin before the end: a grant this close to the end would arrive unusable while its
        // tokens stayed charged for the rest of the window.
        (left_ms <= rule.lease.max_drift_ms).then(|| {
            Response::Denied(Denial {
                retry_after_ms: left_ms.max(1),
                reason: format!(
                    "the window of {} ends in {left_ms} ms, within the {} ms drift margin",
                    rule.name, rule.lease.max_drift_ms
                ),
                policy_version: version,
                handoff_ms: 0,
            })
        })
    }

    /// The base of the grant: min(want, max grant, fair part, pool) in whole tokens, from what
    /// each source holds now (refilling the buckets to `now`).
    fn size_base(
        &mut self,
        a: &Acquire,
        demand: &Demand<'_>,
        t: &Prepared,
        now: u64,
    ) -> Result<BaseSize, LedgerError> {
        let (rule, kid) = (&t.rule, &t.kid);
        let (part, lend) = self.draw_for(t, now);
        let ks = self.key_mut(kid)?;
        let draw = Draw {
            part,
            lend: lend.as_ref(),
        };
        let avail = available(ks, &a.region, rule, now, draw);
        // The live totals must stay representable: grants are capped by what they can still
        // count (reachable only at extreme policies, e.g. 10¹² tokens/s with 60 s leases).
        let totals_room = u64::MAX
            - ks.regions
                .get(a.region.as_str())
                .map_or(0, |r| r.granted_live);
        let pool = avail.pool().min(totals_room);

        // Divide the pool fairly among the holders asking in this region recently.
        let (wants, me) = self.holder_wants(kid, &a.region, demand, rule.lease.ttl_ms, now);
        let fair = fair_part(pool, &wants, me);
        let grant = whole_tokens(
            a.want.min(rule.lease.max_grant).min(fair).min(pool),
            a.want,
            rule.lease.max_grant,
            pool,
        );
        Ok(BaseSize {
            avail,
            totals_room,
            grant,
        })
    }

    /// The rate the grant carries (design §9), or none when it could not accrue one whole token
    /// over the lease of `duration_ms`: a holder spending whole tokens would only ask again.
    fn size_rate(
        &self,
        a: &Acquire,
        demand: &Demand<'_>,
        t: &Prepared,
        base: &BaseSize,
        duration_ms: u64,
    ) -> RateSize {
        let ask = RateAsk {
            demand,
            want_per_s: a.want_rate_per_s,
            part: t.ppm,
            duration_ms,
            // The promise is charged to the calendar quota at grant: it must fit what is left.
            room: base
                .totals_room
                .min(base.avail.calendar)
                .saturating_sub(base.grant),
        };
        let ppm = self.rate_part(&t.kid, &a.region, &t.rule, &t.params, &ask);
        let per_s = t.params.refill_rate().part_per_s(ppm);
        let promised = promise(per_s, duration_ms);
        if per_s == 0 || promised < MICROS_PER_TOKEN {
            RateSize::NONE
        } else {
            RateSize {
                ppm,
                per_s,
                promised,
            }
        }
    }

    /// Debits every source for the grant, counts it in the key's and region's live totals and
    /// records the allocation, ending at `expires` (Unix ms).
    fn record_grant(
        &mut self,
        a: &Acquire,
        t: &Prepared,
        base: &BaseSize,
        rate: &RateSize,
        expires: u64,
        now: u64,
    ) -> Result<Response, LedgerError> {
        let (rule, kid, grant) = (&t.rule, &t.kid, base.grant);
        // Ids are never reused, so the id is also the epoch: strictly increasing per policy,
        // region and holder with no per-holder table to keep (issue 10 item 1).
        self.next_id = self.next_id.saturating_add(1);
        let id = self.next_id;
        let epoch = id;
        let (region_name, holder) = (self.names.intern(&a.region), self.names.intern(&a.holder));
        let ks = self.key_mut(kid)?;
        // Debit every source now; unspent tokens come back only at release.
        debit(ks, &a.region, rule, &base.avail, now, grant);
        // The rate's promise comes from the refill as it accrues, but the calendar quota counts
        // it all now: the holder may spend every promised token before it reports.
        charge_calendar(ks, rule, base.avail.period_start, rate.promised);
        let region = ks.regions.entry_or_default(region_name.clone());
        let charged = ChargedTo {
            global: ks.global.params.kind(),
            region: region.bucket.as_ref().map(|b| b.params.kind()),
            calendar_period_start: rule.quota.map(|_| base.avail.period_start),
        };
        let dead_at = expires.saturating_add(rule.lease.max_drift_ms);
        region.live = region.live.saturating_add(1);
        // Cannot saturate: the grant and its promise are capped by `totals_room`.
        let total = grant.saturating_add(rate.promised);
        region.granted_live = region.granted_live.saturating_add(total);
        ks.live = ks.live.saturating_add(1);
        if !ks.parts.by_region.is_empty() {
            ks.parts.granted(&a.region);
        }
        if rate.ppm > 0 {
            region.rate_ppm_live = region.rate_ppm_live.saturating_add(u64::from(rate.ppm));
            region.rated.insert((holder.clone(), id));
        }
        let alloc = Allocation {
            id,
            rule_id: kid.0.clone(),
            key: kid.1.clone(),
            policy_version: t.version,
            shares_version: t.shares_version,
            region: region_name,
            holder,
            epoch,
            granted: total,
            base: grant,
            rate_ppm: rate.ppm,
            rate_per_s: rate.per_s,
            accrual_end_ms: expires,
            reported: 0,
            issued_at_ms: now,
            expires_at_ms: expires,
            dead_at_ms: dead_at,
            state: AllocationState::Live,
            charged,
        };
        self.allocations.insert(id, Box::new(alloc));
        self.deadlines.insert((dead_at, id));
        if rate.ppm > 0 {
            // From now on this rate's part of the refill flows to the holder.
            self.retune_rates(kid, &a.region, now);
        }
        Ok(Response::Granted(Grant {
            allocation_id: id,
            epoch,
            granted: grant,
            issued_at_ms: now,
            expires_at_ms: expires,
            policy_version: t.version,
            rate_per_s: rate.per_s,
            promised: rate.promised,
            incarnation: self.incarnation(),
        }))
    }

    /// The denial of an Acquire that could be granted nothing: what ran out (the calendar
    /// quota, the region's part or the bucket) and when asking again can succeed.
    fn denied(
        &mut self,
        t: &Prepared,
        a: &Acquire,
        avail: &Available,
        now: u64,
    ) -> Result<Response, LedgerError> {
        let (rule, params, version) = (&t.rule, t.params, t.version);
        let ttl = rule.lease.ttl_ms;
        let handoff = self.handoff_for(t, &a.region, now);
        let contenders = self.contenders(&t.kid, &a.region, &a.holder, rule, now);
        let ks = self.key_mut(&t.kid)?;
        let need = a
            .want
            .min(rule.lease.max_grant)
            .clamp(1, MICROS_PER_TOKEN.max(1));
        let need = need.min(params.capacity());
        // Under a flood the wait is for a token per hungry holder (`contenders`), never for a
        // full bucket (refill past it during the round trip would be lost); the calendar
        // check below stays with the one token this holder needs.
        let flood_need = need
            .saturating_mul(contenders)
            .min(params.capacity().saturating_sub(MICROS_PER_TOKEN))
            .max(need);
        let wait = wait_for(
            ks,
            &a.region,
            now,
            flood_need,
            OverCapacity::Clamp,
            t.borrows,
            avail,
        );
        let (reason, wait_ms) = if avail.calendar < need {
            (
                format!(
                    "calendar quota of {} is spent until {} (Unix ms)",
                    rule.name, avail.period_end
                ),
                avail.period_end.saturating_sub(now),
            )
        } else {
            let ms = match wait {
                RetryAfter::Now => 1,
                RetryAfter::After(ns) => nanos_to_millis_ceil(ns).max(1),
                RetryAfter::Never => ttl,
            };
            // While live rates take the refill the bucket fills slowly, but a rate frees up
            // within a lease (superseded, released or expired): ask again after a quarter
            // lease at the latest (design §9).
            let ms = rated_retry_ms(ks, ttl, ms);
            let what = if avail.region_is_tighter() {
                "region share"
            } else {
                "bucket"
            };
            (format!("{what} of {} is empty", rule.name), ms)
        };
        let calendar_spent = avail.calendar < need;
        Ok(Response::Denied(Denial {
            retry_after_ms: wait_ms,
            reason,
            policy_version: version,
            handoff_ms: sooner(handoff, wait_ms, calendar_spent),
        }))
    }
}

/// Milliseconds left (rounded down) in the current window of a fixed-window limit at `now_ns`;
/// `None` for other algorithms.
fn window_left_ms(params: &LimitParams, now_ns: u64) -> Option<u64> {
    let LimitParams::FixedWindow(w) = params else {
        return None;
    };
    let period = w.period_ns.max(1);
    let end_ns = (now_ns - now_ns % period).saturating_add(period);
    Some(nanos_to_millis_floor(end_ns) - nanos_to_millis_floor(now_ns))
}

/// The base of a grant and what it was sized from.
struct BaseSize {
    /// What each source held when the grant was sized.
    avail: Available,
    /// µtok the region's live totals can still count.
    totals_room: u64,
    /// µtok granted now (whole tokens, or 0).
    grant: u64,
}

/// The rate a grant carries: parts per million of the policy's rate, µtok/s, and the µtok it
/// promises over the lease. All 0 when it carries none.
struct RateSize {
    ppm: u32,
    per_s: u64,
    promised: u64,
}

impl RateSize {
    const NONE: Self = Self {
        ppm: 0,
        per_s: 0,
        promised: 0,
    };
}

/// When an allocation granted at `now` (Unix ms) ends: one lease later, and never after the
/// end of a fixed window.
fn lease_end(t: &Prepared, now: u64) -> u64 {
    let expires = now.saturating_add(t.rule.lease.ttl_ms);
    match window_left_ms(&t.params, millis_to_nanos(now)) {
        Some(left_ms) => expires.min(now.saturating_add(left_ms)),
        None => expires,
    }
}

/// `sized` (µtok) in whole tokens, as agents spend them (a fraction would sit unused).
///
/// Tokens are indivisible: when the fair part is below one whole token (the pool holds fewer
/// whole tokens than holders ask), the asker gets one whole token if the pool has it, as
/// max-min division of indivisible units gives some holders the part rounded up. Rounding it
/// down to nothing instead left the pool's last tokens to nobody for as long as the holders
/// kept asking, each denial saying "retry in 1 ms" (the bucket did hold the tokens): an
/// Acquire storm through Raft that admitted nothing. An ask below one token keeps its
/// fraction.
fn whole_tokens(sized: u64, want: u64, max_grant: u64, pool: u64) -> u64 {
    let one = MICROS_PER_TOKEN;
    let sized = if sized < one && want >= one && max_grant >= one && pool >= one {
        one
    } else {
        sized
    };
    if sized >= one {
        sized - sized % one
    } else if want >= one {
        0
    } else {
        sized
    }
}
