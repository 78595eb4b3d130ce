//! The agent's metrics, exported in the Prometheus text format through OpenTelemetry.
//!
//! The decision path only bumps atomics (per policy, found by rule index, and one latency
//! histogram bucket in integer nanoseconds): it allocates nothing (issue 13 item 5);
//! OpenTelemetry's observable instruments read the atomics when `/metrics` is scraped, and the
//! two histograms are appended to its text. Labels are bounded: policy names come from the config, RPC kinds
//! and codes are fixed sets — never a descriptor value.

use crate::lease::book::LeaseCounters;
use crate::lease::LeaseBook;
use allot_common::limiter::{Code, DescriptorStatus, Outcome, Snapshot};
use allot_common::units::{Nanos, MICROS_PER_TOKEN, NANOS_PER_SEC};
use arc_swap::ArcSwap;
use opentelemetry::metrics::{Meter, MeterProvider};
use opentelemetry::KeyValue;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Why the metrics could not be set up or encoded.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The Prometheus exporter could not be built.
    #[error("cannot build the Prometheus exporter: {0}")]
    Exporter(String),
    /// The text encoding failed.
    #[error("cannot encode metrics: {0}")]
    Encode(String),
}

/// Decision counters of one policy (rule name).
#[derive(Debug, Default)]
pub struct PolicyCounters {
    /// Requests admitted with this policy applying.
    pub allowed: AtomicU64,
    /// Requests denied by this policy.
    pub denied: AtomicU64,
    /// Would-be denials of this policy in shadow mode (answered OK).
    pub shadow_denied: AtomicU64,
}

/// Counters of the adapters, by outcome.
#[derive(Debug, Default)]
pub struct RequestCounters {
    /// Requests answered OK.
    pub ok: AtomicU64,
    /// Requests answered OVER_LIMIT.
    pub over_limit: AtomicU64,
    /// Requests refused as invalid (nothing spent).
    pub invalid: AtomicU64,
}

/// Policy reloads ([`reload`](crate::reload)) and the config version deciding now.
#[derive(Debug, Default)]
pub struct ReloadCounters {
    /// Policy sets made current by a reload.
    pub applied: AtomicU64,
    /// Reloads refused (unreadable or invalid policies; the current version stayed). The same
    /// refused contents count once, however often they are checked again.
    pub rejected: AtomicU64,
    /// 1 when the last reload check found the policies current or applied them, 0 after a
    /// refusal.
    pub last_ok: AtomicU64,
    /// Checks of the policy files (polls and SIGHUPs), whatever they found.
    pub checks: AtomicU64,
    /// Version of the config deciding now (1 at start, one more per applied change).
    pub version: AtomicU64,
}

/// Per domain, per rule index: the rule's counters, for the config version `version`.
#[derive(Default)]
struct ByRule {
    version: u64,
    rules: HashMap<String, Vec<Option<Arc<PolicyCounters>>>>,
}

/// The agent's metrics.
pub struct Metrics {
    registry: prometheus::Registry,
    book: Arc<LeaseBook>,
    /// Kept alive: dropping the provider stops collection.
    _provider: SdkMeterProvider,
    latency: NanosHistogram,
    by_rule: ArcSwap<ByRule>,
    by_name: Arc<Mutex<HashMap<String, Arc<PolicyCounters>>>>,
    /// Requests by outcome.
    pub requests: Arc<RequestCounters>,
    /// Policy reloads and the config version.
    pub reloads: Arc<ReloadCounters>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// Upper bounds of the decision latency buckets, ns: 1 µs to 1 s (a cold wait is bounded by
/// `cold_wait_ms`).
const LATENCY_BUCKETS_NS: &[Nanos] = &[
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    10_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
];

impl Metrics {
    /// Metrics reading the lease counters of `book`, with a fresh Prometheus registry.
    ///
    /// # Errors
    /// [`MetricsError::Exporter`] when the exporter cannot be registered.
    pub fn new(book: Arc<LeaseBook>) -> Result<Self, MetricsError> {
        let registry = prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_target_info()
            .scope_info_enabled(false)
            .build()
            .map_err(|e| MetricsError::Exporter(e.to_string()))?;
        let provider = SdkMeterProvider::builder().with_reader(exporter).build();
        let meter = provider.meter("allot-agent");
        let by_name: Arc<Mutex<HashMap<String, Arc<PolicyCounters>>>> = Arc::default();
        let requests = Arc::new(RequestCounters::default());
        let reloads = Arc::new(ReloadCounters {
            last_ok: AtomicU64::new(1),
            ..ReloadCounters::default()
        });

        register_policy_decisions(&meter, by_name.clone());
        register_requests(&meter, requests.clone());
        register_reloads(&meter, reloads.clone());
        register_lease_counters(&meter, &book);
        register_lease_gauges(&meter, &book);
        let latency = NanosHistogram::new(LATENCY_BUCKETS_NS);
        Ok(Metrics {
            registry,
            book,
            _provider: provider,
            latency,
            by_rule: ArcSwap::from_pointee(ByRule::default()),
            by_name,
            requests,
            reloads,
        })
    }

