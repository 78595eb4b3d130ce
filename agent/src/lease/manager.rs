//! The lease path in the background (seed §21–23): acquire allocations sized from demand,
//! report cumulative spend every interval, release finished allocations with their final spend,
//! prefetch below the low watermark, and release everything on shutdown.

use super::allocation::HeldAllocation;
use super::book::{ms, KeyLease, LeaseBook, LeaseEvent};
use super::client::AllocatorLink;
use allot_common::keyed::Keyed;
use allot_common::units::{Micros, MICROS_PER_TOKEN, NANOS_PER_SEC};
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
                    && !v.acquiring.load(Ordering::Relaxed)
                    && now.saturating_sub(v.last_used.load(Ordering::Relaxed)) > idle)
            });
        }
        while work.join_next().await.is_some() {}
    }

    /// Releases every allocation with its final spend (graceful shutdown).
    pub async fn release_all(&self) {
        let mut work = JoinSet::new();
        for table in self.book.tables() {
            for kl in table.snapshot() {
                let (book, link) = (self.book.clone(), self.link.clone());
                work.spawn(async move {
                    let _w = kl.value.alloc_write.lock().await;
                    for a in kl.value.allocations().iter() {
                        release(&book, &link, a).await;
                    }
                    kl.value.set_allocations(Vec::new());
                });
            }
        }
        while work.join_next().await.is_some() {}
    }
}

/// Reports, releases and prefetches for one key.
async fn settle_key(book: &LeaseBook, link: &AllocatorLink, kl: &Arc<Keyed<KeyLease>>) {
    let v = &kl.value;
    let _w = v.alloc_write.lock().await;
    let now = book.clock().now();
    let held = v.allocations();
    let mut keep: Vec<Arc<HeldAllocation>> = Vec::with_capacity(held.len() + 1);
    for a in held.iter() {
        let finished = a.is_expired(now) || a.spent() >= a.granted;
        if finished {
            if release(book, link, a).await {
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
        let spent = a.spent();
        if spent > a.reported() {
            book.counters.reports.fetch_add(1, Ordering::Relaxed);
            let req = pb::ReportRequest {
                allocation_id: a.id,
                epoch: a.epoch,
                cumulative_spend: spent,
            };
            match link.call(|mut c| async move { c.report(req).await }).await {
                Ok(r) => {
                    book.set_reachable(true);
                    a.set_reported(r.recorded_spend);
                }
                Err(s) if fenced(&s) => {
                    // The allocator no longer knows it as live (expired or fenced): stop.
                    book.set_reachable(true);
                    tracing::warn!(allocation = a.id, status = %s, "allocation fenced; dropping it");
                    continue;
                }
                Err(s) => {
                    book.set_reachable(false);
                    book.counters.rpc_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(allocation = a.id, status = %s, "report failed");
                }
            }
        }
        keep.push(a.clone());
    }
    let changed = keep.len() != held.len();
    if changed {
        v.set_allocations(keep);
    }
    drop(_w);
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

/// Releases `a` with its final spend; true when the allocator no longer holds it.
async fn release(book: &LeaseBook, link: &AllocatorLink, a: &HeldAllocation) -> bool {
    book.counters.releases.fetch_add(1, Ordering::Relaxed);
    let req = pb::ReleaseRequest {
        allocation_id: a.id,
        epoch: a.epoch,
        final_spend: a.spent(),
    };
    match link.call(|mut c| async move { c.release(req).await }).await {
        Ok(r) => {
            book.set_reachable(true);
            a.set_reported(a.spent());
            tracing::debug!(allocation = a.id, returned = r.returned, "released");
            true
        }
        Err(s) if fenced(&s) => {
            book.set_reachable(true);
            true
        }
        Err(_) => {
            book.set_reachable(false);
            book.counters.rpc_errors.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// What to ask for: the demand of one lease period, at least one token and at most the
/// policy's max grant; the max grant for a cold key (no demand seen yet).
fn want(v: &KeyLease, ttl_ms: u64) -> Micros {
    let demand = v.demand_per_s.load(Ordering::Relaxed);
    let w = if demand == 0 {
        v.max_grant
    } else {
        // 25% headroom so a steady key renews before it runs dry.
        (u128::from(demand) * u128::from(ttl_ms) * 5 / 4 / 1000) as u64
    };
    w.clamp(MICROS_PER_TOKEN, v.max_grant.max(MICROS_PER_TOKEN))
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
        want: want(v, v.ttl_ms),
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
            let _w = v.alloc_write.lock().await;
            let mut next: Vec<Arc<HeldAllocation>> = v
                .allocations()
                .iter()
                .filter(|x| !x.is_expired(now) || x.spent() > x.reported())
                .cloned()
                .collect();
            next.push(a);
            v.set_allocations(next);
            v.next_try_at.store(0, Ordering::Relaxed);
        }
        Ok(pb::AcquireResponse {
            outcome: Some(pb::acquire_response::Outcome::Denial(d)),
        }) => {
            book.set_reachable(true);
            v.next_try_at.store(
                now.saturating_add(ms(d.retry_after_ms.max(1))),
                Ordering::Relaxed,
            );
        }
        Ok(pb::AcquireResponse { outcome: None }) => {
            book.set_reachable(true);
            v.next_try_at.store(
                now.saturating_add(ms(s.error_backoff_ms)),
                Ordering::Relaxed,
            );
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
            v.next_try_at.store(
                now.saturating_add(ms(s.error_backoff_ms)),
                Ordering::Relaxed,
            );
        }
    }
    v.answered.store(true, Ordering::Release);
    v.acquiring.store(false, Ordering::Release);
    v.ready.notify_waiters();
}

/// The allocator answered that it no longer holds the allocation as live (expired, released,
/// stale epoch, unknown id). A FAILED_PRECONDITION that carries details is a not-the-leader hint
/// instead: the allocation may well be live, so it is kept and retried.
fn fenced(s: &tonic::Status) -> bool {
    matches!(s.code(), Code::FailedPrecondition | Code::NotFound) && s.details().is_empty()
}
