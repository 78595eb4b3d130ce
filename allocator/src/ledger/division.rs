//! Division of one policy key among its regions (design §5). With `shares_mode: cap` each
//! region's part is its share, moved only by an operator. With `shares_mode: weighted` (the
//! default) shares are guaranteed minimums and weights: each region's claim comes from the
//! Acquires it sent recently (their wants and measured demand), [`region_parts`] divides the key
//! by weighted max-min, and [`Parts::hand_off`](super::handoff::Parts::hand_off) moves the parts
//! there through the versioned handoff, so a part taken from one region is granted to another
//! only after the allocations granted under the larger part are gone.

use super::fair_share::{one_token_ppm, region_parts, RegionClaim};
use super::small_map::SmallMap;
use super::sources::Prepared;
use super::{KeyId, KeyState, Ledger, Name};
use allot_common::config::{Rule, RuleLimit, SharesMode};
use allot_common::units::{millis_to_nanos, per_second, Micros, MICROS_PER_TOKEN};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What one request says about its holder's demand: an Acquire's want and measured demand, or
/// a central decision's cost.
#[derive(Debug, Clone, Copy)]
pub(super) struct Demand<'a> {
    /// Holder (agent id).
    pub(super) holder: &'a str,
    /// Microtokens wanted over one lease period (a decision's cost).
    pub(super) want: Micros,
    /// Measured demand, microtokens per second; 0 when unknown.
    pub(super) demand_per_s: u64,
    /// Whether the request makes an allocation when granted (an Acquire; a Decide does not).
    pub(super) allocates: bool,
}

/// A holder's latest Acquire (or Decide) for one key, kept for fair division.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Ask {
    /// Microtokens wanted over one lease period.
    pub(super) want: Micros,
    /// Measured demand, microtokens per second; 0 when the holder did not say. A central
    /// decision records the ledger's own estimate of its holder's rate of decisions here
    /// ([`decided_demand`]).
    pub(super) demand_per_s: u64,
    /// When it asked, Unix ms.
    pub(super) at_ms: u64,
    /// When the holder was last denied for this key, Unix ms (0: never).
    pub(super) denied_at_ms: u64,
    /// When the holder's current run of asks began, Unix ms: its asks since then came no
    /// further apart than the idle window.
    pub(super) since_ms: u64,
}

impl Ask {
    /// The holder's demand rate, microtokens per second: its measured demand, else its want
    /// spread over the lease (`ttl_ms` > 0).
    pub(super) fn rate_per_s(&self, ttl_ms: u64) -> u64 {
        if self.demand_per_s > 0 {
            return self.demand_per_s;
        }
        per_second(self.want, millis_to_nanos(ttl_ms.max(1)))
    }
}

/// The demand of a holder that decides centrally, µtok/s, at its decision of `cost` µtok at
/// `now` (Unix ms) after its previous ask `prev` (within the idle window), for a lease of
/// `ttl_ms`:
/// * after a gap g shorter than half a lease, w: a leaky sum — what is left of the previous
///   estimate, decayed linearly by g, plus the cost spread over w. At one decision every g ms
///   it converges to cost / g (the fixed point of r = r·(1 − g/w) + cost/w) within a few
///   decisions; a burst adds each decision's cost over w;
/// * after a gap g of w or more: cost / g, the rate the gap itself shows (a sparse holder is
///   not read as busier than it is);
/// * the first decision of a run (no ask within the idle window): cost / ttl, as before this
///   estimate existed (one decision says nothing about the rate; while the run is young its
///   region claims at least its guarantee anyway, `Seen::claim`).
///
/// A decision carries no measured demand (the agent measures a key only once it leases it), so
/// without this each holder's demand read as one decision's cost over a lease whatever its
/// rate: three gateways deciding 5/s of acme between them claimed 1.5/s, and their region's
/// part was lowered below its guarantee just as its demand showed (issue 9 item 5: the
/// guarantee then came back in steps of one handoff each, over about 5 s).
fn decided_demand(prev: Option<&Ask>, cost: Micros, ttl_ms: u64, now: u64) -> u64 {
    let per = |ms: u128| u64::try_from(u128::from(cost) * 1000 / ms.max(1)).unwrap_or(u64::MAX);
    let Some(p) = prev else {
        return per(u128::from(ttl_ms));
    };
    let w = u128::from((ttl_ms / 2).max(1));
    let dt = u128::from(now.saturating_sub(p.at_ms));
    if dt >= w {
        return per(dt);
    }
    let left = u128::from(p.rate_per_s(ttl_ms)) * (w - dt) / w;
    u64::try_from(left.saturating_add(u128::from(per(w)))).unwrap_or(u64::MAX)
}

