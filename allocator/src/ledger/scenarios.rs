//! Quota follows demand (issue 9 items 5 and 6), on injected time: a driver plays gateways that
//! lease from the ledger the way the agent does (spend locally, Acquire when empty or running
//! low, report and release once a second, stop at the deadline), applies their Acquire, Report
//! and Release commands at stamped times, and compares what they admitted with the decision core
//! replaying the same arrivals as one central bucket (design §2).

use super::*;
use allot_common::units::MICROS_PER_TOKEN as T;

const T0: u64 = 1_795_988_100_000;

/// The acme contract (deploy/examples/acme.yaml): 10/s, burst 40, eu-west/us-east 50 % each.
const ACME: &str = "domain: acme
descriptors:
  - key: tenant
    rate_limit:
      name: acme-search
      unit: second
      requests_per_unit: 10
      burst: 40
      lease: {ttl_ms: 2000, max_grant: 8, max_drift_ms: 250}
      regions:
        - {region: eu-west, share: \"50%\"}
        - {region: us-east, share: \"50%\"}
";

/// The search-cluster protection limit (deploy/examples/search-cluster.yaml).
const SEARCH: &str = "domain: search
descriptors:
  - key: tenant
    rate_limit:
      name: search-cluster
      unit: second
      requests_per_unit: 1000
      burst: 1000
      lease: {ttl_ms: 2500, max_grant: 400, max_drift_ms: 200}
      regions:
        - {region: eu-west, rate: 500}
        - {region: us-east, rate: 400}
        - {region: ap-south, rate: 100}
";

/// The agent's lease settings the driver follows (agent/src/lease/settings.rs defaults).
const REPORT_INTERVAL_MS: u64 = 1_000;
/// A central key is promoted to leases at this many admitted within one lease period.
const PROMOTE_TOKENS: u64 = 4;
const DRIFT_MARGIN_MS: u64 = 250;
const LOW_WATERMARK_PCT: u64 = 25;

/// An allocation as a gateway holds it.
struct Held {
    id: u64,
    epoch: u64,
    /// The base, µtok granted at once.
    granted: u64,
    spent: u64,
    reported: u64,
    /// The gateway stops spending here: issued + ttl − drift margin.
    deadline: u64,
    /// The rate it accrues, µtok/s (0: none), and the most that adds (design §9).
    rate_per_s: u64,
    promised: u64,
    /// It accrues from here (1 ms after it received the grant) to `accrual_end` (the deadline,
    /// or when a later Acquire superseded it), Unix ms.
    accrue_from: u64,
    accrual_end: u64,
}

impl Held {
    /// What the gateway may have spent by `now`: the base and what accrued, as the agent
    /// counts it (late start, early stop, integer arithmetic).
    fn entitled(&self, now: u64) -> u64 {
        let until = now.min(self.accrual_end).min(self.deadline);
        let ms = until.saturating_sub(self.accrue_from);
        let accrued = u64::try_from(u128::from(self.rate_per_s) * u128::from(ms) / 1000)
            .unwrap_or(u64::MAX)
            .min(self.promised);
        self.granted + accrued
    }
}

/// One gateway of the driver.
struct Gateway {
    region: &'static str,
    name: String,
    /// Offered requests per second now.
    rate: u64,
    /// Arrival accumulator (rate × ms, in thousandths of a request).
    acc: u64,
    held: Vec<Held>,
    next_try: u64,
    seq: u64,
    /// Requests offered since the last pass, admitted or denied: the agent measures demand
    /// as its offered load (`KeyLease::offered`), not its admissions.
    offered_since_pass: u64,
    demand_per_s: u64,
    /// Admitted per whole second since the start.
    admitted: Vec<u64>,
    /// Decided centrally (one `Decide` per request) until promoted to leases, as the agent
    /// decides a key it has just seen (agent/src/lease/demand.rs).
    central: bool,
    /// Start of the current promotion window and what was admitted centrally in it.
    window: (u64, u64),
    /// Whether the allocator's last answer was short of the ask (a smaller grant or a denial).
    short: bool,
    /// Acquires sent per whole second since the start.
    acquires: Vec<u64>,
}

/// A driver over one ledger, one policy key and a set of gateways.
struct Driver {
    ledger: Ledger,
    domain: &'static str,
    ttl_ms: u64,
    max_grant: u64,
    gateways: Vec<Gateway>,
    /// The central bucket replaying every arrival.
    ideal: Bucket,
    ideal_admitted: u64,
    offered: u64,
    now: u64,
    /// Gateways ask rate-carrying allocations as the agent does with `rate_leases: true`
    /// (agent/src/lease/manager.rs `want`), with its short-grant hold and accrual denial.
    rates: bool,
    /// Check the ledger's invariants after every command.
    checked: bool,
}

impl Driver {
    fn new(yaml: &str, domain: &'static str, ttl_ms: u64, max_grant: u64) -> Driver {
        let mut ledger = Ledger::default();
        let r = ledger.apply_at(
            &Command::PutPolicy {
                yaml: yaml.into(),
                expected_version: 0,
                request_id: String::new(),
            },
            T0,
        );
        assert!(matches!(r, Response::PolicyPut { .. }), "{r:?}");
        let rule = ledger.parsed[domain].rules[0].clone();
        let allot_common::config::RuleLimit::Limited { params, .. } = rule.limit else {
            panic!("limited rule expected");
        };
        Driver {
            ledger,
            domain,
            ttl_ms,
            max_grant: max_grant * T,
            gateways: Vec::new(),
            ideal: Bucket {
                params,
                state: params.initial_state(millis_to_nanos(T0)),
            },
            ideal_admitted: 0,
            offered: 0,
            now: T0,
            rates: false,
            checked: false,
        }
    }

    /// Applies `cmd` at the driver's time, checking the invariants when asked to.
    fn apply(&mut self, cmd: &Command) -> Response {
        let r = self.ledger.apply_at(cmd, self.now);
        if self.checked {
            if let Err(e) = self.ledger.check_invariants() {
                panic!("after {cmd:?} at +{} ms: {e:?}", self.now - T0);
            }
        }
        r
    }

    fn gateways(&mut self, region: &'static str, n: usize) {
        self.add_gateways(region, n, false);
    }

    /// Gateways that see the key for the first time, so decide it centrally until promoted.
    fn central_gateways(&mut self, region: &'static str, n: usize) {
        self.add_gateways(region, n, true);
    }

    fn add_gateways(&mut self, region: &'static str, n: usize, central: bool) {
        for i in 0..n {
            self.gateways.push(Gateway {
                region,
                name: format!("{region}-{i}"),
                rate: 0,
                acc: 0,
                held: Vec::new(),
                next_try: 0,
                seq: 0,
                offered_since_pass: 0,
                demand_per_s: 0,
                admitted: Vec::new(),
                central,
                window: (0, 0),
                short: false,
                acquires: Vec::new(),
            });
        }
    }

    /// Offers `per_s` requests a second to `region`, split over its gateways.
    fn offer(&mut self, region: &str, per_s: u64) {
        let n = self.gateways.iter().filter(|g| g.region == region).count() as u64;
        for (i, g) in self
            .gateways
            .iter_mut()
            .filter(|g| g.region == region)
            .enumerate()
        {
            g.rate = per_s / n + u64::from((i as u64) < per_s % n);
        }
    }

    fn key(&self) -> PolicyKey {
        PolicyKey {
            domain: self.domain.into(),
            entries: vec![("tenant".into(), "acme".into())],
        }
    }

    /// Runs for `ms` milliseconds of injected time.
    fn run(&mut self, ms: u64) {
        for _ in 0..ms {
            self.now += 1;
            for gi in 0..self.gateways.len() {
                let g = &mut self.gateways[gi];
                g.acc += g.rate;
                let arrivals = g.acc / 1000;
                g.acc %= 1000;
                for _ in 0..arrivals {
                    self.arrive(gi);
                }
                if (self.now - T0 + gi as u64 * 37) % REPORT_INTERVAL_MS == 0 {
                    self.maintain(gi);
                }
            }
        }
    }

    fn arrive(&mut self, gi: usize) {
        self.offered += 1;
        let now_ns = millis_to_nanos(self.now);
        let p = self.ideal.params;
        if p.check(&mut self.ideal.state, now_ns, T).allowed {
            p.spend(&mut self.ideal.state, now_ns, T);
            self.ideal_admitted += 1;
        }
        let now = self.now;
        let spent = |g: &mut Gateway| {
            let a = g
                .held
                .iter_mut()
                .find(|a| now < a.deadline && a.spent + T <= a.entitled(now))?;
            a.spent += T;
            Some(())
        };
        let g = &mut self.gateways[gi];
        let mut ok = spent(g).is_some();
        // The agent's accrual denial: after a short answer, a key whose rate will still accrue
        // a token waits for it instead of asking (agent/src/lease/book/decision_path.rs).
        let accruing = g.short
            && g.held.iter().any(|a| {
                let end = a.accrual_end.min(a.deadline);
                now < end && a.spent + T <= a.entitled(end)
            });
        if g.central {
            ok = now >= g.next_try && self.decide(gi);
        } else if !ok && !accruing && now >= g.next_try {
            self.acquire(gi);
            ok = spent(&mut self.gateways[gi]).is_some();
        }
        let g = &mut self.gateways[gi];
        g.offered_since_pass += 1;
        if ok {
            let sec = ((now - T0) / 1000) as usize;
            if g.admitted.len() <= sec {
                g.admitted.resize(sec + 1, 0);
            }
            g.admitted[sec] += 1;
        }
    }

    /// The agent's central decision of one token; promotes the gateway to leases at
    /// [`PROMOTE_TOKENS`] admitted within one lease period. Whether it was admitted.
    fn decide(&mut self, gi: usize) -> bool {
        let (ttl, now, key) = (self.ttl_ms, self.now, self.key());
        let g = &mut self.gateways[gi];
        g.seq += 1;
        let cmd = Command::Decide(Decide {
            key,
            region: g.region.into(),
            holder: g.name.clone(),
            cost: T,
            request_id: format!("{}-{}", g.name, g.seq),
        });
        let r = self.apply(&cmd);
        let g = &mut self.gateways[gi];
        match r {
            Response::Decided(d) if d.allowed => {
                if now.saturating_sub(g.window.0) >= ttl {
                    g.window = (now, 0);
                }
                g.window.1 += 1;
                g.central = g.window.1 < PROMOTE_TOKENS;
                true
            }
            Response::Decided(d) => {
                g.next_try = now + d.retry_after_ms.max(1);
                false
            }
            other => panic!("decide refused: {other:?}"),
        }
    }

    /// The agent's Acquire: its demand over one lease with 25 % headroom, within
    /// [1 token, max grant]; the max grant while it has measured nothing. With `rates`, as
    /// the agent's `want` with `rate_leases: true`: when its last answer was short or one
    /// report interval's demand is above half the max grant, a rate of its demand plus 25 %
    /// and one report interval of demand plus 25 % now. An Acquire ends the accrual of the
    /// gateway's earlier rates (the agent freezes them before it sends it).
    fn acquire(&mut self, gi: usize) {
        let (ttl, max_grant, now, key) = (self.ttl_ms, self.max_grant, self.now, self.key());
        let rates = self.rates;
        let g = &mut self.gateways[gi];
        let d = g.demand_per_s;
        let over = |ms: u64| d * ms / 1000 * 5 / 4;
        let rated = rates && (g.short || over(REPORT_INTERVAL_MS) > max_grant / 2);
        let (want, want_rate) = match (d, rated) {
            (0, _) => (max_grant, 0),
            (_, false) => (over(ttl), 0),
            (_, true) => (over(REPORT_INTERVAL_MS), d * 5 / 4),
        };
        let want = want.clamp(T, max_grant.max(T));
        for a in &mut g.held {
            a.accrual_end = a.accrual_end.min(now);
        }
        g.seq += 1;
        let sec = ((now - T0) / 1000) as usize;
        if g.acquires.len() <= sec {
            g.acquires.resize(sec + 1, 0);
        }
        g.acquires[sec] += 1;
        let cmd = Command::Acquire(Acquire {
            key,
            region: g.region.into(),
            holder: g.name.clone(),
            want,
            demand_per_s: d,
            want_rate_per_s: want_rate,
            request_id: format!("{}-{}", g.name, g.seq),
        });
        let r = self.apply(&cmd);
        let g = &mut self.gateways[gi];
        match r {
            Response::Granted(x) => {
                let deadline = now + ttl - DRIFT_MARGIN_MS;
                g.held.push(Held {
                    id: x.allocation_id,
                    epoch: x.epoch,
                    granted: x.granted,
                    spent: 0,
                    reported: 0,
                    deadline,
                    rate_per_s: x.rate_per_s,
                    promised: x.promised,
                    accrue_from: now + 1,
                    accrual_end: deadline,
                });
                g.short = x.granted < want - want % T;
                if rates && g.short {
                    // The agent's short-grant hold: an eighth of the fill time, at most an
                    // eighth of a report interval (1 s for these policies).
                    g.next_try = now + REPORT_INTERVAL_MS / 8;
                }
            }
            Response::Denied(x) => {
                g.short = true;
                g.next_try = now + x.retry_after_ms.max(1);
            }
            other => panic!("acquire refused: {other:?}"),
        }
    }

    /// The agent's pass: measure demand, release finished allocations, report the rest,
    /// prefetch when what is left will not last or every allocation ends soon.
    fn maintain(&mut self, gi: usize) {
        let now = self.now;
        let g = &mut self.gateways[gi];
        let holder = g.name.clone();
        g.demand_per_s = g.offered_since_pass * T * 1000 / REPORT_INTERVAL_MS;
        g.offered_since_pass = 0;
        let mut cmds = Vec::new();
        g.held.retain_mut(|a| {
            let done = a.spent >= a.granted && a.entitled(a.accrual_end) <= a.spent;
            if now >= a.deadline || done {
                cmds.push(Command::Release {
                    allocation_id: a.id,
                    epoch: a.epoch,
                    holder: holder.clone(),
                    final_spend: a.spent,
                });
                return false;
            }
            if a.spent > a.reported {
                a.reported = a.spent;
                cmds.push(Command::Report {
                    allocation_id: a.id,
                    epoch: a.epoch,
                    holder: holder.clone(),
                    cumulative_spend: a.spent,
                });
            }
            true
        });
        // What accrues until the next pass counts as left (the agent's `remaining_by`).
        let next = now + REPORT_INTERVAL_MS;
        let left: u64 = g
            .held
            .iter()
            .map(|a| a.entitled(next.min(a.deadline)) - a.spent)
            .sum();
        let last = g.held.iter().map(|a| a.deadline).max().unwrap_or(0);
        let need_soon = g.demand_per_s * REPORT_INTERVAL_MS / 1000;
        let watermark = self.max_grant * LOW_WATERMARK_PCT / 100;
        let ending = last.saturating_sub(now) < 2 * REPORT_INTERVAL_MS;
        let prefetch = !g.central
            && g.demand_per_s > 0
            && (left < need_soon.max(watermark) || ending)
            && now >= g.next_try;
        for c in cmds {
            self.apply(&c);
        }
        if prefetch {
            self.acquire(gi);
        }
    }

    /// Admitted by `region`'s gateways in whole second `sec` (0 = the first).
    fn admitted_in(&self, region: &str, sec: usize) -> u64 {
        self.gateways
            .iter()
            .filter(|g| g.region == region)
            .map(|g| g.admitted.get(sec).copied().unwrap_or(0))
            .sum()
    }

    fn admitted(&self) -> u64 {
        self.gateways.iter().flat_map(|g| g.admitted.iter()).sum()
    }
}

/// The acme deployment: three gateways in eu-west and three in us-east, deciding centrally
/// until promoted when `central` (as gateways that have never seen the key do).
fn acme(central: bool) -> Driver {
    let mut d = Driver::new(ACME, "acme", 2000, 8);
    d.add_gateways("eu-west", 3, central);
    d.add_gateways("us-east", 3, central);
    d
}

#[test]
fn only_eu_west_busy_gets_the_whole_contract_without_an_operator() {
    let mut d = acme(false);
    d.offer("eu-west", 15);
    d.run(30_000);
    let (allot, ideal) = (d.admitted(), d.ideal_admitted);
    // The contract: burst 40 + 10/s × 30 s.
    assert!(allot <= 40 + 300, "admitted {allot} beyond the contract");
    assert!(
        allot * 100 >= ideal * 95,
        "admitted {allot} of an ideal {ideal} ({} offered)",
        d.offered
    );
    // With today's hard split the idle us-east half is stranded.
    let mut cap = Driver::new(
        &ACME.replace(
            "      regions:\n",
            "      shares_mode: cap\n      regions:\n",
        ),
        "acme",
        2000,
        8,
    );
    cap.gateways("eu-west", 3);
    cap.gateways("us-east", 3);
    cap.offer("eu-west", 15);
    cap.run(30_000);
    assert!(
        cap.admitted() * 100 < ideal * 70,
        "cap mode admitted {} of {ideal}",
        cap.admitted()
    );
}

#[test]
fn regional_skew_moves_quota_to_eu_west_and_back_to_a_resuming_ap_south() {
    let mut d = Driver::new(SEARCH, "search", 2500, 400);
    d.gateways("eu-west", 3);
    d.gateways("us-east", 3);
    d.gateways("ap-south", 1);
    // Baseline: every region inside its share.
    d.offer("eu-west", 450);
    d.offer("us-east", 300);
    d.offer("ap-south", 100);
    d.run(5_000);
    // The skew at 5 s: eu-west 650/s, ap-south idle. No operator action.
    d.offer("eu-west", 650);
    d.offer("ap-south", 0);
    d.run(10_000);
    // eu-west ≥ 640/s in every whole second from 3 s after the skew.
    for sec in 8..15 {
        let eu = d.admitted_in("eu-west", sec);
        assert!(eu >= 640, "eu-west admitted {eu} in second {sec}");
        assert!(
            d.admitted_in("us-east", sec) >= 295,
            "us-east starved in {sec}"
        );
    }
    // ap-south resumes at 100/s at 15 s: within TTL + drift + 1 s (3.7 s) it gets ≥ 95/s.
    d.offer("ap-south", 100);
    d.run(10_000);
    for sec in 19..25 {
        let ap = d.admitted_in("ap-south", sec);
        assert!(ap >= 95, "ap-south admitted {ap} in second {sec}");
        assert!(
            d.admitted_in("us-east", sec) >= 295,
            "us-east starved in {sec}"
        );
    }
    // Never more than the contract: burst 1000 + 1000/s × 25 s; every whole second ≤ the rate
    // plus the burst.
    assert!(d.admitted() <= 1000 + 25 * 1000, "{}", d.admitted());
    for sec in 0..25 {
        let all: u64 = ["eu-west", "us-east", "ap-south"]
            .iter()
            .map(|r| d.admitted_in(r, sec))
            .sum();
        assert!(all <= 2000, "{all} admitted in second {sec}");
    }
    assert!(
        d.admitted() * 100 >= d.ideal_admitted * 95,
        "admitted {} of an ideal {}",
        d.admitted(),
        d.ideal_admitted
    );
}

#[test]
fn a_region_resuming_through_central_decisions_gets_its_guarantee_within_one_handoff() {
    // Story part c as allot-local runs it: eu-west 650/s and us-east 300/s, ap-south idle; then
    // ap-south's gateway, which has never seen the key, resumes at 100/s. Its first requests
    // are central decisions of one token each: they say nothing about its demand, yet ap-south
    // is owed its guarantee (100/s) within one handoff — TTL + drift (2.7 s) for the others'
    // older allocations to end, plus 1 s.
    let mut d = skewed(true);
    d.run(8_300);
    d.offer("ap-south", 100);
    // 2.7 s after the resume falls on the whole second 11.
    d.run(6_700);
    d.holds("ap-south", 95, 11..15);
    assert!(d.admitted() <= 1000 + 15 * 1000, "{}", d.admitted());
}

/// Story part c's deployment: the search-cluster limit, three gateways in eu-west and in
/// us-east offered 650/s and 300/s, and one in ap-south (deciding centrally first when
/// `ap_central`, as a gateway that has never seen the key does) offered nothing yet.
fn skewed(ap_central: bool) -> Driver {
    let mut d = Driver::new(SEARCH, "search", 2500, 400);
    d.gateways("eu-west", 3);
    d.gateways("us-east", 3);
    if ap_central {
        d.central_gateways("ap-south", 1);
    } else {
        d.gateways("ap-south", 1);
    }
    d.offer("eu-west", 650);
    d.offer("us-east", 300);
    d
}

impl Driver {
    /// Asserts that `region` admitted at least `min` in every whole second of `secs`, and
    /// us-east, offered 300/s, at least 295 (it is never starved).
    fn holds(&self, region: &str, min: u64, secs: std::ops::Range<usize>) {
        for sec in secs {
            let got = self.admitted_in(region, sec);
            assert!(got >= min, "{region} admitted {got} in second {sec}");
            let us = self.admitted_in("us-east", sec);
            assert!(us >= 295, "us-east starved in {sec}: {us}");
        }
    }
}

#[test]
fn skew_on_a_fresh_key_reaches_eu_west_demand_within_three_seconds() {
    // Story part c as allot-local runs it: eu-west 650/s and us-east 300/s from the start,
    // ap-south never asks. ap-south's guarantee is kept for one idle window (the key is new),
    // then eu-west grows into it.
    let mut d = skewed(false);
    d.run(10_000);
    d.holds("eu-west", 640, 3..10);
    assert!(d.admitted() <= 1000 + 10 * 1000, "{}", d.admitted());
}

#[test]
fn a_burst_over_both_regions_is_split_by_guarantee_not_first_come() {
    // Story part a's shape: six gateways in two regions each get 13 or 14 requests at once.
    // The key is new, so both regions hold their guarantee: the first region to ask cannot take
    // the whole burst and leave the other waiting for a handoff.
    let mut d = Driver::new(ACME, "acme", 2000, 8);
    d.gateways("eu-west", 3);
    d.gateways("us-east", 3);
    d.now += 1;
    for i in 0..80 {
        d.arrive(i % 6);
    }
    let eu = d.admitted_in("eu-west", 0);
    let us = d.admitted_in("us-east", 0);
    assert!(eu + us <= 40, "{eu} + {us} beyond the burst");
    assert!(eu >= 16 && us >= 16, "eu-west {eu}, us-east {us}");
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(64))]

    /// Whatever the demand sequence: the parts held never add up to more than the whole, and
    /// what is granted never exceeds the contract (burst 1000 + 1000/s × elapsed).
    #[test]
    fn random_demand_keeps_parts_within_the_whole_and_grants_within_the_contract(
        steps in proptest::collection::vec(
            (0u64..700, 0usize..3, 0usize..3, 1u64..=400, 0u64..=800, proptest::bool::ANY),
            1..120,
        ),
    ) {
        let regions = ["eu-west", "us-east", "ap-south"];
        let mut d = Driver::new(SEARCH, "search", 2500, 400);
        let mut granted = 0u64;
        let mut live: Vec<(u64, u64, u64, String)> = Vec::new();
        for (dt, r, h, want, demand, release) in steps {
            d.now += dt;
            let now = d.now;
            let key = d.key();
            if release && !live.is_empty() {
                let (id, epoch, g, holder) = live.remove(0);
                d.ledger.apply_at(
                    &Command::Release { allocation_id: id, epoch, holder, final_spend: g },
                    now,
                );
            }
            let holder = format!("{}-{h}", regions[r]);
            let cmd = Command::Acquire(Acquire {
                key,
                region: regions[r].into(),
                holder: holder.clone(),
                want: want * T,
                demand_per_s: demand * T,
                want_rate_per_s: 0,
                request_id: format!("{now}-{r}-{h}"),
            });
            if let Response::Granted(g) = d.ledger.apply_at(&cmd, now) {
                granted += g.granted;
                live.push((g.allocation_id, g.epoch, g.granted, holder));
            }
            let elapsed = now - T0;
            proptest::prop_assert!(
                granted <= (1000 + elapsed) * T,
                "granted {} tokens in {} ms", granted / T, elapsed
            );
            // Regional parts held ≤ 100 % per key, among the ledger's other invariants.
            let checked = d.ledger.check_invariants().and(d.ledger.check_answer_index());
            proptest::prop_assert!(checked.is_ok(), "{checked:?}");
        }
    }
}

