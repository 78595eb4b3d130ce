//! Giving back unused cost of an admitted request (design §10 "Refunds": reserve the maximum,
//! settle the actual). The one home of refunds: [`Limiter::refund`](super::Limiter::refund) loads
//! the current snapshot and comes here.

use super::{Snapshot, SnapshotDomain};
use crate::config::{RuleLimit, Scope};
use crate::descriptor::{Entry, Request, RequestError};
use crate::global::{GlobalKey, GlobalLimits};
use crate::units::{Micros, Nanos};

impl Snapshot {
    /// Gives back unused cost with this config version, for a caller that decided with
    /// [`decide_with`](Self::decide_with) on it: `unused[i]` microtokens to descriptor `i`'s limit,
    /// which was spent at `spent_at` (design §10 "Refunds"). A bucket never rises above capacity; a
    /// window gets them back only while it is current. Leased descriptors are refunded through
    /// `global` when given; unmatched, unlimited and missing (0) entries are skipped.
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
        let dom = self.domain_of(req)?;
        for (i, d) in req.descriptors.iter().enumerate() {
            let micros = unused.get(i).copied().unwrap_or(0);
            if micros == 0 {
                continue;
            }
            let Some(ri) = dom.config.match_entries(d.entries) else {
                continue;
            };
            let rule = &dom.config.rules[ri];
            match global {
                Some(g) if rule.scope == Scope::Global => {
                    if matches!(rule.limit, RuleLimit::Limited { .. }) {
                        let key = GlobalKey {
                            domain: req.domain,
                            rule,
                            rule_index: ri as u32,
                            entries: d.entries,
                        };
                        g.refund(key, micros, now);
                    }
                }
                _ => self.refund_local(dom, ri, d.entries, micros, spent_at, now),
            }
        }
        Ok(())
    }

    /// Gives `micros` back to the local key `entries` of rule `ri` (a no-op for an unlimited
    /// rule, a full key table, or a slot evicted meanwhile: its state is gone).
    fn refund_local(
        &self,
        dom: &SnapshotDomain,
        ri: usize,
        entries: &[Entry<'_>],
        micros: Micros,
        spent_at: Nanos,
        now: Nanos,
    ) {
        let RuleLimit::Limited { params, .. } = dom.config.rules[ri].limit else {
            return;
        };
        let table = &dom.tables[ri];
        let hash = table.hash(entries);
        if let Ok(slot) = table.slot(entries, hash, &params, self.version, now) {
            let mut g = slot.value.lock();
            if !g.evicted {
                let p = g.params;
                p.refund(&mut g.state, now, micros, spent_at);
            }
        }
    }
}