/// How long a region counts as busy after its last Acquire, ms: a holder with demand renews
/// before its allocation dies, at most a lease plus the drift after its previous grant.
pub(super) fn idle_after_ms(rule: &Rule) -> u64 {
    rule.lease.ttl_ms.saturating_add(rule.lease.max_drift_ms)
}

/// How long a busy region whose asks were all met must have been quiet before it lends what
/// its holders did not ask for, ms. Longer than a loaded round trip, so a region in the middle
/// of a burst (its holders asking one after another) is not taken for one that is done; shorter
/// than the agents' default `cold_wait_ms` (250), so a request that waits for an answer can
/// still be admitted from what is lent.
pub(super) const SETTLE_MS: u64 = 50;

/// A region's recent measured demand for a key above this, in parts per million of the key's
/// rate, is a flood: a denial's wait is then for a token per hungry holder
/// ([`Ledger::contenders`]). Twice the rate: a key at or near its contract is not one.
pub(super) const FLOOD_PPM: u32 = 2_000_000;

/// How recent an ask or a denial must be to count towards a flood, ms (and at most the idle
/// window): a holder that left, or was last denied longer ago, no longer lengthens the others'
/// waits. Under a flood each hungry holder is denied several times a second.
pub(super) const CONTENTION_WINDOW_MS: u64 = 1_000;

/// Whether `at` (Unix ms; 0: never) lies within the last `window` ms before `now`. Ledger time
/// never goes back, so `at` ≤ `now`; a later `at` counts as just now.
fn within(at: u64, window: u64, now: u64) -> bool {
    at > 0 && now.saturating_sub(at) < window
}

/// What one busy region keeps of its bucket when another borrows, from its holders' asks
/// within the idle window `idle` (ms) at `now` (Unix ms); `None` when none asked within the
/// window (the region is idle and keeps nothing).
///
/// * One of its holders was denied within the window: it wants more than it got, so it keeps
///   all of its bucket (`Micros::MAX`): a region with demand always has its guarantee.
/// * It asked within the last [`SETTLE_MS`]: it may be in the middle of a burst, so it keeps
///   all of it too. Two regions that start hammering at once both keep their guarantees.
/// * Otherwise every ask was met and the region has been quiet since: it keeps what its
///   holders still ask for, Σ of their outstanding wants (at least one token), so a renewal of
///   their allocations is still covered, and lends the rest of its part (weighted max-min by
///   demand: a burst that lands mostly in one region does not strand the other region's
///   unasked part). An admitted central decision wants nothing more (`note_served`): a region
///   that only decides centrally keeps one token, and its next denial makes it keep all again,
///   so its guarantee comes back within one ask.
fn busy_region_keeps<'a>(
    asks: impl Iterator<Item = &'a Ask>,
    idle: u64,
    now: u64,
) -> Option<Micros> {
    let mut keep: Option<Micros> = None;
    for x in asks.filter(|x| within(x.at_ms, idle, now)) {
        if within(x.denied_at_ms, idle, now) || within(x.at_ms, SETTLE_MS, now) {
            return Some(Micros::MAX);
        }
        keep = Some(keep.unwrap_or(0).saturating_add(x.want));
    }
    keep.map(|k| k.max(MICROS_PER_TOKEN))
}

/// When a busy region that keeps all of its bucket only because it asked within the last
/// [`SETTLE_MS`] starts to lend (Unix ms; see [`busy_region_keeps`]); `None` when it is idle,
/// was denied within the window `idle`, or lends already.
fn settles_at<'a>(asks: impl Iterator<Item = &'a Ask>, idle: u64, now: u64) -> Option<u64> {
    let mut latest: Option<u64> = None;
    for x in asks.filter(|x| within(x.at_ms, idle, now)) {
        if within(x.denied_at_ms, idle, now) {
            return None;
        }
        latest = latest.max(Some(x.at_ms));
    }
    latest
        .map(|at| at.saturating_add(SETTLE_MS))
        .filter(|&at| at > now)
}