impl Driver {
    /// Acquires sent by `region`'s gateways in whole second `sec`, per gateway (in tenths).
    fn acquires_in(&self, region: &str, sec: usize) -> (u64, u64) {
        let gs: Vec<&Gateway> = self
            .gateways
            .iter()
            .filter(|g| g.region == region)
            .collect();
        let n: u64 = gs
            .iter()
            .map(|g| g.acquires.get(sec).copied().unwrap_or(0))
            .sum();
        (n, n * 10 / (gs.len() as u64).max(1))
    }

    /// One line per whole second of `secs`: admitted and Acquires per gateway by region.
    fn table(&self, label: &str, secs: std::ops::Range<usize>) {
        for sec in secs {
            let line: Vec<String> = ["eu-west", "us-east", "ap-south"]
                .iter()
                .map(|r| {
                    let (_, per) = self.acquires_in(r, sec);
                    format!(
                        "{r} {:>4} ({}.{} acq/gw)",
                        self.admitted_in(r, sec),
                        per / 10,
                        per % 10
                    )
                })
                .collect();
            println!("{label} s{sec:>2}: {}", line.join("  "));
        }
    }
}

/// Story part c on a fresh key (as [`skew_on_a_fresh_key_reaches_eu_west_demand_within_three_seconds`])
/// with every gateway asking rates as the agent does with `rate_leases: true`, invariants
/// checked after every command; prints eu-west's admitted per second and the Acquires per
/// gateway with lumps and with rates (`--nocapture`).
fn skew_run(rates: bool) -> Driver {
    let mut d = skewed(false);
    d.rates = rates;
    d.checked = true;
    d.run(10_000);
    d.table(if rates { "rates" } else { "lumps" }, 0..10);
    d
}

