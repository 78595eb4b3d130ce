//! Recorded traffic: a schedule of arrivals (time, key, cost, the agent it goes to) sent to the
//! agents' Envoy RLS API, and a record of each one as sent (the time it actually left, relative
//! to the run's origin) with Allot's answer and its latency. The same records are replayed
//! through the ideal central counter ([`crate::ideal`]).

use crate::rls::{client, request};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use anyhow::Result;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tonic::transport::Channel;

/// A rate-limit key: a domain and one descriptor's entries.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    /// Config domain.
    pub domain: String,
    /// Descriptor entries, outermost first.
    pub entries: Vec<(String, String)>,
}

/// One planned request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    /// When, from the start of its part.
    pub at: Duration,
    /// Index of the agent (in the driver's list) it goes to.
    pub agent: usize,
    /// Index of its key (in the driver's list).
    pub key: usize,
    /// Cost, whole tokens (≥ 1).
    pub cost: u32,
}

/// Allot's answer to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestAnswer {
    /// OK: admitted.
    Admitted,
    /// OVER_LIMIT.
    Denied,
    /// A transport error, timeout or error status (a gateway would apply its failure mode).
    Error,
}

/// One request as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// When it was sent, ns from the run's origin (the ideal counter decides it then).
    pub sent_ns: u64,
    /// Agent index.
    pub agent: usize,
    /// Key index.
    pub key: usize,
    /// Cost, whole tokens.
    pub cost: u32,
    /// Allot's answer.
    pub answer: RequestAnswer,
    /// From send to answer, µs.
    pub latency_us: u64,
    /// When the answer came, ns from the run's origin (≥ `sent_ns`): an admission takes effect
    /// between the send and the answer (a leased spend at the answer, a central decision when
    /// the allocator applies it).
    pub answered_ns: u64,
}

/// Most requests outstanding at once; past it the schedule waits (the record keeps the real
/// send time, so the ideal counter sees the same delay).
const MAX_IN_FLIGHT: usize = 4096;
/// Answers later than this count as errors (a gateway's RLS timeout would fire long before).
const TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `arrivals` (sorted by time) to the agents at `agents` (RLS addresses), the part
/// starting at `start`, and returns one record per arrival, in send order, with times relative
/// to `origin`.
///
/// # Errors
/// An invalid agent address. A failed request is recorded as [`RequestAnswer::Error`], not an error.
pub async fn drive(
    agents: &[String],
    keys: &[Key],
    arrivals: &[Arrival],
    origin: Instant,
    start: Instant,
) -> Result<Vec<Record>> {
    // Two connections per agent, so one HTTP/2 connection's stream limit is not what is measured.
    let clients: Vec<[RateLimitServiceClient<Channel>; 2]> = agents
        .iter()
        .map(|a| Ok([client(a)?, client(a)?]))
        .collect::<Result<_>>()?;
    let sem = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut tasks = tokio::task::JoinSet::new();
    let mut out = Vec::with_capacity(arrivals.len());
    for (i, a) in arrivals.iter().enumerate() {
        tokio::time::sleep_until((start + a.at).into()).await;
        let permit = sem.clone().acquire_owned().await?;
        let mut c = clients[a.agent][i % 2].clone();
        let k = &keys[a.key];
        let req = request(&k.domain, &k.entries, a.cost);
        let a = *a;
        tasks.spawn(async move {
            let sent = Instant::now();
            let answer = match tokio::time::timeout(TIMEOUT, c.should_rate_limit(req)).await {
                Ok(Ok(r)) if r.get_ref().overall_code == Code::Ok as i32 => RequestAnswer::Admitted,
                Ok(Ok(r)) if r.get_ref().overall_code == Code::OverLimit as i32 => {
                    RequestAnswer::Denied
                }
                _ => RequestAnswer::Error,
            };
            drop(permit);
            let since_origin =
                |t: Instant| u64::try_from(t.duration_since(origin).as_nanos()).unwrap_or(u64::MAX);
            Record {
                sent_ns: since_origin(sent),
                agent: a.agent,
                key: a.key,
                cost: a.cost,
                answer,
                latency_us: u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX),
                answered_ns: since_origin(Instant::now()),
            }
        });
        while let Some(r) = tasks.try_join_next() {
            out.push(r?);
        }
    }
    while let Some(r) = tasks.join_next().await {
        out.push(r?);
    }
    out.sort_by_key(|r| r.sent_ns);
    Ok(out)
}

/// Evenly spaced arrivals: `n` requests of cost 1 to key `key`, one every `every`, starting at
/// `first`, the i-th to `agents[i % len]`.
pub fn paced(
    n: u64,
    every: Duration,
    first: Duration,
    agents: &[usize],
    key: usize,
) -> Vec<Arrival> {
    (0..n)
        .map(|i| Arrival {
            at: first + every.saturating_mul(u32::try_from(i).unwrap_or(u32::MAX)),
            agent: agents[(i % agents.len() as u64) as usize],
            key,
            cost: 1,
        })
        .collect()
}
