//! Envoy RLS v3 client side: building requests and an open-loop load generator.
//!
//! Open loop: requests are sent on a fixed schedule whatever the server's latency, and each
//! latency is measured from the request's *scheduled* time, so a slow server cannot hide its
//! queueing (no coordinated omission). The schedule is kept by a dedicated thread with
//! microsecond sleeps (tokio's timer would release a millisecond's worth of requests at once);
//! the service latency, from the actual send, is reported beside it.

use crate::zipf::{SplitMix64, Zipf};
use allot_proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor, RateLimitDescriptor,
};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use allot_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tonic::transport::{Channel, Endpoint};

/// A `RateLimitRequest` with one descriptor of `entries`, costing `hits`.
pub fn request(domain: &str, entries: &[(String, String)], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| rate_limit_descriptor::Entry {
                    key: k.clone(),
                    value: v.clone(),
                })
                .collect(),
            ..Default::default()
        }],
        hits_addend: hits,
    }
}

/// A lazily connected RLS client for `addr` ("host:port").
///
/// # Errors
/// When `addr` is not a valid address.
pub fn client(addr: &str) -> anyhow::Result<RateLimitServiceClient<Channel>> {
    let ch = Endpoint::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect_lazy();
    Ok(RateLimitServiceClient::new(ch))
}

/// Which value of the descriptor's last entry each request of a load carries.
#[derive(Debug, Clone)]
pub enum Keys {
    /// `n` values (`VALUE-0` … `VALUE-(n-1)`) in turn; 1 keeps the entry as given (one hot key).
    RoundRobin(u32),
    /// Values `VALUE-0` … drawn by popularity (index 0 the most popular), from `seed`.
    Zipf {
        /// The popularity of each value.
        dist: Zipf,
        /// Seed of the draws: the same seed, the same sequence.
        seed: u64,
    },
}

impl Keys {
    /// A chooser of the value index of request `i` (None: the entry as given).
    fn chooser(self) -> impl FnMut(u64) -> Option<u64> {
        let mut rng = match &self {
            Keys::Zipf { seed, .. } => SplitMix64::new(*seed),
            Keys::RoundRobin(_) => SplitMix64::new(0),
        };
        move |i| match &self {
            Keys::RoundRobin(n) if *n > 1 => Some(i % u64::from(*n)),
            Keys::RoundRobin(_) => None,
            Keys::Zipf { dist, .. } => Some(dist.sample(&mut rng) as u64),
        }
    }
}

/// What a load run measured.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    /// Requests scheduled.
    pub sent: u64,
    /// Answered OK (admitted).
    pub ok: u64,
    /// Answered OVER_LIMIT.
    pub over_limit: u64,
    /// Failed (transport error, timeout, error status).
    pub errors: u64,
    /// Admitted over sent (0 when nothing was sent).
    pub admitted_ratio: f64,
    /// Wall time of the run, s.
    pub seconds: f64,
    /// Answers per second.
    pub throughput: f64,
    /// Latency percentiles from the scheduled send time, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
    /// 99.9th percentile, µs.
    pub p999_us: u64,
    /// Worst, µs.
    pub max_us: u64,
    /// Service latency (from the actual send, not the schedule) 50th percentile, µs: what the
    /// server and transport cost, without the load generator's own timer lateness.
    pub svc_p50_us: u64,
    /// Service latency 99th percentile, µs.
    pub svc_p99_us: u64,
    /// Service latency 99.9th percentile, µs.
    pub svc_p999_us: u64,
}

