//! Acquire: grant = min(want, max grant, fair part, region headroom, bucket tokens, calendar
//! remainder), debited from every one of them at grant time (seed §21). The sources and what
//! they hold are [`super::sources`]'s.

use super::division::Demand;
use super::fair_share::fair_part;
use super::sources::{available, check_id, debit, wait_for, OverCapacity};
use super::{
    Acquire, Allocation, AllocationState, Denial, Grant, KeyState, Ledger, LedgerError,
    RegionKeyState, Response,
};
use allot_common::algorithm::LimitParams;
use allot_common::config::Rule;
use allot_common::decision::RetryAfter;
use allot_common::units::{millis_to_nanos, nanos_to_millis_ceil, MAX_TOKENS, MICROS_PER_TOKEN};

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
            return Err(LedgerError::InvalidArgument(format!(
                "want must be from 1 to {} microtokens, got {}",
                MAX_TOKENS * MICROS_PER_TOKEN,
                a.want
            )));
        }
        let demand = Demand {
            holder: &a.holder,
            want: a.want,
            demand_per_s: a.demand_per_s,
        };
        let t = self.prepare(&a.key, &a.region, &demand, now)?;
        let (rule, kid, version, params) = (&t.rule, &t.kid, t.version, t.params);
        let now_ns = millis_to_nanos(now);
        if let Some((retry_after_ms, reason)) = t.no_part(&a.region) {
            self.note_denied(kid, &a.region, &a.holder, now);
            return Ok(Response::Denied(Denial {
                retry_after_ms,
                reason,
                policy_version: version,
            }));
        }

        // What is available now, from each source.
        let avail = available(self.key_mut(kid)?, &a.region, rule, now);
        let pool = avail.pool();

        // Divide the pool fairly among the holders asking in this region recently.
        let ttl = rule.lease.ttl_ms;
        let (wants, me) = self.holder_wants(kid, &a.region, &demand, ttl, now);
        let fair = fair_part(pool, &wants, me);

        let mut grant = a.want.min(rule.lease.max_grant).min(fair).min(pool);
        // Tokens are indivisible: when the fair part is below one whole token (the pool holds
        // fewer whole tokens than holders ask), the asker gets one whole token if the pool has
        // it, as max-min division of indivisible units gives some holders the part rounded up.
        // Rounding it down to nothing instead left the pool's last tokens to nobody for as
        // long as the holders kept asking, each denial saying "retry in 1 ms" (the bucket did
        // hold the tokens): an Acquire storm through Raft that admitted nothing.
        if grant < MICROS_PER_TOKEN
            && a.want >= MICROS_PER_TOKEN
            && rule.lease.max_grant >= MICROS_PER_TOKEN
            && pool >= MICROS_PER_TOKEN
        {
            grant = MICROS_PER_TOKEN;
        }
        if grant >= MICROS_PER_TOKEN {
            // Agents spend whole tokens; a fraction would sit unused.
            grant -= grant % MICROS_PER_TOKEN;
        } else if a.want >= MICROS_PER_TOKEN {
            grant = 0;
        }
        if grant == 0 {
            self.note_denied(kid, &a.region, &a.holder, now);
        }
        let ks = self.key_mut(kid)?;
        if grant == 0 {
            let need = a
                .want
                .min(rule.lease.max_grant)
                .clamp(1, MICROS_PER_TOKEN.max(1));
            let need = need.min(params.capacity());
            let wait = wait_for(ks, &a.region, now, need, OverCapacity::Clamp);
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
                let what = if avail.region_is_tighter() {
                    "region share"
                } else {
                    "bucket"
                };
                (format!("{what} of {} is empty", rule.name), ms)
            };
            return Ok(Response::Denied(Denial {
                retry_after_ms: wait_ms,
                reason,
                policy_version: version,
            }));
        }

        // Debit every source now; unspent tokens come back only at release.
        debit(ks, &a.region, rule, &avail, now, grant);
        let mut expires = now.saturating_add(ttl);
        if let LimitParams::FixedWindow(w) = params {
            // A window's allocation never outlives its window.
            let end_ns = (now_ns - now_ns % w.period_ns).saturating_add(w.period_ns);
            expires = expires.min(end_ns / 1_000_000);
        }
        let dead_at = expires.saturating_add(rule.lease.max_drift_ms);
        ks.live += 1;
        let region = ks.regions.entry(a.region.clone()).or_default();
        region.live += 1;
        region.granted_live += grant;
        if !ks.parts.by_region.is_empty() {
            ks.parts.granted(&a.region);
        }

        self.next_id += 1;
        let id = self.next_id;
        let epoch_key = (rule.id.clone(), a.region.clone(), a.holder.clone());
        let epoch = self.epochs.get(&epoch_key).copied().unwrap_or(0) + 1;
        self.epochs.insert(epoch_key, epoch);
        let alloc = Allocation {
            id,
            rule_id: rule.id.clone(),
            key: kid.1.clone(),
            policy_version: version,
            shares_version: t.shares_version,
            region: a.region.clone(),
            holder: a.holder.clone(),
            epoch,
            granted: grant,
            reported: 0,
            issued_at_ms: now,
            expires_at_ms: expires,
            dead_at_ms: dead_at,
            state: AllocationState::Live,
        };
        self.allocations.insert(id, alloc);
        self.deadlines.insert((dead_at, id));
        Ok(Response::Granted(Grant {
            allocation_id: id,
            epoch,
            granted: grant,
            issued_at_ms: now,
            expires_at_ms: expires,
            policy_version: version,
        }))
    }

    /// Makes room for one more key of `rule`: evicts its idle keys (no live allocation, buckets
    /// full, calendar unused) when at the cap.
    pub(super) fn make_room(&mut self, rule: &Rule, now_ns: u64) -> Result<(), LedgerError> {
        let prefix = rule.id.clone();
        let count = self
            .keys
            .range((prefix.clone(), Vec::new())..)
            .take_while(|((r, _), _)| *r == prefix)
            .count() as u64;
        if count < rule.max_keys {
            return Ok(());
        }
        let idle: Vec<(String, Vec<u8>)> = self
            .keys
            .range((prefix.clone(), Vec::new())..)
            .take_while(|((r, _), _)| *r == prefix)
            .filter(|(_, ks)| is_idle(ks, now_ns))
            .map(|(k, _)| k.clone())
            .collect();
        if idle.is_empty() {
            return Err(LedgerError::ResourceExhausted(format!(
                "limit {} holds state for {} keys, none idle",
                rule.name, rule.max_keys
            )));
        }
        for k in idle {
            self.keys.remove(&k);
            let gone: Vec<_> = self
                .demands
                .range((k.clone(), String::new())..)
                .take_while(|((kk, _), _)| *kk == k)
                .map(|(d, _)| d.clone())
                .collect();
            for d in gone {
                self.demands.remove(&d);
            }
        }
        Ok(())
    }
}

fn is_idle(ks: &KeyState, now_ns: u64) -> bool {
    let region_idle = |r: &RegionKeyState| {
        r.live == 0
            && r.bucket
                .as_ref()
                .is_none_or(|b| b.params.is_idle(&b.state, now_ns))
    };
    ks.live == 0
        && ks.calendar.is_none_or(|(_, used)| used == 0)
        && ks.global.params.is_idle(&ks.global.state, now_ns)
        && ks.regions.values().all(region_idle)
}