/// The handoff hint of a denial (ms; 0: none): `handoff` when it is sooner than the refill's
/// `retry_after_ms` and the calendar quota is not what ran out (no lending refills that).
pub(super) fn sooner(handoff: u64, retry_after_ms: u64, calendar_spent: bool) -> u64 {
    if calendar_spent || handoff == 0 || handoff >= retry_after_ms {
        return 0;
    }
    handoff
}

/// What the recent requests of one region show, for its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    /// It asked within the idle window.
    asked: bool,
    /// One of its holders was denied within the idle window.
    denied: bool,
    /// Σ of its holders' demand, ppm of the policy's rate.
    demand_ppm: u32,
    /// Its part now, ppm.
    part_ppm: u32,
    /// The part a pending raise is taking it to, ppm (0 when none).
    pending_ppm: u32,
    /// It resumed within the idle window: every holder asking now began asking since then, so
    /// what they asked says little about its demand yet.
    resumed: bool,
}

impl Seen {
    /// The region's claim in the division (see [`region_parts`]), given its share `g` and
    /// whether the key is still fresh:
    /// * a region whose holders are denied while it uses (nearly) all of its part is *hungry*:
    ///   it may want more than it can show, so it claims a quarter more than its part (it grows
    ///   by that much per handoff), at least its guarantee, and what is spare goes to it first;
    /// * any other region claims its demand with an eighth of headroom (a region at that part
    ///   is not hungry, so a steady region stays where it is);
    /// * a region whose raise still waits for free space keeps claiming it: what it measures
    ///   meanwhile is only what its smaller part allowed;
    /// * while the key is fresh, and while a region has just resumed asking after an idle
    ///   window, the region claims at least its guarantee: one request (a central decision of
    ///   one token, the first Acquire) says little about its demand, and a guarantee claimed
    ///   only once the region shows more would take a second handoff to arrive;
    /// * a region that has not asked claims just its guarantee (it is busy only while the key
    ///   is fresh).
    fn claim(&self, g: u32, fresh: bool) -> RegionClaim {
        let (demand, part) = (self.demand_ppm, self.part_ppm);
        let saturated = part > 0 && u64::from(demand) * 16 >= u64::from(part) * 15;
        let hungry = self.asked && self.denied && saturated;
        let claim = if hungry {
            let used = demand.max(part);
            used.saturating_add(used / 4).max(g)
        } else {
            demand.saturating_add(demand / 8)
        };
        let claim = claim.max(self.pending_ppm);
        let claim = match (self.asked, fresh || self.resumed) {
            (false, _) => g,
            (true, true) => claim.max(g),
            (true, false) => claim,
        };
        RegionClaim {
            guarantee_ppm: g,
            demand_ppm: Some(claim),
            busy: self.asked || fresh,
            hungry,
        }
    }
}

impl Ledger {
    /// Records `d` as its holder's latest ask for `kid` in `region` and forgets asks of the
    /// same region older than the idle window.
    pub(super) fn record_ask(
        &mut self,
        kid: &KeyId,
        region: &str,
        d: &Demand<'_>,
        rule: &Rule,
        now: u64,
    ) {
        let idle = idle_after_ms(rule);
        let (region, holder) = (self.names.intern(region), self.names.intern(d.holder));
        let asks = self.demands.entry((kid.clone(), region)).or_default();
        let before = asks.len();
        asks.retain(|_, x| x.at_ms.saturating_add(idle) > now);
        // Only asks within the idle window are left: the holder's run goes on, or starts now.
        let prev = asks.get(d.holder).copied();
        let (denied_at_ms, since_ms) = prev.map_or((0, now), |x| (x.denied_at_ms, x.since_ms));
        let demand_per_s = if d.allocates || d.demand_per_s > 0 {
            d.demand_per_s
        } else {
            decided_demand(prev.as_ref(), d.want, rule.lease.ttl_ms, now)
        };
        asks.insert(
            holder,
            Ask {
                want: d.want,
                demand_per_s,
                at_ms: now,
                denied_at_ms,
                since_ms,
            },
        );
        let after = asks.len();
        self.index.asks_changed(before, after);
    }

