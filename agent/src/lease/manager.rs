//! The lease path in the background (seed §21–23, issue 9 items 2–3): acquire allocations sized
//! from demand, report cumulative spend every interval, release finished allocations with their
//! final spend, prefetch below the low watermark, decide central keys' requests, promote and
//! demote keys, and release everything on shutdown.
//!
//! Work is queued ([`WorkQueue`]: urgent Decides and Acquires, routine Reports and Releases) and
//! sent in `Batch` calls ([`Dispatcher`]), up to [`MAX_CALLS_IN_FLIGHT`] at once: at once while a
//! call slot is free (a lone request pays one round trip), else with everything queued meanwhile
//! when a call returns — so a tick's reports and releases for every key travel in one `Batch`,
//! and the Decides and Acquires of concurrent requests share calls without waiting behind a
//! whole previous call's round trip and commit. One call slot is kept for urgent work (call
//! slots are allocator calls, not the concurrency slots of `max_in_flight`:
//! [`slots`](crate::slots)). After a call no allocator answered, the next waits a jittered,
//! growing backoff ([`Backoff`]).

use super::allocation::HeldAllocation;
use super::backoff::Backoff;
use super::book::{ms, AcquireWhy, KeyLease, LeaseBook, LeaseEvent};
use super::client::AllocatorLink;
use super::client::CallError;
use super::close::close_all;
use super::dispatch::{Answer, Dispatcher, MAX_BATCH_ITEMS, MAX_CALLS_IN_FLIGHT};
use super::queue::{Pending, WorkQueue};
use super::settings::LeaseSettings;
use allot_common::keyed::{Keyed, ShardedTable};
use allot_common::units::{per_second, Micros, Nanos, MICROS_PER_TOKEN};
use allot_proto::allot::v1 as pb;
use parking_lot::Mutex;
use pb::batch_item::Op;
use pb::batch_result::Outcome;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

/// When sending resumes after a call no allocator answered. `generation` counts the pauses:
/// a call carries the generation it was sent in, and only a failure of a call sent since the
/// last pause began grows the backoff (calls in flight when it began fail for the same outage).
#[derive(Debug, Default)]
struct Pause {
    until: Option<tokio::time::Instant>,
    generation: u64,
}

/// Runs the lease path of one agent.
pub struct LeaseManager {
    book: Arc<LeaseBook>,
    dispatcher: Dispatcher,
    request_seq: AtomicU64,
    /// Time of the previous maintenance pass, ns (demand is measured over the real interval).
    last_pass: AtomicU64,
    queue: Mutex<WorkQueue>,
    backoff: Mutex<Backoff>,
}

impl LeaseManager {
    /// A manager for `book`, talking to the allocator through `link`.
    pub fn new(book: Arc<LeaseBook>, link: Arc<AllocatorLink>) -> Self {
        let s = book.settings();
        let timeout = Duration::from_millis(s.call_timeout_ms);
        let backoff = Backoff::new(s.error_backoff_ms, s.backoff_seed);
        LeaseManager {
            dispatcher: Dispatcher::new(link, timeout),
            book,
            request_seq: AtomicU64::new(0),
            last_pass: AtomicU64::new(0),
            queue: Mutex::default(),
            backoff: Mutex::new(backoff),
        }
    }