    /// Maps the rules of `snap` to their policy counters (by name; counters of a name persist
    /// across config versions, so they stay monotonic).
    pub fn apply(&self, snap: &Snapshot) {
        self.reloads.version.store(snap.version, Ordering::Relaxed);
        let mut names = self.by_name.lock();
        let mut by_rule = ByRule {
            version: snap.version,
            rules: HashMap::new(),
        };
        for d in snap.domains() {
            let v = d
                .config
                .rules
                .iter()
                .map(|r| Some(names.entry(r.name.clone()).or_default().clone()))
                .collect();
            by_rule.rules.insert(d.config.domain.clone(), v);
        }
        self.by_rule.store(Arc::new(by_rule));
    }

    /// Counts one decision of `domain`, made with `snap`, and its latency. Rule indexes are
    /// those of `snap`: while a config change is being made current (or for a decision still
    /// on the previous version) the counters are found by rule name instead, so a rule whose
    /// index moved is never counted as another.
    pub fn record(
        &self,
        snap: &Snapshot,
        domain: &str,
        outcome: &Outcome,
        statuses: &[DescriptorStatus],
        took: std::time::Duration,
    ) {
        self.latency
            .record(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
        let ok = outcome.code == Code::Ok;
        let c = if ok {
            &self.requests.ok
        } else {
            &self.requests.over_limit
        };
        c.fetch_add(1, Ordering::Relaxed);
        let by_rule = self.by_rule.load();
        if by_rule.version != snap.version {
            self.record_by_name(snap, domain, ok, statuses);
            return;
        }
        let Some(rules) = by_rule.rules.get(domain) else {
            return;
        };
        for s in statuses {
            if let Some(Some(pc)) = s.rule_index.and_then(|ri| rules.get(ri as usize)) {
                count(pc, s, ok);
            }
        }
    }

    /// [`record`](Self::record)'s per-policy counts through the rule names of `snap` (only
    /// around a config change).
    fn record_by_name(
        &self,
        snap: &Snapshot,
        domain: &str,
        ok: bool,
        statuses: &[DescriptorStatus],
    ) {
        let Some(d) = snap.domain(domain) else {
            return;
        };
        let names = self.by_name.lock();
        for s in statuses {
            let rule = s.rule_index.and_then(|ri| d.config.rules.get(ri as usize));
            // Every rule of a version made current has its counters already (see `apply`,
            // called for it); a decision of a version never applied here counts nowhere.
            if let Some(pc) = rule.and_then(|r| names.get(&r.name)) {
                count(pc, s, ok);
            }
        }
    }

    /// Counts a request refused as invalid.
    pub fn invalid(&self) {
        self.requests.invalid.fetch_add(1, Ordering::Relaxed);
    }

    /// Every metric in the Prometheus text format.
    ///
    /// # Errors
    /// [`MetricsError::Encode`] when encoding fails.
    pub fn encode(&self) -> Result<String, MetricsError> {
        use prometheus::Encoder;
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .map_err(|e| MetricsError::Encode(e.to_string()))?;
        let mut text = String::from_utf8(out).map_err(|e| MetricsError::Encode(e.to_string()))?;
        self.latency.encode(
            "allot_agent_decision_latency_seconds",
            "Time to decide one request (adapters excluded), seconds",
            &mut text,
        );
        self.book.counters.wait_time.encode(
            "allot_agent_lease_wait_seconds",
            "Time requests waited for an allocator call (cold or exhausted key), seconds",
            &mut text,
        );
        Ok(text)
    }
}

/// Upper bounds of the wait histogram's buckets, ns: 1 ms to 5 s (a wait is bounded by
/// `cold_wait_ms`, 250 ms by default).
const WAIT_BUCKETS_NS: [Nanos; 12] = [
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
];

/// A Prometheus histogram of durations kept in integer nanoseconds with atomics: recording is
/// one bucket increment and one saturating add, no lock and no allocation.
#[derive(Debug)]
pub struct NanosHistogram {
    /// Upper bounds of the buckets, ns, increasing.
    bounds: &'static [Nanos],
    /// Count per bucket of `bounds` (not cumulative), then the overflow bucket.
    buckets: Box<[AtomicU64]>,
    sum_ns: AtomicU64,
}

impl NanosHistogram {
    /// An empty histogram with buckets up to each of `bounds` (ns, increasing) and beyond.
    pub fn new(bounds: &'static [Nanos]) -> Self {
        NanosHistogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_ns: AtomicU64::new(0),
        }
    }

