//! Where a part's false rejections went, per key: a key's *shortfall* is what the ideal central
//! counter admitted of it beyond what Allot admitted (whole tokens, 0 when Allot admitted as
//! much or more). Split by whether the ideal counter itself denied some of the key's requests
//! (a *limited* key, at or over its contract: the loss is in how its scarce tokens were
//! divided) or none (an *unlimited* key, under its contract: every denial of it is false).

use crate::arrivals::{Record, RequestAnswer};
use std::collections::HashMap;

/// Per key: (Allot admitted, ideal admitted, ideal denied), whole tokens.
#[derive(Debug, Default)]
pub(crate) struct Shortfall {
    keys: HashMap<usize, (u64, u64, u64)>,
}

impl Shortfall {
    /// Counts one record; `ideal_ok` is the ideal counter's answer to it.
    pub fn add(&mut self, r: &Record, ideal_ok: bool) {
        let t = self.keys.entry(r.key).or_default();
        let cost = u64::from(r.cost);
        if r.answer == RequestAnswer::Admitted {
            t.0 = t.0.saturating_add(cost);
        }
        if ideal_ok {
            t.1 = t.1.saturating_add(cost);
        } else {
            t.2 = t.2.saturating_add(cost);
        }
    }

    /// Σ shortfall over (limited keys, unlimited keys), tokens.
    pub fn by_kind(&self) -> (u64, u64) {
        self.keys
            .values()
            .fold((0, 0), |(l, u), &(allot, ideal, denied)| {
                let short = ideal.saturating_sub(allot);
                if denied > 0 {
                    (l.saturating_add(short), u)
                } else {
                    (l, u.saturating_add(short))
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(key: usize, cost: u32, admitted: bool) -> Record {
        Record {
            key,
            cost,
            answer: if admitted {
                RequestAnswer::Admitted
            } else {
                RequestAnswer::Denied
            },
            sent_ns: 0,
            agent: 0,
            latency_us: 0,
            answered_ns: 0,
        }
    }

    #[test]
    fn shortfall_is_split_by_whether_the_ideal_counter_limited_the_key() {
        let mut s = Shortfall::default();
        // Key 0, under its contract: ideal admits both, Allot one (cost 2 short).
        s.add(&rec(0, 2, true), true);
        s.add(&rec(0, 2, false), true);
        // Key 1, limited: ideal admits one and denies one; Allot admits the other one (no
        // shortfall: the same count, a different request).
        s.add(&rec(1, 1, false), true);
        s.add(&rec(1, 1, true), false);
        // Key 2, limited: ideal admits 3, Allot 1.
        for ok in [true, true, true] {
            s.add(&rec(2, 1, false), ok);
        }
        s.add(&rec(2, 1, true), false);
        assert_eq!(s.by_kind(), (2, 2));
    }

    #[test]
    fn more_admitted_than_ideal_is_no_shortfall_and_sums_saturate() {
        let mut s = Shortfall::default();
        s.add(&rec(0, u32::MAX, true), false);
        s.add(&rec(0, u32::MAX, true), false);
        assert_eq!(s.by_kind(), (0, 0));
    }
}