    /// Serves lease events and runs maintenance every report interval until `shutdown` turns
    /// true (or every sender is gone); then releases every allocation with its final spend.
    /// Up to [`MAX_CALLS_IN_FLIGHT`] calls are in flight at once, one call slot kept for urgent
    /// work (Decides, Acquires): a decision never waits behind another call's round trip.
    pub async fn run(
        self,
        mut events: mpsc::UnboundedReceiver<LeaseEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let me = Arc::new(self);
        let period = Duration::from_millis(me.book.settings().report_interval_ms.max(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut calls: JoinSet<(u64, bool)> = JoinSet::new();
        let mut pause = Pause::default();
        loop {
            if pause.until.is_none() {
                me.launch(&mut calls, pause.generation);
            }
            // Polled in this order, not at random (`biased`): a run on simulated time makes the
            // same choice every time (issue 12). Nothing starves: answers are at most
            // MAX_CALLS_IN_FLIGHT, the tick and the pause fire once per period.
            tokio::select! {
                biased;
                r = shutdown.changed() => {
                    if r.is_err() || *shutdown.borrow() {
                        break;
                    }
                }
                Some(done) = calls.join_next(), if !calls.is_empty() => {
                    let (sent_in, up) = done.unwrap_or((pause.generation, false));
                    me.after_send(&mut pause, sent_in, up);
                }
                _ = tick.tick() => me.collect(),
                _ = async { tokio::time::sleep_until(pause.until.expect("guarded")).await }, if pause.until.is_some() => {
                    pause.until = None;
                }
                ev = events.recv() => match ev {
                    Some(ev) => me.enqueue(ev),
                    None => break,
                },
            }
        }
        // Nothing queued from now on is sent: decisions stop waiting for calls.
        me.book.stop_leasing();
        while calls.join_next().await.is_some() {}
        me.release_all().await;
    }

    /// Starts calls for the queued work while a call slot is free; a call of routine work
    /// only (Reports, Releases) never takes the last call slot. `generation`: the current
    /// pause count.
    fn launch(self: &Arc<Self>, calls: &mut JoinSet<(u64, bool)>, generation: u64) {
        while calls.len() < MAX_CALLS_IN_FLIGHT {
            let routine = calls.len() + 1 < MAX_CALLS_IN_FLIGHT;
            let batch = self.queue.lock().take(MAX_BATCH_ITEMS, routine);
            if batch.is_empty() {
                return;
            }
            let m = self.clone();
            calls.spawn(async move { (generation, m.send(batch).await) });
        }
    }

    /// The backoff after a call sent in pause generation `sent_in`: an answered call ends any
    /// pause; an unanswered one sent since the last pause began starts a new, longer one.
    fn after_send(&self, pause: &mut Pause, sent_in: u64, up: bool) {
        let mut b = self.backoff.lock();
        if up {
            b.succeeded();
            pause.until = None;
        } else if sent_in == pause.generation {
            pause.generation = pause.generation.wrapping_add(1);
            pause.until = Some(tokio::time::Instant::now() + b.failed());
        }
    }

    fn enqueue(&self, ev: LeaseEvent) {
        let p = match ev {
            LeaseEvent::Acquire(kl) => Pending::Acquire(kl),
            LeaseEvent::Decide(kl, cost, done) => Pending::Decide(kl, cost, done),
        };
        self.queue.lock().push(p);
    }

    /// Queues a Report or Release unless one of its allocation is queued or in flight.
    fn enqueue_allocation(&self, p: Pending) {
        self.queue.lock().push(p);
    }

    /// One maintenance pass, sent at once: every key's demand, reports, releases, prefetch,
    /// demotion and eviction, in as few calls as the queue needs (one `Batch` per
    /// [`MAX_BATCH_ITEMS`]); returns when every answer is applied. The background loop does
    /// the same every report interval without waiting.
    pub async fn maintain(&self) {
        self.collect();
        while !self.queue.lock().is_empty() {
            self.send_once().await;
        }
    }

    /// Queues every key's maintenance work (no network).
    fn collect(&self) {
        let now = self.book.clock().now();
        let prev = self.last_pass.swap(now, Ordering::Relaxed);
        let elapsed = if prev == 0 {
            0
        } else {
            now.saturating_sub(prev)
        };
        let tables = self.book.tables();
        for kl in in_key_order(&tables) {
            measure(&kl.value, elapsed, ms(kl.value.sizing.ttl_ms().max(1)));
            self.settle_key(&kl, now);
        }
        // Keys of rules no longer leased: every allocation is finished (see
        // `LeaseBook::retired_tables`).
        for kl in in_key_order(&self.book.retired_tables()) {
            self.settle_allocations(&kl, now, |_| true);
        }
        for table in tables {
            let idle = ms(self.book.settings().idle_evict_ms);
            table.retain(|k| {
                let v = &k.value;
                !(v.allocations().is_empty()
                    && !v.protocol.call_in_flight()
                    && now.saturating_sub(v.last_used.load(Ordering::Relaxed)) > idle)
            });
        }
    }

    /// Queues a Release for each allocation of the key that is `finished`, a Report for each
    /// other one with unreported spend; drops a finished one the allocator must have expired by
    /// now (never released: it was unreachable).
    fn settle_allocations(
        &self,
        kl: &Arc<Keyed<KeyLease>>,
        now: Nanos,
        finished: impl Fn(&HeldAllocation) -> bool,
    ) {
        let dead_after = ms(self.book.settings().drift_margin_ms).saturating_mul(4);
        for a in kl.value.allocations().iter() {
            if !finished(a) {
                if a.spent() > a.reported() {
                    self.enqueue_allocation(Pending::Report(kl.clone(), a.clone()));
                }
            } else if now >= a.deadline.saturating_add(dead_after) {
                kl.value.protocol.remove(a.id);
            } else {
                self.enqueue_allocation(Pending::Release(kl.clone(), a.clone()));
            }
        }
    }

    /// Queues reports and releases for one key, drops allocations the allocator must have
    /// expired, returns what an idle key holds, demotes a cooled key, and prefetches.
    fn settle_key(&self, kl: &Arc<Keyed<KeyLease>>, now: Nanos) {
        let v = &kl.value;
        let idle = idle_for_return(self.book.settings(), v, now);
        // An idle key's allocations are released early (issue 9 item 6): closed when the
        // Release is composed, so what they did not spend is grantable elsewhere now rather
        // than at expiry.
        self.settle_allocations(kl, now, |a| {
            a.is_expired(now)
                || a.spent() >= a.granted
                || a.is_closed()
                || idle
                || a.spent_all_it_can(now)
        });
        if self.book.is_central(v) {
            // A central key's answers are Decides, not grants: it has not settled.
            v.settled_passes.store(0, Ordering::Relaxed);
            return;
        }
        let period = ms(v.sizing.ttl_ms().max(1));
        // The offered load, not admissions alone: a leased key denied under scarcity is in
        // demand, and sending it back to central decisions would turn every request into a
        // `Decide` just when the allocator has least to give.
        let offered = v.offered();
        let thresholds = self.book.thresholds();
        if !thresholds.always_leased() && v.demand.demote_due(now, period, offered, thresholds) {
            v.protocol.set_leased(false);
            self.book.counters.demotions.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Queued here, not through the event channel: the prefetch travels in the same `Batch`
        // as this pass's reports, one call (one Raft entry) per agent per tick (issue 9).
        if prefetch_due(&self.book, v, now) && self.book.claim_acquire(kl, now) {
            self.book.counters.acquire_queued(AcquireWhy::Prefetch);
            self.queue.lock().push(Pending::Acquire(kl.clone()));
        }
    }

    /// Sends up to [`MAX_BATCH_ITEMS`] queued items in one call, urgent work first, and
    /// applies the answers; true when an allocator answered.
    async fn send_once(&self) -> bool {
        let batch = self.queue.lock().take(MAX_BATCH_ITEMS, true);
        self.send(batch).await
    }

    /// Sends `batch` in one call and applies the answers; true when an allocator answered.
    async fn send(&self, batch: Vec<Pending>) -> bool {
        if batch.is_empty() {
            return true;
        }
        let sent_at = self.book.clock().now();
        let ops: Vec<Op> = batch.iter().map(|p| self.compose(p, sent_at)).collect();
        self.book.counters.calls.fetch_add(1, Ordering::Relaxed);
        let (answers, up) = self.dispatcher.send(&ops).await;
        for ((p, op), a) in batch.into_iter().zip(ops).zip(answers) {
            let settled = p.allocation_id();
            self.apply(p, &op, a, sent_at);
            if let Some(id) = settled {
                self.queue.lock().settle(id);
            }
        }
        up
    }

    /// The request of one queued item, as it stands at `sent_at`.
    fn compose(&self, p: &Pending, sent_at: Nanos) -> Op {
        let c = &self.book.counters;
        let s = self.book.settings();
        match p {
            Pending::Acquire(kl) => {
                c.acquires.fetch_add(1, Ordering::Relaxed);
                let v = &kl.value;
                // The allocator ends the accrual of the key's earlier allocations when it
                // applies this Acquire; they stop accruing here first (design §9).
                v.allocations()
                    .iter()
                    .for_each(|a| a.freeze_accrual(sent_at));
                let (want, want_rate_per_s) = want(v, s, v.protocol.take_waiting());
                Op::Acquire(pb::AcquireRequest {
                    key: Some(policy_key(v)),
                    region: s.region.clone(),
                    holder: s.agent_id.clone(),
                    want,
                    demand_per_s: v.demand_per_s.load(Ordering::Relaxed),
                    request_id: self.request_id(sent_at),
                    want_rate_per_s,
                })
            }
            Pending::Report(_, a) => {
                c.reports.fetch_add(1, Ordering::Relaxed);
                Op::Report(pb::ReportRequest {
                    allocation_id: a.id,
                    epoch: a.epoch,
                    cumulative_spend: a.spend_to_report(),
                    holder: s.agent_id.clone(),
                    incarnation: a.incarnation,
                })
            }
            Pending::Release(_, a) => {
                c.releases.fetch_add(1, Ordering::Relaxed);
                // Closed first: a spend racing the Release is either in its final spend or
                // refused (issue 10 item 3).
                Op::Release(pb::ReleaseRequest {
                    allocation_id: a.id,
                    epoch: a.epoch,
                    final_spend: a.close(),
                    holder: s.agent_id.clone(),
                    incarnation: a.incarnation,
                })
            }
            Pending::Decide(kl, cost, _) => {
                c.decides.fetch_add(1, Ordering::Relaxed);
                Op::Decide(pb::DecideRequest {
                    key: Some(policy_key(&kl.value)),
                    region: s.region.clone(),
                    holder: s.agent_id.clone(),
                    cost: *cost,
                    request_id: self.request_id(sent_at),
                })
            }
        }
    }

    fn request_id(&self, sent_at: Nanos) -> String {
        let seq = self.request_seq.fetch_add(1, Ordering::Relaxed);
        format!("{}-{}-{}", self.book.settings().agent_id, sent_at, seq)
    }

    /// Applies one answer to the key of its item (`op`: the request it answers).
    fn apply(&self, p: Pending, op: &Op, answer: Answer, sent_at: Nanos) {
        let book = &*self.book;
        let now = book.clock().now();
        let v = &p.key().value;
        match &answer {
            // Only a call that brings tokens decides the key's standing: a request of an
            // exhausted key waits for its own Acquire rather than inherit a failed Report.
            Answer::Failed(why)
                if why.is_transient() && matches!(p, Pending::Acquire(_) | Pending::Decide(..)) =>
            {
                tracing::debug!(domain = %v.domain, why = %why, "allocator unreachable");
                unreachable(book, v, now);
            }
            Answer::Failed(why) if why.is_transient() => {
                tracing::debug!(domain = %v.domain, why = %why, "allocator unreachable");
                book.set_reachable(false);
                book.counters.rpc_errors.fetch_add(1, Ordering::Relaxed);
            }
            Answer::Failed(CallError::Unsupported) => {}
            Answer::Done(_) | Answer::Failed(_) => book.set_reachable(true),
        }
        match p {
            Pending::Acquire(kl) => {
                let asked = match op {
                    Op::Acquire(r) => r.want,
                    _ => 0,
                };
                applied_acquire(book, &kl.value, asked, answer, sent_at, now)
            }
            Pending::Report(kl, a) => applied_report(&kl.value, &a, answer),
            Pending::Release(kl, a) => applied_release(&kl.value, &a, answer),
            Pending::Decide(kl, cost, done) => {
                applied_decide(book, &kl.value, cost, answer, now);
                let _ = done.send(());
            }
        }
    }

    /// Releases every allocation with its final spend (graceful shutdown), in as few calls as
    /// the queue needs; each allocation is tried once. Every allocation is closed before any
    /// final spend is read or sent, so requests still being decided can spend nothing the
    /// Releases do not carry (issue 10 item 3).
    pub async fn release_all(&self) {
        close_all(&self.book);
        self.queue.lock().clear();
        let tables = self.book.all_tables();
        for table in &tables {
            for kl in table.snapshot() {
                for a in kl.value.allocations().iter() {
                    self.enqueue_allocation(Pending::Release(kl.clone(), a.clone()));
                }
            }
        }
        while !self.queue.lock().is_empty() {
            self.send_once().await;
        }
        for table in tables {
            for kl in table.snapshot() {
                let w = kl.value.protocol.lock_writes();
                kl.value.protocol.replace(&w, Vec::new());
            }
        }
    }
}

/// The keys of `tables` in key order, not the tables' (randomly seeded) hash order: the work
/// is queued, and allocation ids assigned, in the same order on every run of a simulation
/// (issue 12).
fn in_key_order(tables: &[Arc<ShardedTable<KeyLease>>]) -> Vec<Arc<Keyed<KeyLease>>> {
    let mut keys: Vec<_> = tables.iter().flat_map(|t| t.snapshot()).collect();
    keys.sort_by(|a, b| (&a.value.domain, a.key()).cmp(&(&b.value.domain, b.key())));
    keys
}

/// Measures the key's demand over the last pass (`elapsed` ns), µtokens per second: the load
/// offered here (admitted and finally denied), smoothed by [`smoothed`] over a lease
/// (`lease_ns`).
pub(super) fn measure(v: &KeyLease, elapsed: Nanos, lease_ns: Nanos) {
    let offered = v.offered();
    let before = v.prev_offered.swap(offered, Ordering::Relaxed);
    if elapsed > 0 {
        let denied = v.denied_cost.load(Ordering::Relaxed);
        let denied_before = v.prev_denied.swap(denied, Ordering::Relaxed);
        let sample = per_second(offered.saturating_sub(before), elapsed);
        count_settled(v, sample, denied > denied_before);
        let old = v.demand_per_s.load(Ordering::Relaxed);
        v.demand_per_s
            .store(smoothed(old, sample, elapsed, lease_ns), Ordering::Relaxed);
    }
}

/// Counts a pass towards [`settled_scarcity`]: one more when the key was offered at least
/// [`SETTLED_HOT_TOKENS`] a second (`sample`, µtok/s) over it, its last answer was short,
/// nothing of it was `denied` here and its rule can carry rates (a bucket); else the count
/// starts over. A central key's count is reset at each pass (`settle_key`).
fn count_settled(v: &KeyLease, sample: u64, denied: bool) {
    let hot = sample >= SETTLED_HOT_TOKENS * MICROS_PER_TOKEN;
    if hot && !denied && v.protocol.last_grant_short() && v.sizing.carries_rates() {
        v.settled_passes.fetch_add(1, Ordering::Relaxed);
    } else {
        v.settled_passes.store(0, Ordering::Relaxed);
    }
}

/// The next demand estimate from the last one (`old`) and a pass's measurement (`sample`),
/// both µtokens per second, over a pass of `elapsed` ns and a lease of `lease_ns`: a rise is
/// taken at once (a key asks for what it is offered before its requests are denied), a fall
/// moves `elapsed / lease` of the way (a pass of a sparse key that saw no request does not halve
/// its next grant; the grant follows a real drop within a lease).
fn smoothed(old: u64, sample: u64, elapsed: Nanos, lease_ns: Nanos) -> u64 {
    if sample >= old || elapsed >= lease_ns {
        return sample;
    }
    let drop = u128::from(old - sample) * u128::from(elapsed) / u128::from(lease_ns.max(1));
    old - u64::try_from(drop).unwrap_or(old - sample)
}

/// Whether key `v` decided nothing for `idle_return_ms` (0: never idle), so its allocations go
/// back to the allocator early (issue 9 item 6).
fn idle_for_return(s: &LeaseSettings, v: &KeyLease, now: Nanos) -> bool {
    s.idle_return_ms > 0
        && now.saturating_sub(v.last_used.load(Ordering::Relaxed)) >= ms(s.idle_return_ms)
}

/// Prefetch when what is left will not last until the next pass, or when every allocation
/// ends before the pass after next (tokens left at the deadline are of no use).
fn prefetch_due(book: &LeaseBook, v: &KeyLease, now: Nanos) -> bool {
    let demand = v.demand_per_s.load(Ordering::Relaxed);
    if demand == 0 {
        return false;
    }
    let interval = ms(book.settings().report_interval_ms);
    // What accrues until the next pass counts as left (design §9).
    let left: Micros = v
        .allocations()
        .iter()
        .map(|a| a.remaining_by(now, interval))
        .fold(0, u64::saturating_add);
    let last_deadline = v
        .allocations()
        .iter()
        .map(|a| a.deadline)
        .max()
        .unwrap_or(0);
    let need_soon = v.demand_over(interval);
    let watermark = u64::try_from(
        u128::from(v.sizing.max_grant()) * u128::from(book.settings().low_watermark_pct) / 100,
    )
    .unwrap_or(u64::MAX);
    let ending = last_deadline.saturating_sub(now) < interval.saturating_mul(2);
    left < need_soon.max(watermark) || ending
}

fn policy_key(v: &KeyLease) -> pb::PolicyKey {
    pb::PolicyKey {
        domain: v.domain.clone(),
        entries: v
            .entries
            .iter()
            .map(|(k, val)| pb::DescriptorEntry {
                key: k.clone(),
                value: val.clone(),
            })
            .collect(),
    }
}

/// A call for key `v` found the allocator unreachable at `now`: the key follows its failure
/// mode until the error backoff ends (reachability is per key: another key's failure never
/// decides this one's).
fn unreachable(book: &LeaseBook, v: &KeyLease, now: Nanos) {
    book.set_reachable(false);
    book.counters.rpc_errors.fetch_add(1, Ordering::Relaxed);
    v.protocol
        .record_failure(now.saturating_add(ms(book.settings().error_backoff_ms)));
}

/// What to ask for: (tokens now, rate), microtokens and microtokens per second. A key with no
/// measured demand asks the policy's max grant now and no rate. A key with demand d asks d over
/// one lease plus 25% headroom now; with `rate_leases`, when the allocator's last answer was
/// short or a report interval's demand is above half the max grant, the rate d plus 25%
/// instead, and now only d over one report interval plus 25% (design §9: the rate accrues while
/// the lease lasts, so a steady key renews once per report interval whatever its rate). At least what the
/// decisions waiting for this call cost together (`waiting`), at least one token and at most
/// the policy's max grant.
pub(super) fn want(v: &KeyLease, s: &LeaseSettings, waiting: Micros) -> (Micros, u64) {
    let demand = v.demand_per_s.load(Ordering::Relaxed);
    let max_grant = v.sizing.max_grant();
    let headroom = |x: u128| u64::try_from(x * 5 / 4).unwrap_or(u64::MAX);
    let over = |ms: u64| headroom(u128::from(demand) * u128::from(ms) / 1000);
    // A rate pays where lumps would be small or many: under scarcity (the last answer was short
    // of the ask, so lumps come one bucketful at a time) or when a report interval's demand is a
    // large part of the max grant (a lump per lease would not cover it).
    let rated = (s.rate_leases
        && (v.protocol.last_grant_short() || over(s.report_interval_ms) > max_grant / 2))
        || settled_scarcity(v, s, demand);
    let (now, rate) = match (demand, rated) {
        (0, _) => (max_grant, 0),
        (_, false) => (over(v.sizing.ttl_ms()), 0),
        (_, true) => (over(s.report_interval_ms), headroom(u128::from(demand))),
    };
    let now = now
        .max(waiting)
        .clamp(MICROS_PER_TOKEN, max_grant.max(MICROS_PER_TOKEN));
    (now, rate)
}

/// Tokens a second a key must be offered here to count as hot for [`settled_scarcity`] (64
/// tokens over the default 1-s pass): a key this hot makes a lump Acquire per pass and more
/// between passes under scarcity.
pub(crate) const SETTLED_HOT_TOKENS: u64 = 64;

/// Whether `v` asks for a rate without `rate_leases` (`settled_rates`, on by default, design
/// §9 "Rates where scarcity has settled"): a hot key (its measured demand, `demand_per_s`
/// µtok/s, at least [`SETTLED_HOT_TOKENS`] tokens a second) of a bucket rule that the allocator
/// keeps short (its last answer was below the ask) and that had nothing denied here, for
/// [`SETTLED_PASSES`] passes running. That is a key served at about the rate it asks, where
/// lumps cost an Acquire at every pass and another between passes (issue 9, lease traffic at
/// 1000/s), and a rate renews once a pass. A key denied here (demand beyond what it gets, the
/// top Zipf tenants) keeps lumps, which measured better there; a rate that starts denying
/// (accrual) returns the key to lumps at the next pass.
fn settled_scarcity(v: &KeyLease, s: &LeaseSettings, demand_per_s: u64) -> bool {
    s.settled_rates
        && demand_per_s >= SETTLED_HOT_TOKENS * MICROS_PER_TOKEN
        && v.protocol.last_grant_short()
        && v.settled_passes.load(Ordering::Relaxed) >= SETTLED_PASSES
}

/// Passes a key must stay settled before it asks for a rate: a ramp (demand rising past what
/// the key gets) is served by lumps, which follow it sooner.
pub(super) const SETTLED_PASSES: u64 = 3;

/// How a new grant of `granted` µtok for `v` is spent, as (pace ns, µtok at once; see
/// [`HeldAllocation::paced`]): when it is `short` of its ask, the previous answer was short too
/// and the key's denied requests differ in cost ([`CostMix`]), over the short-grant hold `hold`
/// (ns), the key's next ask, with all but one hold's refill of the rule's rate at once (at
/// least one token); spent at once otherwise (a pace of 0).
///
/// Short again, the grant is mostly what the allocator's bucket refilled since the last ask,
/// which the central counter would have handed out as it came; anything beyond one hold's
/// refill gathered over a pause or a longer denial, and a burst may take it at once there too.
///
/// [`CostMix`]: super::cost_mix::CostMix
fn pace_of(v: &KeyLease, short: bool, hold: Nanos, granted: Micros) -> (Nanos, Micros) {
    if !(short && v.protocol.last_grant_short() && v.denied_mix.differs()) {
        return (0, granted);
    }
    let refill = v.sizing.refill_over(hold);
    (hold, granted.saturating_sub(refill).max(MICROS_PER_TOKEN))
}

/// An Acquire's answer: install the grant (its lease measured from when the request was sent,
/// minus the drift margin, so the agent stops spending before the allocator can consider it
/// expired), remember a denial, or back off. A grant below what the Acquire `asked` (µtokens)
/// is all the allocator had for this holder (its bucket, fair part, region share or calendar
/// quota ran out): the rest is denied for [`LeaseSizing::short_grant_hold_ns`] (an eighth of
/// the bucket's fill time, at most an eighth of a report interval), so the requests it does not cover
/// are denied at once, as the central counter denies them, and the next ask finds a lump worth
/// a Raft entry instead of one token. A grant short again may be spent at a pace over that
/// hold ([`pace_of`]).
///
/// [`LeaseSizing::short_grant_hold_ns`]: super::key_rule::LeaseSizing::short_grant_hold_ns
fn applied_acquire(
    book: &LeaseBook,
    v: &KeyLease,
    asked: Micros,
    answer: Answer,
    sent_at: Nanos,
    now: Nanos,
) {
    let s = book.settings();
    let backoff_end = now.saturating_add(ms(s.error_backoff_ms));
    match answer {
        Answer::Done(Outcome::Acquire(pb::AcquireResponse {
            outcome: Some(pb::acquire_response::Outcome::Grant(g)),
        })) => {
            v.protocol.record_reachable();
            let deadline = sent_at
                .saturating_add(ms(g.ttl_ms))
                .saturating_sub(ms(s.drift_margin_ms));
            // Grants are whole tokens: only a grant below the whole tokens asked is short.
            let short = g.granted < asked - asked % MICROS_PER_TOKEN;
            let hold = v.sizing.short_grant_hold_ns(ms(s.report_interval_ms));
            let (pace, at_once) = pace_of(v, short, hold, g.granted);
            let a = HeldAllocation::new(
                g.allocation_id,
                g.epoch,
                g.granted,
                deadline,
                g.expires_at_unix_ms,
                g.policy_version,
            )
            .with_incarnation(g.incarnation)
            .with_rate(g.rate_per_s, now, g.promised)
            .paced(now, pace, at_once)
            .with_reserve(v.sizing.emergency_reserve(g.granted, s.emergency_ppm));
            let denied_until = if short { now.saturating_add(hold) } else { 0 };
            v.protocol.install_answer(Arc::new(a), denied_until, short);
        }
        Answer::Done(Outcome::Acquire(pb::AcquireResponse {
            outcome: Some(pb::acquire_response::Outcome::Denial(d)),
        })) => record_denial(v, d.retry_after_ms.max(1), d.handoff_ms, now),
        // Already recorded as a failure of this key (failure mode until the backoff ends).
        Answer::Failed(e) if e.is_transient() => {}
        other => {
            // Refused (bad key, unknown policy, cap reached) or an answer without a grant or
            // denial: the allocator is up, so a denial for the backoff, never the failure mode.
            tracing::warn!(domain = %v.domain, answer = ?other, "acquire refused");
            v.protocol.record_denial(backoff_end);
        }
    }
}

/// Records the allocator's denial of `v` at `now`: denied for `wait_ms`, or until its handoff
/// hint `handoff_ms` when that is sooner (then the decisions that waited may ask again; see
/// [`KeyProtocol::handoff_at`](super::protocol::KeyProtocol::handoff_at)).
fn record_denial(v: &KeyLease, wait_ms: u64, handoff_ms: u64, now: Nanos) {
    if handoff_ms > 0 && handoff_ms < wait_ms {
        v.protocol
            .record_handoff_denial(now.saturating_add(ms(handoff_ms)));
    } else {
        v.protocol.record_denial(now.saturating_add(ms(wait_ms)));
    }
}

/// A Report's answer: the recorded spend, or drop a fenced allocation.
fn applied_report(v: &KeyLease, a: &HeldAllocation, answer: Answer) {
    match answer {
        Answer::Done(Outcome::Report(r)) => {
            v.protocol.record_reachable();
            a.set_reported(r.recorded_spend);
        }
        Answer::Failed(CallError::Fenced { why, .. }) => {
            // The allocator no longer knows it as live (ended, stale, another holder's): stop.
            tracing::warn!(allocation = a.id, ?why, "allocation fenced; dropping it");
            v.protocol.remove(a.id);
        }
        other => tracing::debug!(allocation = a.id, answer = ?other, "report not recorded"),
    }
}

/// A Release's answer: the allocation is gone, or kept to release again (unreachable).
fn applied_release(v: &KeyLease, a: &HeldAllocation, answer: Answer) {
    match answer {
        Answer::Done(Outcome::Release(r)) => {
            v.protocol.record_reachable();
            // `close` is idempotent: the final spend the Release carried.
            a.set_reported(a.close());
            tracing::debug!(allocation = a.id, returned = r.returned, "released");
            v.protocol.remove(a.id);
        }
        Answer::Failed(CallError::Fenced { .. }) => v.protocol.remove(a.id),
        other => tracing::debug!(allocation = a.id, answer = ?other, "release not recorded"),
    }
}

/// A Decide's answer: the admitted cost becomes the key's credit for the waiting request; a
/// denial is remembered until its retry time; an allocator without `Decide` turns central
/// decisions off (the request then leases).
fn applied_decide(book: &LeaseBook, v: &KeyLease, cost: Micros, answer: Answer, now: Nanos) {
    let s = book.settings();
    match answer {
        Answer::Done(Outcome::Decide(d)) if d.allowed => {
            v.protocol.record_reachable();
            // Usable for the drift margin: the waiting request re-decides at once.
            v.protocol.add_central_credit(
                cost,
                d.remaining,
                now.saturating_add(ms(s.drift_margin_ms.max(1))),
            );
        }
        Answer::Done(Outcome::Decide(d)) => {
            let wait = if d.never {
                s.retry_floor_ms
            } else {
                d.retry_after_ms.max(1)
            };
            record_denial(v, wait, d.handoff_ms, now);
        }
        Answer::Failed(CallError::Unsupported) => book.central_unsupported(),
        Answer::Failed(e) if e.is_transient() => {}
        other => {
            tracing::warn!(domain = %v.domain, answer = ?other, "decide refused");
            v.protocol
                .record_denial(now.saturating_add(ms(s.error_backoff_ms)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::smoothed;

    const LEASE: u64 = 5_000_000_000;
    const PASS: u64 = 1_000_000_000;

    #[test]
    fn demand_rises_at_once_and_falls_over_a_lease() {
        assert_eq!(smoothed(10, 50, PASS, LEASE), 50, "a rise is taken at once");
        // A fall of 50 moves a fifth of the way per one-second pass of a five-second lease.
        assert_eq!(smoothed(60, 10, PASS, LEASE), 50);
        assert_eq!(smoothed(50, 0, PASS, LEASE), 40);
        // A pass as long as the lease (or longer) takes the sample as it is.
        assert_eq!(smoothed(60, 10, LEASE, LEASE), 10);
        assert_eq!(smoothed(60, 10, u64::MAX, LEASE), 10);
        // Extremes: no overflow, never below the sample, never above the old value.
        assert_eq!(smoothed(u64::MAX, 0, PASS, LEASE), u64::MAX - u64::MAX / 5);
        assert_eq!(smoothed(u64::MAX, 0, u64::MAX - 1, u64::MAX), 1);
        assert_eq!(smoothed(7, 3, PASS, 0), 3, "a zero lease takes the sample");
    }
}