    /// Records one duration of `ns` nanoseconds (the sum saturates at `u64::MAX` ns, 584
    /// years).
    pub fn record(&self, ns: Nanos) {
        let i = self.bounds.partition_point(|b| *b < ns);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                Some(s.saturating_add(ns))
            });
    }

    /// Durations recorded so far.
    pub fn count(&self) -> u64 {
        self.buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .fold(0, u64::saturating_add)
    }

    /// Appends the histogram in the Prometheus text format as `name` (seconds).
    pub fn encode(&self, name: &str, help: &str, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (i, le) in self.bounds.iter().enumerate() {
            cumulative = cumulative.saturating_add(self.buckets[i].load(Ordering::Relaxed));
            let le = seconds(*le);
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = seconds(self.sum_ns.load(Ordering::Relaxed));
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// The histogram of waits for the allocator ([`WAIT_BUCKETS_NS`]; recorded off the hot path:
/// only by requests that waited).
#[derive(Debug)]
pub struct WaitHistogram(NanosHistogram);

impl Default for WaitHistogram {
    fn default() -> Self {
        WaitHistogram(NanosHistogram::new(&WAIT_BUCKETS_NS))
    }
}

impl std::ops::Deref for WaitHistogram {
    type Target = NanosHistogram;
    fn deref(&self) -> &NanosHistogram {
        &self.0
    }
}

/// Reads one lease counter.
type LeaseCounter = fn(&LeaseCounters) -> &AtomicU64;

/// The lease counters exported alone: (name, description, counter).
const LEASE_COUNTERS: &[(&str, &str, LeaseCounter)] = &[
    (
        "allot_agent_cold_waits",
        "Decisions that waited for a cold key's first allocation",
        |c| &c.cold_waits,
    ),
    (
        "allot_agent_lease_wait_timeouts",
        "Decisions denied because their wait for an allocator call reached cold_wait_ms",
        |c| &c.wait_timeouts,
    ),
    (
        "allot_agent_lease_handoff_waits",
        "Waiting decisions that the allocator denied with a handoff hint and that asked again at it",
        |c| &c.handoff_waits,
    ),
    (
        "allot_agent_allocator_calls",
        "Allocator calls sent: one Batch, or one single call of the fallback",
        |c| &c.calls,
    ),
    (
        "allot_agent_central_admits",
        "Decisions admitted by the allocator's central decision (Decide)",
        |c| &c.central_admits,
    ),
    (
        "allot_agent_allocator_rpc_errors",
        "Allocator RPCs that failed (timeout, unavailable)",
        |c| &c.rpc_errors,
    ),
    (
        "allot_agent_allocator_unreachable_episodes",
        "Times the allocator went from answering to not answering",
        |c| &c.unreachable_episodes,
    ),
    (
        "allot_agent_emergency_admits",
        "Decisions admitted from an emergency bucket while the allocator was unreachable",
        |c| &c.emergency_admits,
    ),
    (
        "allot_agent_lease_key_refusals",
        "New leased keys refused because their rule holds max_keys keys, none idle",
        |c| &c.key_refusals,
    ),
    (
        "allot_agent_failure_denials",
        "Decisions denied because the allocator was unreachable (failure mode deny)",
        |c| &c.failure_denials,
    ),
    (
        "allot_agent_lease_denials_held",
        "Decisions denied from the allocator's remembered denial, without a call",
        |c| &c.denials_held,
    ),
    (
        "allot_agent_lease_accrual_denials",
        "Decisions denied because the key's allocated rate had not accrued their cost yet",
        |c| &c.accrual_denials,
    ),
    (
        "allot_agent_leased_admits",
        "Decisions admitted from allocations held by this agent",
        |c| &c.leased_admits,
    ),
];

/// Allocator work items sent, by `kind`.
const ALLOCATOR_RPCS: &[(&str, LeaseCounter)] = &[
    ("acquire", |c| &c.acquires),
    ("report", |c| &c.reports),
    ("release", |c| &c.releases),
    ("decide", |c| &c.decides),
];

/// Acquires queued, by why (`why`): the pass's prefetch, a decision running low, a decision
/// finding nothing to spend.
const ACQUIRES_QUEUED: &[(&str, LeaseCounter)] = &[
    ("prefetch", |c| &c.acquires_prefetch),
    ("running_low", |c| &c.acquires_running_low),
    ("cold", |c| &c.acquires_cold),
];

/// Keys moved between central decisions and leases, by destination (`to`).
const KEY_MOVES: &[(&str, LeaseCounter)] =
    &[("leased", |c| &c.promotions), ("central", |c| &c.demotions)];

/// `allot_agent_policy_decisions`: per policy name and outcome, read from `names` when scraped.
fn register_policy_decisions(
    meter: &Meter,
    names: Arc<Mutex<HashMap<String, Arc<PolicyCounters>>>>,
) {
    meter
        .u64_observable_counter("allot_agent_policy_decisions")
        .with_description(
            "Decisions per policy (rule name): allowed, denied, or shadow_denied (a shadow-mode \
             rule would have denied)",
        )
        .with_callback(move |o| {
            for (name, c) in names.lock().iter() {
                for (outcome, v) in [
                    ("allowed", &c.allowed),
                    ("denied", &c.denied),
                    ("shadow_denied", &c.shadow_denied),
                ] {
                    o.observe(
                        v.load(Ordering::Relaxed),
                        &[
                            KeyValue::new("policy", name.clone()),
                            KeyValue::new("outcome", outcome),
                        ],
                    );
                }
            }
        })
        .build();
}

/// `allot_agent_requests`: requests answered, by code.
fn register_requests(meter: &Meter, req: Arc<RequestCounters>) {
    meter
        .u64_observable_counter("allot_agent_requests")
        .with_description("Requests answered, by code: ok, over_limit, invalid (nothing spent)")
        .with_callback(move |o| {
            for (code, v) in [
                ("ok", &req.ok),
                ("over_limit", &req.over_limit),
                ("invalid", &req.invalid),
            ] {
                o.observe(v.load(Ordering::Relaxed), &[KeyValue::new("code", code)]);
            }
        })
        .build();
}

/// Counts one descriptor's answer `s` in its policy's counters; `ok`: the request was admitted.
fn count(pc: &PolicyCounters, s: &DescriptorStatus, ok: bool) {
    if s.shadow_over_limit {
        pc.shadow_denied.fetch_add(1, Ordering::Relaxed);
    }
    if ok {
        pc.allowed.fetch_add(1, Ordering::Relaxed);
    } else if s.code == Code::OverLimit {
        pc.denied.fetch_add(1, Ordering::Relaxed);
    }
}

/// Policy reloads by result, whether the last one succeeded, and the config version.
fn register_reloads(meter: &Meter, r: Arc<ReloadCounters>) {
    let c = r.clone();
    meter
        .u64_observable_counter("allot_agent_policy_reloads")
        .with_description(
            "Policy reloads (SIGHUP or a changed file), by result: applied, or rejected \
             (unreadable or invalid; the current policies stay; the same contents count once)",
        )
        .with_callback(move |o| {
            for (result, v) in [("applied", &c.applied), ("rejected", &c.rejected)] {
                o.observe(
                    v.load(Ordering::Relaxed),
                    &[KeyValue::new("result", result)],
                );
            }
        })
        .build();
    let c = r.clone();
    meter
        .u64_observable_counter("allot_agent_policy_checks")
        .with_description("Checks of the policy files (polls and SIGHUPs), whatever they found")
        .with_callback(move |o| o.observe(c.checks.load(Ordering::Relaxed), &[]))
        .build();
    let c = r.clone();
    meter
        .u64_observable_gauge("allot_agent_policy_reload_ok")
        .with_description(
            "1 when the last check found the policies current or applied them, 0 after a refusal",
        )
        .with_callback(move |o| o.observe(c.last_ok.load(Ordering::Relaxed), &[]))
        .build();
    meter
        .u64_observable_gauge("allot_agent_policy_version")
        .with_description(
            "Version of the policies deciding now (1 at start, +1 per applied change)",
        )
        .with_callback(move |o| o.observe(r.version.load(Ordering::Relaxed), &[]))
        .build();
}

/// The lease path's counters ([`LeaseCounters`]): those exported alone, and the labelled
/// families (allocator work by kind, key moves by destination, Acquires queued by why).
fn register_lease_counters(meter: &Meter, book: &Arc<LeaseBook>) {
    for &(name, description, counter) in LEASE_COUNTERS {
        let b = book.clone();
        meter
            .u64_observable_counter(name)
            .with_description(description)
            .with_callback(move |o| o.observe(counter(&b.counters).load(Ordering::Relaxed), &[]))
            .build();
    }
    register_labelled(
        meter,
        book,
        "allot_agent_allocator_rpcs",
        "Allocator work items sent, by kind (they travel in Batch calls, or one per call to an \
         allocator without Batch)",
        "kind",
        ALLOCATOR_RPCS,
    );
    register_labelled(
        meter,
        book,
        "allot_agent_key_moves",
        "Keys moved between central decisions and leases: to=leased (promoted) or to=central \
         (demoted)",
        "to",
        KEY_MOVES,
    );
    register_labelled(
        meter,
        book,
        "allot_agent_acquires_queued",
        "Acquires queued, by why: prefetch (the maintenance pass: what a key holds will not \
         last until the next pass), running_low (a decision left the key short before the next \
         pass), cold (a decision found nothing to spend and waits for the answer)",
        "why",
        ACQUIRES_QUEUED,
    );
}

/// One counter family over lease counters, one series per `label` value.
fn register_labelled(
    meter: &Meter,
    book: &Arc<LeaseBook>,
    name: &'static str,
    description: &'static str,
    label: &'static str,
    series: &'static [(&'static str, LeaseCounter)],
) {
    let b = book.clone();
    meter
        .u64_observable_counter(name)
        .with_description(description)
        .with_callback(move |o| {
            for &(value, counter) in series {
                o.observe(
                    counter(&b.counters).load(Ordering::Relaxed),
                    &[KeyValue::new(label, value)],
                );
            }
        })
        .build();
}

