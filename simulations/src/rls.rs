//! Envoy RLS v3 client side: building requests and an open-loop load generator.
//!
//! Open loop: requests are sent on a fixed schedule whatever the server's latency, and each
//! latency is measured from the request's *scheduled* time, so a slow server cannot hide its
//! queueing (no coordinated omission). tokio's timer has millisecond resolution, so the
//! schedule itself runs late by up to a millisecond; the service latency (from the actual send)
//! is reported beside it.

use allot_proto::envoy::extensions::common::ratelimit::v3::{
    rate_limit_descriptor, RateLimitDescriptor,
};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use allot_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Mutex, Semaphore};
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

/// What a load run measured.
#[derive(Debug, Clone, Serialize)]
pub struct LoadReport {
    /// Requests scheduled.
    pub sent: u64,
    /// Answered OK.
    pub ok: u64,
    /// Answered OVER_LIMIT.
    pub over_limit: u64,
    /// Failed (transport error, timeout, error status).
    pub errors: u64,
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

/// Sends `rate` requests per second for `duration` to `addr`, rotating over `keys` distinct
/// values of the descriptor's last entry, with at most `max_in_flight` outstanding.
///
/// # Errors
/// When the target address is invalid.
pub async fn run_load(
    addr: &str,
    domain: &str,
    entries: &[(String, String)],
    keys: u32,
    rate: u64,
    duration: Duration,
    max_in_flight: usize,
) -> anyhow::Result<LoadReport> {
    // Several HTTP/2 connections, so one connection's stream limit is not what is measured.
    let clients = (0..4)
        .map(|_| client(addr))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let svc = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 60_000_000, 3,
    )?));
    let counts = Arc::new([
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
        std::sync::atomic::AtomicU64::new(0),
    ]);
    let sem = Arc::new(Semaphore::new(max_in_flight.max(1)));
    let interval = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let total = (rate as u128 * duration.as_nanos() / 1_000_000_000) as u64;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        let due = start + interval * i as u32;
        tokio::time::sleep_until(due.into()).await;
        let Ok(permit) = sem.clone().acquire_owned().await else {
            break;
        };
        let mut es = entries.to_vec();
        if keys > 1 {
            if let Some(last) = es.last_mut() {
                last.1 = format!("{}-{}", last.1, i % keys as u64);
            }
        }
        let req = request(domain, &es, 1);
        let mut c = clients[i as usize % clients.len()].clone();
        let (hist, svc, counts) = (hist.clone(), svc.clone(), counts.clone());
        tasks.spawn(async move {
            let sent = Instant::now();
            let r = c.should_rate_limit(req).await;
            let us = due.elapsed().as_micros() as u64;
            let _ = svc
                .lock()
                .await
                .record((sent.elapsed().as_micros() as u64).max(1));
            drop(permit);
            let idx = match r {
                Ok(resp) if resp.get_ref().overall_code == Code::Ok as i32 => 0,
                Ok(resp) if resp.get_ref().overall_code == Code::OverLimit as i32 => 1,
                _ => 2,
            };
            counts[idx].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = hist.lock().await.record(us.max(1));
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
    let seconds = start.elapsed().as_secs_f64();
    let h = hist.lock().await;
    let sv = svc.lock().await;
    let c = |i: usize| counts[i].load(std::sync::atomic::Ordering::Relaxed);
    Ok(LoadReport {
        sent: total,
        ok: c(0),
        over_limit: c(1),
        errors: c(2),
        seconds,
        throughput: (c(0) + c(1)) as f64 / seconds,
        p50_us: h.value_at_quantile(0.5),
        p99_us: h.value_at_quantile(0.99),
        p999_us: h.value_at_quantile(0.999),
        max_us: h.max(),
        svc_p50_us: sv.value_at_quantile(0.5),
        svc_p99_us: sv.value_at_quantile(0.99),
        svc_p999_us: sv.value_at_quantile(0.999),
    })
}