#[test]
fn skew_with_rates_reaches_eu_west_demand_within_three_seconds_at_one_acquire_a_second() {
    let d = skew_run(true);
    d.holds("eu-west", 640, 3..10);
    assert!(d.admitted() <= 1000 + 10 * 1000, "{}", d.admitted());
    // At steady state each gateway renews once per report interval: one Raft entry of lease
    // traffic a second (issue 9), where lumps under scarcity cost more.
    for sec in 3..10 {
        for r in ["eu-west", "us-east"] {
            let (n, _) = d.acquires_in(r, sec);
            assert!(
                n <= 3 + 1,
                "{r} sent {n} Acquires over 3 gateways in second {sec}"
            );
        }
    }
    let lumps = skew_run(false);
    let per_gw = |d: &Driver| -> u64 { (3..10).map(|s| d.acquires_in("eu-west", s).0).sum() };
    assert!(
        per_gw(&d) < per_gw(&lumps),
        "{} vs {}",
        per_gw(&d),
        per_gw(&lumps)
    );
}

/// Rates ramp as fast as lumps (issue 9, skew with rates): eu-west is at ≥ 640/s from its
/// second second on. Before a holder's want counted in the division of a region's rate, the
/// first two eu-west gateways took its whole rate before the third had a measured demand, and
/// eu-west admitted 627 and 601 in seconds 1 and 2 (design §9).
#[test]
fn skew_with_rates_is_at_eu_west_demand_from_the_first_second_as_lumps_are() {
    let lumps = skew_run(false);
    lumps.holds("eu-west", 640, 0..10);
    let d = skew_run(true);
    d.holds("eu-west", 640, 1..10);
}