/// Gauges of the book's state: the overshoot bound, allocations held, keys, reachability.
fn register_lease_gauges(meter: &Meter, book: &Arc<LeaseBook>) {
    let b = book.clone();
    meter
        .f64_observable_gauge("allot_agent_overshoot_bound_tokens")
        .with_description(
            "Most this agent can have admitted beyond what the allocator knows: \
             Σ(granted − reported) over held allocations plus emergency admissions, tokens",
        )
        .with_callback(move |o| {
            o.observe(b.overshoot_bound() as f64 / MICROS_PER_TOKEN as f64, &[])
        })
        .build();
    let b = book.clone();
    meter
        .u64_observable_gauge("allot_agent_allocations_held")
        .with_description("Allocations this agent holds now")
        .with_callback(move |o| o.observe(allocations_held(&b), &[]))
        .build();
    let b = book.clone();
    meter
        .u64_observable_gauge("allot_agent_lease_keys")
        .with_description("Keys of scope: global rules this agent remembers now")
        .with_callback(move |o| o.observe(lease_keys(&b), &[]))
        .build();
    let b = book.clone();
    meter
        .u64_observable_gauge("allot_agent_allocator_reachable")
        .with_description("1 when the last allocator call succeeded, else 0")
        .with_callback(move |o| o.observe(u64::from(b.is_reachable()), &[]))
        .build();
}

