//! Report and Release (seed §22–24): cumulative spend is max-merged and clamped to the grant;
//! a stale id or epoch is refused and changes nothing; unspent tokens return to the buckets only
//! at release, when the final spend is known, and never above capacity.

use super::calendar::period_bounds;
use super::{Allocation, AllocationState, Ledger, LedgerError, Response};
use allot_common::config::RuleLimit;
use allot_common::units::millis_to_nanos;

impl Ledger {
    /// The live allocation `id` at `epoch`, or why not.
    fn fenced(&self, id: u64, epoch: u64) -> Result<&Allocation, LedgerError> {
        let a = self
            .allocations
            .get(&id)
            .ok_or_else(|| LedgerError::NotFound(format!("no allocation {id}")))?;
        if a.epoch != epoch {
            return Err(LedgerError::FailedPrecondition(format!(
                "allocation {id} has epoch {}, not {epoch}: stale",
                a.epoch
            )));
        }
        Ok(a)
    }

    /// Records a claimed spend: returns the clamped value and counts a violation when the claim
    /// exceeds the grant.
    fn clamp_spend(&mut self, a: &Allocation, claimed: u64) -> u64 {
        if claimed > a.granted {
            self.violations.count += 1;
            self.violations.excess = self.violations.excess.saturating_add(claimed - a.granted);
            tracing::warn!(
                allocation = a.id,
                holder = %a.holder,
                granted = a.granted,
                claimed,
                "spend reported beyond the grant; clamped"
            );
        }
        claimed.min(a.granted).max(a.reported)
    }

    pub(super) fn report(&mut self, id: u64, epoch: u64, spend: u64) -> Response {
        let a = match self.fenced(id, epoch) {
            Ok(a) => a.clone(),
            Err(e) => return Response::Rejected(e),
        };
        if a.state != AllocationState::Live {
            return Response::Rejected(LedgerError::FailedPrecondition(format!(
                "allocation {id} is {}: no longer reportable",
                state_name(a.state)
            )));
        }
        let recorded = self.clamp_spend(&a, spend);
        let delta = recorded - a.reported;
        if let Some(x) = self.allocations.get_mut(&id) {
            x.reported = recorded;
        }
        if let Some(r) = self
            .keys
            .get_mut(&(a.rule_id.clone(), a.key.clone()))
            .and_then(|k| k.regions.get_mut(&a.region))
        {
            r.reported_live += delta;
        }
        Response::Reported {
            recorded,
            expires_at_ms: a.expires_at_ms,
        }
    }

    pub(super) fn release(&mut self, id: u64, epoch: u64, final_spend: u64, now: u64) -> Response {
        let a = match self.fenced(id, epoch) {
            Ok(a) => a.clone(),
            Err(e) => return Response::Rejected(e),
        };
        match a.state {
            AllocationState::Live => {}
            // A retried release gets the same answer.
            AllocationState::Released { returned }
                if a.granted - returned == final_spend.min(a.granted).max(a.reported) =>
            {
                return Response::Released { returned };
            }
            other => {
                return Response::Rejected(LedgerError::FailedPrecondition(format!(
                    "allocation {id} is {}: no longer releasable",
                    state_name(other)
                )))
            }
        }
        let spent = self.clamp_spend(&a, final_spend);
        let returned = a.granted - spent;
        let now_ns = millis_to_nanos(now);
        let issued_ns = millis_to_nanos(a.issued_at_ms);
        let quota = self
            .parsed
            .values()
            .flat_map(|d| d.rules.iter())
            .find(|r| r.id == a.rule_id)
            .and_then(|r| match r.limit {
                RuleLimit::Limited { .. } => r.quota,
                RuleLimit::Unlimited => None,
            });
        if let Some(ks) = self.keys.get_mut(&(a.rule_id.clone(), a.key.clone())) {
            let gp = ks.global.params;
            gp.refund(&mut ks.global.state, now_ns, returned, issued_ns);
            if let Some(b) = ks
                .regions
                .get_mut(&a.region)
                .and_then(|r| r.bucket.as_mut())
            {
                let p = b.params;
                p.refund(&mut b.state, now_ns, returned, issued_ns);
            }
            if let (Some(q), Some((start, used))) = (quota, ks.calendar.as_mut()) {
                // Only while the period the grant was charged to is still current.
                if period_bounds(q.period, a.issued_at_ms).0 == *start {
                    *used = used.saturating_sub(returned);
                }
            }
            if let Some(r) = ks.regions.get_mut(&a.region) {
                r.reported_live += spent - a.reported;
            }
        }
        let mut done = a.clone();
        done.reported = spent;
        done.state = AllocationState::Released { returned };
        self.allocations.insert(id, done.clone());
        self.deadlines.remove(&(a.dead_at_ms, id));
        self.finish(&done, 0, now);
        Response::Released { returned }
    }
}

fn state_name(s: AllocationState) -> &'static str {
    match s {
        AllocationState::Live => "live",
        AllocationState::Released { .. } => "released",
        AllocationState::Expired => "expired",
    }
}