/// Sends `rate` requests per second for `duration` to `addr`, choosing the value of the
/// descriptor's last entry by `keys`, with at most `max_in_flight` outstanding.
///
/// Pacing runs on a dedicated OS thread that sleeps until each request's planned time (with
/// the thread's timer slack set to 1 ns, so a sleep ends within microseconds, not at the next
/// millisecond tick) and then hands the request to the runtime: requests leave evenly spaced,
/// not in bursts of one timer tick's worth. Latency "from send" is measured from that hand-off,
/// "from schedule" from the planned time.
///
/// # Errors
/// When the target address is invalid or the pacing thread cannot be started.
pub async fn run_load(
    addr: &str,
    domain: &str,
    entries: &[(String, String)],
    keys: Keys,
    rate: u64,
    duration: Duration,
    max_in_flight: usize,
) -> anyhow::Result<LoadReport> {
    // Several HTTP/2 connections, so one connection's stream limit is not what is measured.
    let clients = (0..4)
        .map(|_| client(addr))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let recorder = Arc::new(Recorder::new()?);
    // Every permit is taken back at the end in one `acquire_many(u32)`.
    let slots = max_in_flight.clamp(1, (u32::MAX as usize).min(Semaphore::MAX_PERMITS));
    let sem = Arc::new(Semaphore::new(slots));
    let interval_ns = 1_000_000_000 / rate.max(1);
    let total = (rate as u128 * duration.as_nanos() / 1_000_000_000) as u64;
    let handle = tokio::runtime::Handle::current();
    let (domain, entries) = (domain.to_string(), entries.to_vec());
    let pacer = {
        let (sem, recorder) = (sem.clone(), recorder.clone());
        std::thread::Builder::new()
            .name("allot-bench-pacer".into())
            .spawn(move || {
                precise_sleeps();
                let mut choose = keys.chooser();
                let start = Instant::now();
                for i in 0..total {
                    let due = start + Duration::from_nanos(interval_ns.saturating_mul(i));
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    // At the in-flight cap the schedule waits: that wait shows "from schedule".
                    let Ok(permit) = handle.block_on(sem.clone().acquire_owned()) else {
                        break;
                    };
                    let mut es = entries.clone();
                    if let (Some(k), Some(last)) = (choose(i), es.last_mut()) {
                        last.1 = format!("{}-{k}", last.1);
                    }
                    let req = request(&domain, &es, 1);
                    let mut c = clients[i as usize % clients.len()].clone();
                    let recorder = recorder.clone();
                    let sent = Instant::now();
                    handle.spawn(async move {
                        let r = c.should_rate_limit(req).await;
                        let code = match r {
                            Ok(resp) => Some(resp.get_ref().overall_code),
                            Err(_) => None,
                        };
                        recorder.record(due, sent, code);
                        drop(permit);
                    });
                }
                start
            })?
    };
    let start = tokio::task::spawn_blocking(move || pacer.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the pacing thread panicked"))?;
    // Every permit back: every request answered or failed.
    let _all = sem.acquire_many(slots as u32).await?;
    let seconds = start.elapsed().as_secs_f64();
    Ok(recorder.report(total, seconds))
}

/// Latency histograms and answer counts of one run.
struct Recorder {
    /// (from schedule, from send), µs.
    hists: std::sync::Mutex<(Histogram<u64>, Histogram<u64>)>,
    /// OK, OVER_LIMIT, failed.
    counts: [AtomicU64; 3],
}

impl Recorder {
    fn new() -> anyhow::Result<Self> {
        let h = || Histogram::<u64>::new_with_bounds(1, 60_000_000, 3);
        Ok(Recorder {
            hists: std::sync::Mutex::new((h()?, h()?)),
            counts: Default::default(),
        })
    }

    fn record(&self, due: Instant, sent: Instant, code: Option<i32>) {
        let now = Instant::now();
        let us = |from: Instant| (now.duration_since(from).as_micros() as u64).max(1);
        let idx = match code {
            Some(c) if c == Code::Ok as i32 => 0,
            Some(c) if c == Code::OverLimit as i32 => 1,
            _ => 2,
        };
        self.counts[idx].fetch_add(1, Ordering::Relaxed);
        let mut h = self.hists.lock().unwrap_or_else(|e| e.into_inner());
        // Values above the histogram's bound (60 s) cannot occur: requests time out at 5 s.
        let _ = h.0.record(us(due));
        let _ = h.1.record(us(sent));
    }

    fn report(&self, sent: u64, seconds: f64) -> LoadReport {
        let h = self.hists.lock().unwrap_or_else(|e| e.into_inner());
        let (sched, svc) = (&h.0, &h.1);
        let c = |i: usize| self.counts[i].load(Ordering::Relaxed);
        LoadReport {
            sent,
            ok: c(0),
            over_limit: c(1),
            errors: c(2),
            admitted_ratio: if sent == 0 {
                0.0
            } else {
                c(0) as f64 / sent as f64
            },
            seconds,
            throughput: (c(0) + c(1)) as f64 / seconds,
            p50_us: sched.value_at_quantile(0.5),
            p99_us: sched.value_at_quantile(0.99),
            p999_us: sched.value_at_quantile(0.999),
            max_us: sched.max(),
            svc_p50_us: svc.value_at_quantile(0.5),
            svc_p99_us: svc.value_at_quantile(0.99),
            svc_p999_us: svc.value_at_quantile(0.999),
        }
    }
}

/// Lets this thread's sleeps end within microseconds of their deadline: Linux otherwise adds
/// up to 50 µs of timer slack to each. Best effort; elsewhere sleeps are just less exact.
fn precise_sleeps() {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl(PR_SET_TIMERSLACK) takes integers only and changes this thread's timer
    // slack; no memory is passed or touched.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}
