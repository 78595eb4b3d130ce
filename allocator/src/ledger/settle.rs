//! Report and Release (design §3, §4): cumulative spend is max-merged and clamped to the grant;
//! a stale id or epoch is refused and changes nothing; unspent tokens return to the buckets only
//! at release, when the final spend is known, never above capacity, and only into what the
//! grant was charged to.

use super::sources::refund_calendar;
use super::{Allocation, AllocationState, Ended, Ledger, LedgerError, Response};
use allot_common::units::millis_to_nanos;

impl Ledger {
    /// The allocation `id` at `epoch` held by `holder`, or why not. An id that was granted but
    /// is no longer remembered (ended and forgotten) answers "ended"; an id never granted
    /// answers "not found". Either answer is the same on every replica.
    fn fenced(&self, id: u64, epoch: u64, holder: &str) -> Result<&Allocation, LedgerError> {
        let Some(a) = self.allocations.get(&id) else {
            if id >= 1 && id <= self.next_id {
                return Err(LedgerError::AllocationEnded {
                    id,
                    how: Ended::Forgotten,
                });
            }
            return Err(LedgerError::UnknownAllocation { id });
        };
        if a.epoch != epoch {
            return Err(LedgerError::StaleEpoch {
                id,
                have: a.epoch,
                got: epoch,
            });
        }
        if a.holder != holder {
            return Err(LedgerError::NotHolder {
                id,
                holder: holder.to_string(),
            });
        }
        Ok(a)
    }

    /// Records a claimed spend: returns the clamped value and counts a violation when the claim
    /// exceeds the grant.
    fn clamp_spend(&mut self, a: &Allocation, claimed: u64) -> u64 {
        if claimed > a.granted {
            self.violations.count = self.violations.count.saturating_add(1);
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

    pub(super) fn report(&mut self, id: u64, epoch: u64, holder: &str, spend: u64) -> Response {
        let a = match self.fenced(id, epoch, holder) {
            Ok(a) => a.clone(),
            Err(e) => return Response::Rejected(e),
        };
        if let Some(how) = ended(a.state) {
            return Response::Rejected(LedgerError::AllocationEnded { id, how });
        }
        let recorded = self.clamp_spend(&a, spend);
        // clamp_spend keeps a.reported ≤ recorded ≤ granted, and reported_live ≤ granted_live
        // holds for the totals: neither can leave u64.
        let delta = recorded.saturating_sub(a.reported);
        if let Some(x) = self.allocations.get_mut(&id) {
            x.reported = recorded;
        }
        if let Some(r) = self
            .keys
            .get_mut(&(a.rule_id.clone(), a.key.clone()))
            .and_then(|k| k.regions.get_mut(&a.region))
        {
            r.reported_live = r.reported_live.saturating_add(delta);
        }
        Response::Reported {
            recorded,
            expires_at_ms: a.expires_at_ms,
        }
    }

    pub(super) fn release(
        &mut self,
        id: u64,
        epoch: u64,
        holder: &str,
        final_spend: u64,
        now: u64,
    ) -> Response {
        let a = match self.fenced(id, epoch, holder) {
            Ok(a) => a.clone(),
            Err(e) => return Response::Rejected(e),
        };
        match a.state {
            AllocationState::Live => {}
            // A retried release gets the same answer: its final spend was recorded as
            // `reported`.
            AllocationState::Released { returned } if final_spend.min(a.granted) <= a.reported => {
                return Response::Released { returned };
            }
            AllocationState::Released { .. } => {
                return Response::Rejected(LedgerError::AllocationEnded {
                    id,
                    how: Ended::Released,
                })
            }
            AllocationState::Expired => {
                return Response::Rejected(LedgerError::AllocationEnded {
                    id,
                    how: Ended::Expired,
                })
            }
        }
        let spent = self.clamp_spend(&a, final_spend);
        // What it was entitled to by now and did not spend: its base, and what its rate
        // accrued until now (the rest of the promise was never taken from the buckets: it
        // stops being diverted when the allocation ends, design §9).
        let returned = a.entitled_at(now).saturating_sub(spent);
        // The calendar quota was charged the whole grant, promise included: what was not spent
        // of it goes back there.
        let unspent = a.granted.saturating_sub(spent);
        self.refund(&a, returned, unspent, now);
        if let Some(r) = self
            .keys
            .get_mut(&(a.rule_id.clone(), a.key.clone()))
            .and_then(|k| k.regions.get_mut(&a.region))
        {
            r.reported_live = r
                .reported_live
                .saturating_add(spent.saturating_sub(a.reported));
        }
        let mut done = a.clone();
        done.reported = spent;
        done.state = AllocationState::Released { returned };
        self.allocations.insert(id, Box::new(done.clone()));
        self.deadlines.remove(&(a.dead_at_ms, id));
        self.finish(&done, 0, now);
        Response::Released { returned }
    }

    /// Returns `returned` unspent microtokens of `a` to the buckets its grant was charged to,
    /// only while they keep the algorithm family they had at grant, and `unspent` (its grant
    /// less its spend, the unaccrued promise included) to the calendar quota, only while the
    /// charged period is current. Tokens that cannot go back stay spent (the safe side:
    /// capacity refills, the bound never grows).
    fn refund(&mut self, a: &Allocation, returned: u64, unspent: u64, now: u64) {
        let now_ns = millis_to_nanos(now);
        let issued_ns = millis_to_nanos(a.issued_at_ms);
        let Some(ks) = self.keys.get_mut(&(a.rule_id.clone(), a.key.clone())) else {
            return;
        };
        let gp = ks.global.params;
        if gp.kind() == a.charged.global {
            gp.refund(&mut ks.global.state, now_ns, returned, issued_ns);
        }
        if let Some(b) = ks
            .regions
            .get_mut(&a.region)
            .and_then(|r| r.bucket.as_mut())
        {
            let p = b.params;
            if Some(p.kind()) == a.charged.region {
                p.refund(&mut b.state, now_ns, returned, issued_ns);
            }
        }
        refund_calendar(ks, a.charged.calendar_period_start, unspent);
    }
}

/// How an allocation in state `s` ended; `None` while it is live.
fn ended(s: AllocationState) -> Option<Ended> {
    match s {
        AllocationState::Live => None,
        AllocationState::Released { .. } => Some(Ended::Released),
        AllocationState::Expired => Some(Ended::Expired),
    }
}
