//! The lease path in the background (seed §21–23): acquire allocations sized from demand,
//! report cumulative spend every interval, release finished allocations with their final spend,
//! prefetch below the low watermark, and release everything on shutdown.

use super::allocation::HeldAllocation;
use super::book::{ms, KeyLease, LeaseBook, LeaseEvent};
use super::client::AllocatorLink;
use super::close::close_all;
use allot_common::keyed::Keyed;
use allot_common::units::{Micros, Nanos, MICROS_PER_TOKEN, NANOS_PER_SEC};
use allot_proto::allot::v1 as pb;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tonic::Code;

/// Runs the lease path of one agent.
pub struct LeaseManager {
    book: Arc<LeaseBook>,
    link: Arc<AllocatorLink>,
    request_seq: Arc<AtomicU64>,
    /// Time of the previous maintenance pass, ns (demand is measured over the real interval).
    last_pass: AtomicU64,
}

impl LeaseManager {
    /// A manager for `book`, talking to the allocator through `link`.
    pub fn new(book: Arc<LeaseBook>, link: Arc<AllocatorLink>) -> Self {
        LeaseManager {
            book,
            link,
            request_seq: Arc::new(AtomicU64::new(0)),
            last_pass: AtomicU64::new(0),
        }
    }

    /// Serves lease events and runs maintenance every report interval until `shutdown` turns
    /// true (or every sender is gone); then releases every allocation with its final spend.
    pub async fn run(
        self,
        mut events: mpsc::UnboundedReceiver<LeaseEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let period = Duration::from_millis(self.book.settings().report_interval_ms.max(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut acquires = JoinSet::new();
        loop {
            tokio::select! {
                ev = events.recv() => match ev {
                    Some(LeaseEvent::Acquire(kl)) => {
                        let (book, link, seq) = (self.book.clone(), self.link.clone(), self.request_seq.clone());
                        acquires.spawn(async move { acquire(&book, &link, &seq, &kl).await });
                    }
                    None => break,
                },
                _ = tick.tick() => self.maintain().await,
                Some(_) = acquires.join_next(), if !acquires.is_empty() => {}
                r = shutdown.changed() => {
                    if r.is_err() || *shutdown.borrow() {
                        break;
                    }
                }
            }
        }
        acquires.shutdown().await;
        self.release_all().await;
    }

    /// One maintenance pass over every key: demand, reports, releases, prefetch, eviction.
    pub async fn maintain(&self) {
        let now = self.book.clock().now();
        let prev = self.last_pass.swap(now, Ordering::Relaxed);
        let elapsed = if prev == 0 {
            0
        } else {
            now.saturating_sub(prev)
        };
        let mut work = JoinSet::new();
        for table in self.book.tables() {
            for kl in table.snapshot() {
                let v = &kl.value;
                let admitted = v.admitted.load(Ordering::Relaxed);
                let before = v.prev_admitted.swap(admitted, Ordering::Relaxed);
                if elapsed > 0 {
                    let per_s = (u128::from(admitted.saturating_sub(before))
                        * u128::from(NANOS_PER_SEC)
                        / u128::from(elapsed)) as u64;
                    v.demand_per_s.store(per_s, Ordering::Relaxed);
                }
                let (book, link) = (self.book.clone(), self.link.clone());
                work.spawn(async move { settle_key(&book, &link, &kl).await });
            }
            let idle = ms(self.book.settings().idle_evict_ms);
            table.retain(|k| {
                let v = &k.value;
                !(v.allocations().is_empty()
                    && !v.protocol.in_flight()
                    && now.saturating_sub(v.last_used.load(Ordering::Relaxed)) > idle)
            });
        }
        while work.join_next().await.is_some() {}
    }

    /// Releases every allocation with its final spend (graceful shutdown). Every allocation is
    /// closed before any final spend is read or sent, so requests still being decided can spend
    /// nothing the Releases do not carry (issue 10 item 3).
    pub async fn release_all(&self) {
        close_all(&self.book);
        let mut work = JoinSet::new();
        for table in self.book.tables() {
            for kl in table.snapshot() {
                let (book, link) = (self.book.clone(), self.link.clone());
                work.spawn(async move {
                    let w = kl.value.protocol.lock_writes().await;
                    for a in kl.value.allocations().iter() {
                        release(&book, &link, &kl, a).await;
                    }
                    kl.value.protocol.replace(&w, Vec::new());
                });
            }
        }
        while work.join_next().await.is_some() {}
    }
}

/// Reports, releases and prefetches for one key.
async fn settle_key(book: &LeaseBook, link: &AllocatorLink, kl: &Arc<Keyed<KeyLease>>) {
    let v = &kl.value;
    let w = v.protocol.lock_writes().await;
    let now = book.clock().now();
    let held = v.allocations();
    let mut keep: Vec<Arc<HeldAllocation>> = Vec::with_capacity(held.len() + 1);
    for a in held.iter() {
        let finished = a.is_expired(now) || a.spent() >= a.granted;
        if finished {
            if release(book, link, kl, a).await {
                continue;
            }
            // Unreachable allocator: keep it (unspendable past its deadline) to release later,
            // until the allocator must have expired it anyway.
            let dead = a
                .deadline
                .saturating_add(ms(book.settings().drift_margin_ms) * 4);
            if now < dead {
                keep.push(a.clone());
            }
            continue;
        }
        let spent = a.spend_to_report();
        if spent > a.reported() {
            book.counters.reports.fetch_add(1, Ordering::Relaxed);
            let req = pb::ReportRequest {
                allocation_id: a.id,
                epoch: a.epoch,
                cumulative_spend: spent,
            };
            match link.call(|mut c| async move { c.report(req).await }).await {
                Ok(r) => {
                    reachable(book, v);
                    a.set_reported(r.recorded_spend);
                }
                Err(s) if fenced(&s) => {
                    // The allocator no longer knows it as live (expired or fenced): stop.
                    reachable(book, v);
                    tracing::warn!(allocation = a.id, status = %s, "allocation fenced; dropping it");
                    continue;
                }
                Err(s) => {
                    unreachable(book, v, now);
                    tracing::debug!(allocation = a.id, status = %s, "report failed");
                }
            }
        }
        keep.push(a.clone());
    }
    let changed = keep.len() != held.len();
    if changed {
        v.protocol.replace(&w, keep);
    }
    drop(w);
    // Prefetch when what is left will not last until the next pass, or when every allocation
    // ends before the pass after next (tokens left at the deadline are of no use).
    let left = v.remaining(now);
    let last_deadline = v
        .allocations()
        .iter()
        .map(|a| a.deadline)
        .max()
        .unwrap_or(0);
    let interval = ms(book.settings().report_interval_ms);
    let need_soon = (u128::from(v.demand_per_s.load(Ordering::Relaxed)) * u128::from(interval)
        / u128::from(NANOS_PER_SEC)) as u64;
    let watermark =
        (u128::from(v.max_grant) * u128::from(book.settings().low_watermark_pct) / 100) as u64;
    let ending = last_deadline.saturating_sub(now) < interval.saturating_mul(2);
    if v.demand_per_s.load(Ordering::Relaxed) > 0 && (left < need_soon.max(watermark) || ending) {
        book.request_lease(kl, now);
    }
}

/// The allocator answered a call for key `v`.
fn reachable(book: &LeaseBook, v: &KeyLease) {
    book.set_reachable(true);
    v.protocol.record_reachable();
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

/// Closes `a` of key `kl` (no spend succeeds afterwards) and releases it with its final spend;
/// true when the allocator no longer holds it. The close comes first, so a spend racing the
/// release is either in the final spend or refused (issue 10 item 3).
async fn release(
    book: &LeaseBook,
    link: &AllocatorLink,
    kl: &Keyed<KeyLease>,
    a: &HeldAllocation,
) -> bool {
    book.counters.releases.fetch_add(1, Ordering::Relaxed);
    let final_spend = a.close();
    let req = pb::ReleaseRequest {
        allocation_id: a.id,
        epoch: a.epoch,
        final_spend,
    };
    match link.call(|mut c| async move { c.release(req).await }).await {
        Ok(r) => {
            reachable(book, &kl.value);
            a.set_reported(final_spend);
            tracing::debug!(allocation = a.id, returned = r.returned, "released");
            true
        }
        Err(s) if fenced(&s) => {
            reachable(book, &kl.value);
            true
        }
        Err(_) => {
            unreachable(book, &kl.value, book.clock().now());
            false
        }
    }
}

/// What to ask for: the demand of one lease period, and at least what the decisions waiting
/// for this call cost together (`waiting`, µtokens); at least one token and at most the
/// policy's max grant. The max grant for a cold key (no demand seen yet).
fn want(v: &KeyLease, ttl_ms: u64, waiting: Micros) -> Micros {
    let demand = v.demand_per_s.load(Ordering::Relaxed);
    let w = if demand == 0 {
        v.max_grant
    } else {
        // 25% headroom so a steady key renews before it runs dry.
        u64::try_from(u128::from(demand) * u128::from(ttl_ms) * 5 / 4 / 1000).unwrap_or(u64::MAX)
    };
    w.max(waiting)
        .clamp(MICROS_PER_TOKEN, v.max_grant.max(MICROS_PER_TOKEN))
}

/// One Acquire for `kl` (retried across nodes with the same request id), installed on grant.
async fn acquire(
    book: &LeaseBook,
    link: &AllocatorLink,
    seq: &AtomicU64,
    kl: &Arc<Keyed<KeyLease>>,
) {
    let v = &kl.value;
    let s = book.settings();
    let sent_at = book.clock().now();
    let request_id = format!(
        "{}-{}-{}",
        s.agent_id,
        sent_at,
        seq.fetch_add(1, Ordering::Relaxed)
    );
    let req = pb::AcquireRequest {
        key: Some(pb::PolicyKey {
            domain: v.domain.clone(),
            entries: v
                .entries
                .iter()
                .map(|(k, val)| pb::DescriptorEntry {
                    key: k.clone(),
                    value: val.clone(),
                })
                .collect(),
        }),
        region: s.region.clone(),
        holder: s.agent_id.clone(),
        want: want(v, v.ttl_ms, v.protocol.take_waiting()),
        request_id,
    };
    book.counters.acquires.fetch_add(1, Ordering::Relaxed);
    let result = link
        .call(|mut c| {
            let req = req.clone();
            async move { c.acquire(req).await }
        })
        .await;
    let now = book.clock().now();
    match result {
        Ok(pb::AcquireResponse {
            outcome: Some(pb::acquire_response::Outcome::Grant(g)),
        }) => {
            book.set_reachable(true);
            // The lease is measured from when the request was sent, minus the drift margin:
            // the agent stops spending before the allocator can consider it expired.
            let deadline = sent_at
                .saturating_add(ms(g.ttl_ms))
                .saturating_sub(ms(s.drift_margin_ms));
            let a = Arc::new(HeldAllocation::new(
                g.allocation_id,
                g.epoch,
                g.granted,
                deadline,
                g.expires_at_unix_ms,
                g.policy_version,
            ));
            v.protocol.install(a).await;
        }
        Ok(pb::AcquireResponse {
            outcome: Some(pb::acquire_response::Outcome::Denial(d)),
        }) => {
            book.set_reachable(true);
            v.protocol
                .record_denial(now.saturating_add(ms(d.retry_after_ms.max(1))));
        }
        Ok(pb::AcquireResponse { outcome: None }) => {
            // An answer without an outcome: the allocator is up but granted nothing; deny for
            // the error backoff (never the failure mode: the allocator answered).
            book.set_reachable(true);
            v.protocol
                .record_denial(now.saturating_add(ms(s.error_backoff_ms)));
        }
        Err(st) => {
            // A leader hint that could not be followed means no leader answered either.
            let leaderless = st.code() == Code::FailedPrecondition && !st.details().is_empty();
            let answered = !leaderless
                && !matches!(
                    st.code(),
                    Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled
                );
            book.set_reachable(answered);
            if !answered {
                book.counters.rpc_errors.fetch_add(1, Ordering::Relaxed);
            }
            tracing::warn!(domain = %v.domain, status = %st, "acquire failed");
            let until = now.saturating_add(ms(s.error_backoff_ms));
            if answered {
                // Refused (bad key, unknown policy, cap reached): the allocator is up, so this
                // is a denial for the backoff, never the failure mode.
                v.protocol.record_denial(until);
            } else {
                v.protocol.record_failure(until);
            }
        }
    }
}

/// The allocator answered that it no longer holds the allocation as live (expired, released,
/// stale epoch, unknown id). A FAILED_PRECONDITION that carries details is a not-the-leader hint
/// instead: the allocation may well be live, so it is kept and retried.
fn fenced(s: &tonic::Status) -> bool {
    matches!(s.code(), Code::FailedPrecondition | Code::NotFound) && s.details().is_empty()
}