#[test]
fn a_region_deciding_centrally_keeps_a_part_that_covers_its_rate_of_decisions() {
    // acme with eu-west offered 7/s and, from 0.3 s, us-east 4/s over three gateways each; at
    // 1.3/s a gateway never admits the 4 tokens within a lease that would promote it, so
    // us-east's demand shows only as central decisions (issue 9 item 5). Its part must cover
    // that demand (40 % of the contract) once the key is no longer fresh, so the tokens it
    // uses are its own and not borrowed from a hungry eu-west; a decision counted as its cost
    // over a lease claimed 33.75 % and stayed there.
    let mut d = acme(true);
    d.offer("eu-west", 7);
    d.run(300);
    d.offer("us-east", 4);
    d.run(3_000);
    let us_part = |d: &Driver| {
        let ks = d.ledger.keys.values().next().expect("the key");
        ks.parts.effective("us-east")
    };
    for _ in 0..28 {
        d.run(250);
        let part = us_part(&d);
        assert!(
            part >= 400_000,
            "us-east's part {part} ppm at +{} ms",
            d.now - T0
        );
    }
    assert!(d.admitted() <= 40 + 10 * 10, "{}", d.admitted());
    for sec in 2..10 {
        assert_eq!(d.admitted_in("us-east", sec), 4, "us-east in second {sec}");
    }
}