    /// Notes that `holder`'s request for `kid` in `region` was denied at `now`: its region is
    /// hungry (see [`RegionClaim::hungry`]) while it uses all of its part.
    pub(super) fn note_denied(&mut self, kid: &KeyId, region: &str, holder: &str, now: u64) {
        if let Some(x) = self
            .demands
            .get_mut(&(kid.clone(), Name::from(region)))
            .and_then(|m| m.get_mut(holder))
        {
            x.denied_at_ms = now;
        }
    }

    /// How many holders contend for `kid`'s tokens in `region` at `now` when its holders flood
    /// the key: `holder` itself and every other holder of the region denied within the last
    /// [`CONTENTION_WINDOW_MS`] (hungry, whether or not its latest ask got a token); 1 when
    /// they do not, and for window algorithms (a freed slot is a freed slot).
    ///
    /// A denied Acquire's wait is then for a token per contender (`Ledger::denied`): the
    /// holders denied while the bucket is empty come back together when it holds a token for
    /// each of them, and each gets one, instead of all coming back at the next token for it to
    /// go to one. Under a flood every holder of a key asked again at each refilled token and all
    /// but one were denied again, a Raft entry each (issue 9, the `flood` part: 135 Raft
    /// entries a second for a key of 10/s over six gateways; 49 with this).
    ///
    /// A flood is the measured demand of the region's recent asks (unknown demand counts 0)
    /// above [`FLOOD_PPM`] of the key's whole rate. Only this region's holders are counted, and
    /// a flood spread thin over several regions is not one. Near the limit a holder is better
    /// served at the next token: sizing every contended denial this way, part c (its regions at
    /// their parts) admitted 0.3 % less than the same build without the change.
    pub(super) fn contenders(
        &self,
        kid: &KeyId,
        region: &str,
        holder: &str,
        rule: &Rule,
        now: u64,
    ) -> u64 {
        let params = match rule.limit {
            RuleLimit::Limited { params, .. } if params.kind().is_bucket() => params,
            _ => return 1,
        };
        let Some(asks) = self.demands.get(&(kid.clone(), Name::from(region))) else {
            return 1;
        };
        let window = idle_after_ms(rule).min(CONTENTION_WINDOW_MS);
        let demand = asks
            .iter()
            .filter(|(_, x)| within(x.at_ms, window, now))
            .map(|(_, x)| x.demand_per_s)
            .fold(0u64, u64::saturating_add);
        if params.refill_rate().ppm_of_per_s(demand) <= FLOOD_PPM {
            return 1;
        }
        let others = asks
            .iter()
            .filter(|(h, x)| h.as_str() != holder && within(x.denied_at_ms, window, now))
            .count();
        u64::try_from(others).unwrap_or(u64::MAX).saturating_add(1)
    }

    /// Notes that `d.holder`'s central decision for `kid` in `region` was admitted: its cost is
    /// debited already, so its ask keeps no want outstanding (a busy region's keep and the max-min
    /// inside the region hold nothing back for it), and its demand stays what [`decided_demand`]
    /// measured (the region's claim does not change; `ttl_ms` spreads the want when nothing was
    /// measured). Without this a served burst reserved its own cost a second time against a
    /// borrower (issue 9, skewed part a: an Acquire granted 6 of the 11 tokens left).
    pub(super) fn note_served(&mut self, kid: &KeyId, region: &str, d: &Demand<'_>, ttl_ms: u64) {
        if let Some(x) = self
            .demands
            .get_mut(&(kid.clone(), Name::from(region)))
            .and_then(|m| m.get_mut(d.holder))
        {
            x.demand_per_s = x.rate_per_s(ttl_ms);
            x.want = 0;
        }
    }

    /// The wants of the holders of `region` that asked for `kid` within the last lease, with
    /// `d.holder`'s own slot set to `d.want`, and the index of that slot (for max-min division
    /// inside the region).
    pub(super) fn holder_wants(
        &self,
        kid: &KeyId,
        region: &str,
        d: &Demand<'_>,
        ttl_ms: u64,
        now: u64,
    ) -> (Vec<u64>, usize) {
        let mut wants: Vec<u64> = self
            .demands
            .get(&(kid.clone(), Name::from(region)))
            .into_iter()
            .flat_map(|m| m.iter())
            .filter(|(h, x)| *h != d.holder && x.at_ms.saturating_add(ttl_ms) > now)
            .map(|(_, x)| x.want)
            .collect();
        wants.push(d.want);
        let me = wants.len() - 1;
        (wants, me)
    }