/// `ns` as decimal seconds, exact (integer part, then the nanoseconds without trailing zeros).
fn seconds(ns: Nanos) -> String {
    let (s, frac) = (ns / NANOS_PER_SEC, ns % NANOS_PER_SEC);
    if frac == 0 {
        return s.to_string();
    }
    let digits = format!("{frac:09}");
    format!("{s}.{}", digits.trim_end_matches('0'))
}

/// Keys remembered across every leased rule's table.
pub fn lease_keys(book: &LeaseBook) -> u64 {
    book.tables().iter().map(|t| t.len()).sum()
}

/// Allocations held across every key.
pub fn allocations_held(book: &LeaseBook) -> u64 {
    let mut n = 0u64;
    for t in book.tables() {
        t.for_each(|k| n += k.value.allocations().len() as u64);
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_histogram_is_cumulative_and_exact_at_the_extremes() {
        let h = WaitHistogram::default();
        h.record(0);
        h.record(1_000_000);
        h.record(1_000_001);
        h.record(u64::MAX);
        h.record(u64::MAX);
        assert_eq!(h.count(), 5);
        let mut text = String::new();
        h.encode("w", "waits", &mut text);
        assert!(text.contains("w_bucket{le=\"0.001\"} 2\n"), "{text}");
        assert!(text.contains("w_bucket{le=\"0.0025\"} 3\n"), "{text}");
        assert!(text.contains("w_bucket{le=\"5\"} 3\n"), "{text}");
        assert!(text.contains("w_bucket{le=\"+Inf\"} 5\n"), "{text}");
        // The sum saturates instead of wrapping.
        assert!(text.contains("w_sum 18446744073.709551615\n"), "{text}");
        assert!(text.contains("w_count 5\n"), "{text}");
    }

    /// A decision made with a config version the metrics have not mapped yet (the moment of a
    /// reload, or a decision still on the previous version) is counted under its rules' names,
    /// not under whatever rule has its index in the other version.
    #[test]
    fn a_decision_of_another_config_version_is_counted_by_rule_name() {
        use allot_common::config::ConfigSet;
        use allot_common::descriptor::{Descriptor, Entry, Request};
        use allot_common::limiter::Limiter;
        let yaml = |first: &str, second: &str| {
            format!(
                "domain: d\ndescriptors:\n  - key: {first}\n    rate_limit: {{unit: hour, requests_per_unit: 1, scope: local, name: {first}}}\n  - key: {second}\n    rate_limit: {{unit: hour, requests_per_unit: 1, scope: local, name: {second}}}\n"
            )
        };
        let config = |a, b| ConfigSet::from_yaml(&yaml(a, b), std::path::Path::new("p")).unwrap();
        let l = Limiter::new(config("alpha", "beta"), 0);
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let book = Arc::new(LeaseBook::new(
            Arc::new(allot_common::clock::ManualClock::new(0)),
            crate::lease::LeaseSettings::new("a", "r"),
            tx,
        ));
        let m = Metrics::new(book).unwrap();
        m.apply(&l.snapshot());
        // Version 2 swaps the rules' order; the metrics are not told yet.
        l.apply(config("beta", "alpha"), 0);
        let snap = l.snapshot();
        let e = [Entry {
            key: "beta",
            value: "1",
        }];
        let ds = [Descriptor {
            entries: &e,
            hits_addend: None,
        }];
        let req = Request {
            domain: "d",
            descriptors: &ds,
            hits_addend: None,
        };
        let mut st = Vec::new();
        let o = l.decide(&req, 0, &mut st).unwrap();
        assert_eq!(st[0].rule_index, Some(0), "beta is rule 0 in version 2");
        m.record(&snap, "d", &o, &st, std::time::Duration::ZERO);
        let names = m.by_name.lock();
        let allowed = |n: &str| names[n].allowed.load(Ordering::Relaxed);
        assert_eq!((allowed("alpha"), allowed("beta")), (0, 1));
    }

    #[test]
    fn seconds_are_printed_exactly() {
        assert_eq!(seconds(0), "0");
        assert_eq!(seconds(250_000_000), "0.25");
        assert_eq!(seconds(1_000_000_001), "1.000000001");
        assert_eq!(seconds(u64::MAX), "18446744073.709551615");
    }
}