    /// What each busy region of `kid` keeps of its own part's bucket when another region
    /// borrows (design §5 "Borrowing"), microtokens. A region is busy when it asked (an Acquire
    /// or a decision) within the idle window of `rule` (see [`idle_after_ms`]); an idle region
    /// is absent and keeps nothing. See [`busy_region_keeps`] for what a busy one keeps.
    pub(super) fn region_keeps(
        &self,
        kid: &KeyId,
        rule: &Rule,
        now: u64,
    ) -> BTreeMap<String, Micros> {
        let idle = idle_after_ms(rule);
        self.region_asks(kid)
            .filter_map(|(region, asks)| {
                let keep = busy_region_keeps(asks.values(), idle, now)?;
                Some((region.to_string(), keep))
            })
            .collect()
    }

    /// When asking again may find more for `region` of `kid`, ms from `now` (0: no sooner than
    /// the refill): the soonest another busy region, all of whose asks were met, will have been
    /// quiet for [`SETTLE_MS`] and so lend what it did not ask for (see [`busy_region_keeps`]).
    /// A waiting request whose wait bound reaches that far asks again then instead of being
    /// denied (issue 9, skewed part a).
    pub(super) fn handoff_in_ms(&self, kid: &KeyId, rule: &Rule, region: &str, now: u64) -> u64 {
        let idle = idle_after_ms(rule);
        self.region_asks(kid)
            .filter(|(r, _)| *r != region)
            .filter_map(|(_, asks)| settles_at(asks.values(), idle, now))
            .map(|at| at.saturating_sub(now).max(1))
            .min()
            .unwrap_or(0)
    }

    /// [`handoff_in_ms`](Self::handoff_in_ms) for a request of `region` on the key `t`; 0
    /// unless the region may borrow (`shares_mode: weighted`).
    pub(super) fn handoff_for(&self, t: &Prepared, region: &str, now: u64) -> u64 {
        if !t.borrows {
            return 0;
        }
        self.handoff_in_ms(&t.kid, &t.rule, region, now)
    }

    /// The asks of each region of `kid`, by region.
    fn region_asks<'a>(
        &'a self,
        kid: &KeyId,
    ) -> impl Iterator<Item = (&'a str, &'a SmallMap<Name, Ask>)> + 'a {
        let from = (kid.clone(), Name::default());
        let kid = kid.clone();
        self.demands
            .range(from..)
            .take_while(move |((k, _), _)| *k == kid)
            .map(|((_, region), asks)| (region.as_str(), asks))
    }

    /// Re-divides `kid` among its rule's regions and moves the parts by handoff (module docs).
    /// Called whenever the key is touched: before a grant, when an allocation ends, when the
    /// shares change. A key without regional shares is left alone.
    pub(super) fn rebalance_key(&mut self, kid: &KeyId, now: u64) {
        let Some(rule) = self.rule_by_id(&kid.0) else {
            return;
        };
        let Some(ps) = self
            .shares
            .get(kid.0.as_str())
            .filter(|p| !p.regions.is_empty())
        else {
            return;
        };
        let Some(ks) = self.keys.get(kid) else {
            return;
        };
        let targets: BTreeMap<String, u32> = ps
            .regions
            .iter()
            .map(|(r, s)| (r.clone(), s.target_ppm))
            .collect();
        let (desired, needs) = match rule.shares_mode {
            SharesMode::Cap => (targets, None),
            SharesMode::Weighted => {
                let (d, n) = self.weighted_parts(kid, ks, rule, &targets, now);
                (d, Some(n))
            }
        };
        let mut desired = desired;
        // A raised part settles for half a lease before it may be lowered again: its holders'
        // next measurements show what it allows.
        let hold = rule.lease.ttl_ms / 2;
        if let Some(ks) = self.keys.get_mut(kid) {
            if let Some(needs) = needs {
                ks.parts.damp(&mut desired, &needs, now, hold);
            }
            ks.parts.hand_off(&desired, now);
        }
    }

    /// The weighted max-min parts of `kid` by its regions' recent demand, and what each region
    /// needs (its guarantee capped by its demand; 0 when idle).
    fn weighted_parts(
        &self,
        kid: &KeyId,
        ks: &KeyState,
        rule: &Rule,
        targets: &BTreeMap<String, u32>,
        now: u64,
    ) -> (BTreeMap<String, u32>, BTreeMap<String, u32>) {
        let RuleLimit::Limited { params, .. } = rule.limit else {
            return (BTreeMap::new(), BTreeMap::new());
        };
        let idle = idle_after_ms(rule);
        // Every region counts as busy for one idle window after the key appears, claiming at
        // least its guarantee: the first region to ask does not take what the others are about
        // to ask for.
        let fresh = ks.created_ms.saturating_add(idle) > now;
        let claims: Vec<RegionClaim> = targets
            .iter()
            .map(|(region, &g)| {
                let asks = self
                    .demands
                    .get(&(kid.clone(), Name::from(region.as_str())));
                let recent = asks
                    .into_iter()
                    .flat_map(|m| m.values())
                    .filter(|x| x.at_ms.saturating_add(idle) > now);
                let (mut seen, mut denied, mut rate) = (false, false, 0u64);
                let mut first_since = u64::MAX;
                for x in recent {
                    seen = true;
                    denied |= x.denied_at_ms > 0 && x.denied_at_ms.saturating_add(idle) > now;
                    rate = rate.saturating_add(x.rate_per_s(rule.lease.ttl_ms));
                    first_since = first_since.min(x.since_ms);
                }
                let seen_region = Seen {
                    asked: seen,
                    denied,
                    demand_ppm: params.refill_rate().ppm_of_per_s(rate),
                    part_ppm: ks.parts.effective(region),
                    pending_ppm: ks.parts.pending_raise(region),
                    resumed: seen && first_since.saturating_add(idle) > now,
                };
                seen_region.claim(g, fresh)
            })
            .collect();
        let parts = region_parts(&claims, one_token_ppm(params.capacity()));
        let needs = targets
            .keys()
            .zip(&claims)
            .map(|(r, c)| {
                let need = if c.busy {
                    c.demand_ppm
                        .map_or(c.guarantee_ppm, |d| d.min(c.guarantee_ppm))
                } else {
                    0
                };
                (r.clone(), need)
            })
            .collect();
        (targets.keys().cloned().zip(parts).collect(), needs)
    }

    /// The rule with id `id`, in any domain.
    pub(super) fn rule_by_id(&self, id: &str) -> Option<&Rule> {
        self.parsed
            .values()
            .flat_map(|d| d.rules.iter())
            .find(|r| r.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_common::algorithm::{LimitParams, Rate};
    use allot_common::units::{MICROS_PER_TOKEN as T, NANOS_PER_SEC};

    #[test]
    fn demand_is_measured_in_parts_of_the_policy_rate() {
        let bucket = LimitParams::TokenBucket {
            capacity: 40 * T,
            rate: Rate {
                micros: 10 * T,
                per_ns: NANOS_PER_SEC,
            },
        };
        assert_eq!(bucket.refill_rate().ppm_of_per_s(5 * T), 500_000);
        assert_eq!(bucket.refill_rate().ppm_of_per_s(0), 0);
        assert_eq!(bucket.refill_rate().ppm_of_per_s(u64::MAX), u32::MAX);
        let window = LimitParams::FixedWindow(allot_common::algorithm::WindowParams {
            limit: 60 * T,
            period_ns: 60 * NANOS_PER_SEC,
        });
        assert_eq!(window.refill_rate().ppm_of_per_s(T / 2), 500_000);
        // A huge period times a huge demand saturates instead of overflowing.
        let slow = LimitParams::TokenBucket {
            capacity: T,
            rate: Rate {
                micros: 1,
                per_ns: u64::MAX,
            },
        };
        assert_eq!(slow.refill_rate().ppm_of_per_s(u64::MAX), u32::MAX);
    }

    #[test]
    fn a_region_that_resumes_claims_its_guarantee_until_its_demand_shows() {
        // ap-south (share 10 %) resumes with a central decision of one token: 450 ppm with
        // headroom, far below what it will use.
        let resumed = Seen {
            asked: true,
            denied: false,
            demand_ppm: 400,
            part_ppm: 0,
            pending_ppm: 0,
            resumed: true,
        };
        let c = resumed.claim(100_000, false);
        assert_eq!((c.demand_ppm, c.busy), (Some(100_000), true));
        // A larger demand is claimed as it is.
        let big = Seen {
            demand_ppm: 200_000,
            ..resumed
        };
        assert_eq!(big.claim(100_000, false).demand_ppm, Some(225_000));
        // Once its run of asks is older than the idle window, what it asks is its claim.
        let steady = Seen {
            resumed: false,
            ..resumed
        };
        assert_eq!(steady.claim(100_000, false).demand_ppm, Some(450));
        // A share of 0 still claims nothing more.
        assert_eq!(resumed.claim(0, false).demand_ppm, Some(450));
    }

    #[test]
    fn a_run_of_asks_is_dated_from_its_first_ask_and_a_gap_starts_a_new_one() {
        let mut l = crate::ledger::tests::ledger(crate::ledger::tests::REGIONAL);
        let rule = l.parsed["api"].rules[0].clone();
        let kid: KeyId = (rule.id.as_str().into(), "acme".into());
        let idle = idle_after_ms(&rule);
        let t0 = crate::ledger::tests::T0;
        let ask = Demand {
            holder: "ap1",
            want: T,
            demand_per_s: 0,
            allocates: false,
        };
        let since = |l: &Ledger| l.demands[&(kid.clone(), "ap-south".into())]["ap1"].since_ms;
        l.record_ask(&kid, "ap-south", &ask, &rule, t0);
        // Asks no further apart than the idle window continue the run.
        l.record_ask(&kid, "ap-south", &ask, &rule, t0 + idle - 1);
        l.record_ask(&kid, "ap-south", &ask, &rule, t0 + 2 * idle - 2);
        assert_eq!(since(&l), t0);
        // A gap of the idle window starts a new one.
        let later = t0 + 3 * idle - 2;
        l.record_ask(&kid, "ap-south", &ask, &rule, later);
        assert_eq!(since(&l), later);
    }

    #[test]
    fn a_holder_deciding_centrally_is_measured_at_its_rate_of_decisions() {
        let ttl = 2_000;
        let ask = |demand_per_s, at_ms| Ask {
            want: 0,
            demand_per_s,
            at_ms,
            denied_at_ms: 0,
            since_ms: 0,
        };
        // The first decision of a run: its cost over a lease (nothing known of its rate).
        assert_eq!(decided_demand(None, T, ttl, 10_000), T / 2);
        // One decision every 600 ms converges to 1/0.6 s = 1.67 tokens/s within a few
        // decisions (the old reading: 0.5 tokens/s, a decision's cost over a lease).
        let (mut r, mut at) = (decided_demand(None, T, ttl, 0), 0);
        let mut seen = Vec::new();
        for _ in 0..6 {
            let next = at + 600;
            r = decided_demand(Some(&ask(r, at)), T, ttl, next);
            at = next;
            seen.push(r * 100 / T);
        }
        assert_eq!(seen, vec![120, 148, 159, 163, 165, 166]);
        // A sparse holder is read at the rate its gap shows, never above it: one decision
        // every 1.5 s or 2 s is 0.67 or 0.5 tokens/s.
        assert_eq!(
            decided_demand(Some(&ask(T / 2, 0)), T, ttl, 1_500),
            2 * T / 3
        );
        assert_eq!(decided_demand(Some(&ask(9 * T, 0)), T, ttl, 2_000), T / 2);
        // The fixed point is exact: cost / g.
        assert_eq!(
            decided_demand(Some(&ask(5 * T / 3, 0)), T, ttl, 600),
            5 * T / 3
        );
        // A burst adds each decision's cost over the window.
        assert_eq!(decided_demand(Some(&ask(T, 7)), T, ttl, 7), 2 * T);
        // After a gap of the window or more, the gap alone: at exactly w, cost / w (where the
        // leaky sum ends, so the two agree there).
        assert_eq!(decided_demand(Some(&ask(9 * T, 0)), T, ttl, 1_000), T);
        assert_eq!(
            decided_demand(Some(&ask(9 * T, 0)), T, ttl, 999),
            9 * T / 1000 + T
        );
        assert_eq!(decided_demand(Some(&ask(9 * T, 0)), T, ttl, u64::MAX), 0);
        // A previous ask with measured demand (an Acquire) is carried the same way.
        assert_eq!(decided_demand(Some(&ask(4 * T, 0)), T, ttl, 500), 3 * T);
        // Extremes: a lease of 0 or 1 ms, a huge cost or demand saturate instead of overflowing.
        assert_eq!(decided_demand(None, T, 0, 0), 1_000 * T);
        assert_eq!(decided_demand(Some(&ask(T, 5)), T, 0, 5), 1_000 * T + T);
        assert_eq!(decided_demand(None, u64::MAX, 1, 0), u64::MAX);
        assert_eq!(
            decided_demand(Some(&ask(u64::MAX, 0)), u64::MAX, ttl, 0),
            u64::MAX
        );
    }

    #[test]
    fn an_ask_without_measured_demand_spreads_its_want_over_the_lease() {
        let a = Ask {
            want: 8 * T,
            demand_per_s: 0,
            at_ms: 0,
            denied_at_ms: 0,
            since_ms: 0,
        };
        assert_eq!(a.rate_per_s(2000), 4 * T);
        assert_eq!(a.rate_per_s(0), 8_000 * T);
        let b = Ask {
            demand_per_s: 3 * T,
            ..a
        };
        assert_eq!(b.rate_per_s(2000), 3 * T);
        let c = Ask {
            want: u64::MAX,
            demand_per_s: 0,
            at_ms: 0,
            denied_at_ms: 0,
            since_ms: 0,
        };
        assert_eq!(c.rate_per_s(1), u64::MAX);
    }

    #[test]
    fn a_busy_region_keeps_all_until_it_settles_then_its_wants() {
        let (idle, now) = (2_250, 10_000);
        let ask = |want, at_ms, denied_at_ms| Ask {
            want,
            demand_per_s: 0,
            at_ms,
            denied_at_ms,
            since_ms: at_ms,
        };
        let keeps = |asks: &[Ask]| busy_region_keeps(asks.iter(), idle, now);
        let settles = |asks: &[Ask]| settles_at(asks.iter(), idle, now);
        let quiet = now - SETTLE_MS;
        // No ask within the idle window: idle, keeps nothing and never settles.
        assert_eq!(keeps(&[]), None);
        assert_eq!(keeps(&[ask(5 * T, now - idle, 0)]), None);
        assert_eq!(settles(&[ask(5 * T, now - idle, 0)]), None);
        // Asked within the settle window: all of its bucket, until the latest ask settles.
        let burst = [ask(T, now - 1, 0), ask(3 * T, quiet, 0)];
        assert_eq!(keeps(&burst), Some(Micros::MAX));
        assert_eq!(settles(&burst), Some(now - 1 + SETTLE_MS));
        // Settled: Σ of the recent wants, at least one token; it lends already.
        let met = [ask(T, quiet, 0), ask(3 * T, quiet - 7, 0)];
        assert_eq!(keeps(&met), Some(4 * T));
        assert_eq!(settles(&met), None);
        assert_eq!(keeps(&[ask(1, quiet, 0)]), Some(T));
        // A stale ask does not count beside a recent one.
        assert_eq!(
            keeps(&[ask(T, quiet, 0), ask(9 * T, now - idle, 0)]),
            Some(T)
        );
        // A denial within the window: all of its bucket, settled or not, and no settling.
        let denied = [ask(T, quiet, now - 1), ask(T, quiet, 0)];
        assert_eq!(keeps(&denied), Some(Micros::MAX));
        assert_eq!(settles(&[ask(T, now, now)]), None);
        // An older denial no longer counts.
        assert_eq!(keeps(&[ask(T, quiet, now - idle)]), Some(T));
        // Extremes: wants that sum past u64 saturate; times near u64::MAX do not overflow.
        assert_eq!(
            keeps(&[ask(u64::MAX, quiet, 0), ask(T, quiet, 0)]),
            Some(u64::MAX)
        );
        assert_eq!(
            busy_region_keeps([ask(T, u64::MAX, 0)].iter(), idle, u64::MAX),
            Some(Micros::MAX)
        );
        assert_eq!(
            settles_at([ask(T, u64::MAX, 0)].iter(), idle, u64::MAX),
            None
        );
    }

    #[test]
    fn a_handoff_hint_is_only_given_when_sooner_than_the_refill() {
        assert_eq!(sooner(50, 200, false), 50);
        assert_eq!(sooner(50, 50, false), 0, "not sooner");
        assert_eq!(sooner(0, 200, false), 0, "no hint");
        assert_eq!(
            sooner(50, 200, true),
            0,
            "lending does not refill a calendar quota"
        );
        assert_eq!(sooner(1, u64::MAX, false), 1);
    }
}
