//! Committed decisions (Acquire, Decide, Report) per second on a 3-node loopback cluster with
//! fsync, with p50 / p99 call latency and Raft entries per second (issue 9 item 3). Not a test:
//! run it in release mode and record the tables in `docs/benchmarks.md`.
//!
//! ```text
//! cargo bench -p allot-allocator --bench cluster -- --clients 64 --secs 10 --batch 32
//! ```
//!
//! Five phases, each on a fresh cluster (three nodes in this process, each with its own sled
//! database in a temporary directory and its own loopback gRPC server; clients are gRPC clients
//! of the leader, one HTTP/2 connection each, so every call pays the full path: proposal,
//! replication to a quorum with an fsync on each node, apply, reply):
//! 1. `unbatched`: every write its own Raft entry (the path before group commit); each client
//!    loops Acquire one token, then Report its spend;
//! 2. `grouped unary`: the same calls through the leader's group commit;
//! 3. `grouped batch`: each client loops one `Batch` call of `--batch` items (half Decides, the
//!    rest Acquires and Reports of the previous call's grants), as agents send one per tick;
//!    closed loop: `clients × batch` decisions always in flight, so its latency is Little's law
//!    (decisions in flight / throughput), a measure of saturation, not of a load's latency;
//! 4. `at rate`: open loop at `--rate` decisions/s (default 20,000) in Batch calls of `--batch`
//!    items started on a fixed schedule over the clients, 200 ms deadlines: the latency of a
//!    given load, as agents sending on their own schedule see it;
//! 5. `overload`: open loop at `--overload` times phase 3's rate (Batch calls with a 200 ms
//!    deadline, started on a fixed schedule whether or not earlier ones returned): goodput,
//!    decisions committed per second, must stay near the capacity.
//!
//! Options: `--clients`, `--secs`, `--warmup-secs`, `--batch`, `--overload`, `--rate`;
//! `--only overload` (phases 3 and 5 alone), `--no-shed` (the leader's load shedding off),
//! `--via-follower` (phases 3 and 5 call a follower, which forwards to the leader),
//! `--no-follower-hold` (a follower never sheds for the leader); the group
//! commit's `--queue-items`, `--entry-items`, `--in-flight`, `--window-us`; `--snapshot-every`
//! Raft entries between snapshots (`RaftTimings::default()` otherwise), `--no-stagger` every
//! voter building at the same index (openraft's own policy) instead of in turn; `--only at-rate` runs
//! phase 4 alone, `--timeline-ms N` prints its calls per N ms of start time (count, p99, max),
//! which shows a stall (a snapshot) apart from queueing. The nodes run on the
//! allocator binary's global allocator (`allot_allocator::heap::ProcessAllocator`).
//!
//! In phases 3 and 5 the clients run on a runtime of their own (threads `bench-client`), the
//! nodes on the main one, so those phases also report the CPU each side used
//! (`/proc/self/task/*/stat`, over the measured window) and the nodes' CPU per committed
//! decision (the other phases keep one runtime for both: a second runtime's workers on two
//! cores lengthen the latency phases' tails); in one process on two cores,
//! an open-loop client offering twice the capacity takes CPU the nodes would otherwise have,
//! and this tells that apart from the nodes' own work per decision growing under overload
//! (issue 9 item 3: goodput near capacity).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allot_allocator::daemon::{Daemon, DaemonConfig};
use allot_allocator::raft::{GroupCommitConfig, NodeConfig, RaftTimings, SystemNodeClock};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use allot_proto::error_detail;
use hdrhistogram::Histogram;
use pb::batch_item::Op;
use pb::batch_result::Outcome;
use tokio::net::TcpListener;
use tonic::transport::Channel;

/// A policy that never runs dry during the run, so every decision is committed and admitted.
/// Leases last 5 s: the open-loop phases never release what they acquire, and a key holds at
/// most 4,096 live allocations per region (the ledger refuses more with KEY_CAP_REACHED, an
/// answer that costs less to apply than a grant); each client acquires on its own key, so even
/// if all of 2× capacity (≈ 70,000 items/s, half of them Acquires) were applied, a key would
/// hold about 550 Acquires/s × 5 s ≈ 2,700, under the cap.
const POLICY: &str = "domain: bench
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 1000000000
      burst: 1000000000
      name: bench-global
      lease: {ttl_ms: 5000, max_grant: 10, max_drift_ms: 500}
";

/// The allocator binary's global allocator, so that the nodes here run as they do there.
#[global_allocator]
static GLOBAL: allot_allocator::heap::ProcessAllocator = allot_allocator::heap::PROCESS_ALLOCATOR;

/// One token, microtokens.
const T: u64 = 1_000_000;

/// Deadline of each call in the open-loop phases.
const CALL_DEADLINE: Duration = Duration::from_millis(200);

/// Name of the client runtime's threads (workers and blocking pool).
const CLIENT_THREADS: &str = "bench-client";

/// Where a phase's clients run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clients {
    /// On the nodes' runtime, as every phase did before the split (the latency phases: a
    /// second runtime's workers on two cores lengthened the at-rate phase's tail, 15–17 →
    /// 22–29 ms over 60 s, two pairs).
    Shared,
    /// On [`client_rt`], so that their CPU is told apart from the nodes' (the capacity and
    /// overload phases, compared for goodput).
    Own,
}

impl Clients {
    /// Runs `f` where these clients run, and waits for it.
    async fn run<T: Send + 'static>(
        self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        match self {
            Clients::Shared => f.await,
            Clients::Own => client_rt().spawn(f).await.expect("client task"),
        }
    }

    /// Spawns `f` where these clients run.
    fn spawn<T: Send + 'static>(
        self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        match self {
            Clients::Shared => tokio::spawn(f),
            Clients::Own => client_rt().spawn(f),
        }
    }
}

/// The runtime the clients of [`Clients::Own`] phases run on: their calls, their HTTP/2
/// connections, the open-loop schedule. The nodes run on the main runtime.
fn client_rt() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .thread_name(CLIENT_THREADS)
            .enable_all()
            .build()
            .expect("client runtime")
    })
}

/// CPU time this process has used so far, split into the clients' threads and the rest (the
/// nodes: their runtime, sled's I/O threads, snapshot builders), in seconds.
#[derive(Debug, Clone, Copy, Default)]
struct CpuSplit {
    clients: f64,
    nodes: f64,
}

impl CpuSplit {
    /// Reads `/proc/self/task/*/stat` (user + system time of every thread); zero off Linux. A
    /// thread that exited meanwhile is missing from the later reading, so a window's figures
    /// are at least what was used in it, less at most the exited threads' time.
    fn now() -> CpuSplit {
        let mut split = CpuSplit::default();
        let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
            return split;
        };
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        for task in tasks.flatten() {
            let dir = task.path();
            let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
            let Some(ticks) = std::fs::read_to_string(dir.join("stat"))
                .ok()
                .and_then(|stat| thread_ticks(&stat))
            else {
                continue;
            };
            if comm.starts_with(CLIENT_THREADS) {
                split.clients += ticks as f64 / hz;
            } else {
                split.nodes += ticks as f64 / hz;
            }
        }
        split
    }

    /// The CPU used between `earlier` and `self`.
    fn since(self, earlier: CpuSplit) -> CpuSplit {
        CpuSplit {
            clients: (self.clients - earlier.clients).max(0.0),
            nodes: (self.nodes - earlier.nodes).max(0.0),
        }
    }
}

/// utime + stime of a `/proc/…/stat` line (fields 14 and 15, counted after the `)` that ends
/// the command name, which may itself hold spaces).
fn thread_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

struct Args {
    clients: usize,
    secs: u64,
    warmup_secs: u64,
    batch: usize,
    overload: u64,
    rate: u64,
    commit: GroupCommitConfig,
    timings: RaftTimings,
    /// `--only at-rate`: run just phase 4 (no capacity phase, so no overload phase either).
    only_at_rate: bool,
    /// `--only overload`: run just phases 3 and 5 (capacity, then overload against it).
    only_overload: bool,
    /// `--via-follower`: the clients of phases 3 and 5 call a follower, which forwards.
    via_follower: bool,
    /// `--timeline-ms N`: print the at-rate phase's calls per N ms of start time (count, p99,
    /// max), to tell periodic stalls from queueing.
    timeline_ms: u64,
}

fn args() -> Args {
    let mut a = Args {
        clients: 64,
        secs: 10,
        warmup_secs: 2,
        batch: 32,
        overload: 2,
        rate: 20_000,
        commit: GroupCommitConfig::default(),
        timings: RaftTimings::default(),
        only_at_rate: false,
        only_overload: false,
        via_follower: false,
        timeline_ms: 0,
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    // `cargo bench` adds flags of its own (e.g. `--bench`); unknown ones are ignored.
    while i < argv.len() {
        if argv[i] == "--no-stagger" {
            a.timings.stagger_snapshots = false;
            i += 1;
            continue;
        }
        if argv[i] == "--no-shed" {
            a.commit.shed_early = false;
            i += 1;
            continue;
        }
        if argv[i] == "--no-follower-hold" {
            a.commit.follower_shed_hold = Duration::ZERO;
            i += 1;
            continue;
        }
        if argv[i] == "--via-follower" {
            a.via_follower = true;
            i += 1;
            continue;
        }
        if argv[i] == "--only" && argv.get(i + 1).map(String::as_str) == Some("at-rate") {
            a.only_at_rate = true;
            i += 2;
            continue;
        }
        if argv[i] == "--only" && argv.get(i + 1).map(String::as_str) == Some("overload") {
            a.only_overload = true;
            i += 2;
            continue;
        }
        let next = argv.get(i + 1).and_then(|v| v.parse::<u64>().ok());
        match (argv[i].as_str(), next) {
            ("--timeline-ms", Some(v)) => a.timeline_ms = v,
            ("--clients", Some(v)) => a.clients = v.max(1) as usize,
            ("--secs", Some(v)) => a.secs = v.max(1),
            ("--warmup-secs", Some(v)) => a.warmup_secs = v,
            ("--batch", Some(v)) => a.batch = v.clamp(2, 4096) as usize,
            ("--overload", Some(v)) => a.overload = v.max(1),
            ("--rate", Some(v)) => a.rate = v.max(1),
            ("--queue-items", Some(v)) => a.commit.queue_items = v.max(1) as usize,
            ("--in-flight", Some(v)) => a.commit.max_in_flight = v.max(1) as usize,
            ("--entry-items", Some(v)) => a.commit.max_entry_items = v.max(1) as usize,
            ("--window-us", Some(v)) => a.commit.window = Duration::from_micros(v),
            ("--snapshot-every", Some(v)) => a.timings.snapshot_every_logs = v.max(1),
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

fn histogram() -> Histogram<u64> {
    // 1 µs to 60 s at 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("static histogram bounds are valid")
}

/// A running 3-node cluster and its leader.
struct Cluster {
    _dir: tempfile::TempDir,
    daemons: BTreeMap<u64, Daemon>,
    leader: u64,
    /// Where clients connect: the leader, or a follower with `--via-follower`.
    target_addr: String,
}

impl Cluster {
    async fn start(commit: Option<GroupCommitConfig>, timings: &RaftTimings) -> Cluster {
        let dir = tempfile::tempdir().expect("temporary directory");
        let mut listeners = BTreeMap::new();
        let mut members = BTreeMap::new();
        for id in 1..=3u64 {
            let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            members.insert(id, l.local_addr().expect("local address").to_string());
            listeners.insert(id, l);
        }
        let mut daemons = BTreeMap::new();
        for (id, listener) in listeners {
            let config = DaemonConfig {
                node: NodeConfig {
                    id,
                    advertise_addr: members[&id].clone(),
                    data_dir: dir.path().join(format!("node-{id}")),
                    cluster_name: "bench".into(),
                    timings: timings.clone(),
                },
                members: members.clone(),
                init: id == 1,
                tick_every: Duration::from_millis(250),
                policies: Vec::new(),
            };
            let d = Daemon::start_with(config, Arc::new(SystemNodeClock), listener, commit.clone())
                .await
                .expect("node starts");
            daemons.insert(id, d);
        }
        let leader = daemons[&1]
            .node()
            .raft()
            .wait(Some(Duration::from_secs(10)))
            .metrics(|m| m.current_leader.is_some(), "a leader")
            .await
            .expect("a leader is elected")
            .current_leader
            .expect("checked above");
        let c = Cluster {
            _dir: dir,
            leader,
            target_addr: members[&leader].clone(),
            daemons,
        };
        c.connect(Clients::Shared)
            .await
            .put_policy(pb::PutPolicyRequest {
                yaml: POLICY.into(),
                expected_version: 0,
                request_id: String::new(),
            })
            .await
            .expect("policy installed");
        c
    }

    /// With `yes`, clients connect to a follower (which forwards every call to the leader)
    /// instead of the leader.
    fn via_follower(mut self, yes: bool) -> Cluster {
        if let (true, Some(d)) = (
            yes,
            self.daemons.values().find(|d| d.node().id() != self.leader),
        ) {
            self.target_addr = d.node().addr().to_string();
        }
        self
    }

    /// A client of the leader (or the follower of [`Cluster::via_follower`]) on its own HTTP/2
    /// connection, as a separate agent would have. Made where `clients` run, so that the
    /// connection's tasks run there too.
    async fn connect(&self, clients: Clients) -> AllocatorClient<Channel> {
        let ep = tonic::transport::Endpoint::from_shared(format!("http://{}", self.target_addr))
            .expect("valid address");
        clients
            .run(async move {
                AllocatorClient::new(ep.connect().await.expect("connect to the leader"))
            })
            .await
    }

    /// The leader's last log index.
    fn log_index(&self) -> u64 {
        (self.log_index_source())()
    }

    /// Reads the leader's last log index from any thread (the open loop runs on the client
    /// runtime).
    fn log_index_source(&self) -> impl Fn() -> u64 + Send + 'static {
        let m = self.daemons[&self.leader].node().raft().metrics();
        move || m.borrow().last_log_index.unwrap_or(0)
    }

    /// Whether the node that led at start still leads, and its queued commands.
    fn health(&self) -> String {
        let d = &self.daemons[&self.leader];
        let now = d.node().raft().metrics().borrow().current_leader;
        let queued = d.group_commit().map_or(0, |g| g.queued());
        format!(
            "leader at start {}, now {now:?}; queued {queued}",
            self.leader
        )
    }

    async fn shutdown(self) {
        for (_, d) in self.daemons {
            let _ = d.shutdown().await;
        }
    }
}

/// What clients saw in the measured window.
#[derive(Default)]
struct Stats {
    calls: Option<Histogram<u64>>,
    decisions: u64,
    /// Refused items by the error item's reason (and the first message seen for it).
    reasons: BTreeMap<String, (u64, String)>,
    errors: u64,
    /// Open-loop phases: every measured call's start (µs after the window opened) and latency
    /// (µs), for `--timeline-ms`.
    starts: Vec<(u64, u64)>,
    /// CPU used by each side over the measured window ([`Clients::Own`] phases only).
    cpu: Option<CpuSplit>,
    /// Open-loop calls refused as a whole, OVERLOADED (the leader shedding load before
    /// decoding); their items are counted in `reasons`.
    whole_calls_refused: u64,
    /// Batch items sent in the measured window: Decides, Acquires, Reports.
    sent: [u64; 3],
}

impl Stats {
    fn add(&mut self, o: Stats) {
        match (&mut self.calls, o.calls) {
            (Some(h), Some(x)) => h.add(&x).expect("same bounds"),
            (slot @ None, x) => *slot = x,
            _ => {}
        }
        self.decisions += o.decisions;
        for (k, (n, msg)) in o.reasons {
            let e = self.reasons.entry(k).or_insert((0, msg));
            e.0 += n;
        }
        self.errors += o.errors;
        self.whole_calls_refused += o.whole_calls_refused;
        self.add_mix(o.sent);
    }

    fn add_mix(&mut self, mix: [u64; 3]) {
        for (a, b) in self.sent.iter_mut().zip(mix) {
            *a += b;
        }
    }

    /// The Batch items sent, as "Decide / Acquire / Report %", or "" when none were counted.
    fn mix(&self) -> String {
        let total: u64 = self.sent.iter().sum();
        if total == 0 {
            return String::new();
        }
        let pct = |n: u64| n as f64 * 100.0 / total as f64;
        format!(
            "; items sent Decide / Acquire / Report {:.0} / {:.0} / {:.0} %",
            pct(self.sent[0]),
            pct(self.sent[1]),
            pct(self.sent[2])
        )
    }

    /// Items refused, whatever the reason.
    fn refused(&self) -> u64 {
        self.reasons.values().map(|(n, _)| n).sum()
    }

    /// Of [`Stats::refused`]: items refused OVERLOADED at once.
    fn overloaded(&self) -> u64 {
        let name = pb::ErrorReason::Overloaded.as_str_name();
        self.reasons.get(name).map_or(0, |(n, _)| *n)
    }

    /// The refused items by reason, e.g. `OUT_OF_RANGE 512 ("...")`.
    fn reasons(&self) -> String {
        let parts: Vec<String> = self
            .reasons
            .iter()
            .map(|(k, (n, msg))| format!("{k} {n} ({msg:?})"))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join("; ")
        }
    }
}

/// Client `n`'s key for Decides: one of 16 shared keys.
fn bench_key(n: usize) -> pb::PolicyKey {
    key_named(format!("t{}", n % 16))
}

fn key_named(value: String) -> pb::PolicyKey {
    pb::PolicyKey {
        domain: "bench".into(),
        entries: vec![pb::DescriptorEntry {
            key: "tenant".into(),
            value,
        }],
    }
}

/// An Acquire of one token by client `n` on its own key (`a{n}`).
fn acquire(n: usize, id: String) -> pb::AcquireRequest {
    pb::AcquireRequest {
        key: Some(key_named(format!("a{n}"))),
        region: "eu-west".into(),
        holder: format!("gw-{n}"),
        want: T,
        demand_per_s: 0,
        want_rate_per_s: 0,
        request_id: id,
    }
}

/// Loops Acquire then Report until `end_at`; counts what finished in [`start_at`, `end_at`).
async fn unary_client(
    mut c: AllocatorClient<Channel>,
    n: usize,
    start_at: Instant,
    end_at: Instant,
) -> Stats {
    let mut h = histogram();
    let mut s = Stats::default();
    let mut seq = 0u64;
    let mut record = |s: &mut Stats, t0: Instant, ok: bool| {
        if t0 < start_at {
            return;
        }
        if ok {
            s.decisions += 1;
            let _ = h.record(t0.elapsed().as_micros() as u64);
        } else {
            s.errors += 1;
        }
    };
    while Instant::now() < end_at {
        seq += 1;
        let t0 = Instant::now();
        let r = c.acquire(acquire(n, format!("r-{n}-{seq}"))).await;
        let grant = match r.map(|r| r.into_inner().outcome) {
            Ok(Some(pb::acquire_response::Outcome::Grant(g))) => g,
            _ => {
                record(&mut s, t0, false);
                continue;
            }
        };
        record(&mut s, t0, true);
        let t1 = Instant::now();
        let r = c
            .report(pb::ReportRequest {
                incarnation: 0,
                allocation_id: grant.allocation_id,
                epoch: grant.epoch,
                cumulative_spend: grant.granted / 2,
                holder: format!("gw-{n}"),
            })
            .await;
        record(&mut s, t1, r.is_ok());
    }
    s.calls = Some(h);
    s
}

/// One Batch of `k` items: half Decides, then Reports of `grants`, then Acquires (so a closed
/// loop alternates Decides with Acquires and Decides with Reports: 50 / 25 / 25 %).
fn batch_items(n: usize, seq: u64, k: usize, grants: &[pb::Grant]) -> Vec<pb::BatchItem> {
    let decides = k / 2;
    let mut items = Vec::with_capacity(k);
    for i in 0..decides {
        items.push(Op::Decide(pb::DecideRequest {
            key: Some(bench_key(n)),
            region: "eu-west".into(),
            holder: format!("gw-{n}"),
            cost: T,
            request_id: format!("d-{n}-{seq}-{i}"),
        }));
    }
    for g in grants.iter().take(k - decides) {
        items.push(Op::Report(pb::ReportRequest {
            incarnation: 0,
            allocation_id: g.allocation_id,
            epoch: g.epoch,
            cumulative_spend: g.granted / 2,
            holder: format!("gw-{n}"),
        }));
    }
    for i in items.len()..k {
        items.push(Op::Acquire(acquire(n, format!("a-{n}-{seq}-{i}"))));
    }
    items
        .into_iter()
        .map(|op| pb::BatchItem { op: Some(op) })
        .collect()
}

/// The kinds of [`batch_items`]`(.., k, grants)`: Decides, Acquires, Reports.
fn mix_of(k: usize, grants: usize) -> [u64; 3] {
    let decides = k / 2;
    let reports = grants.min(k - decides);
    [
        decides as u64,
        (k - decides - reports) as u64,
        reports as u64,
    ]
}

/// An ErrorReason's name, e.g. `OVERLOADED`.
fn reason_name(reason: i32) -> String {
    pb::ErrorReason::try_from(reason)
        .map(|r| r.as_str_name().to_string())
        .unwrap_or_else(|_| format!("reason {reason}"))
}

/// Counts `results` into `s`: committed decisions, and refused items by reason; keeps the
/// grants among them (to report next time) in `grants`.
fn tally(results: &[pb::BatchResult], grants: &mut Vec<pb::Grant>, s: &mut Stats) {
    grants.clear();
    for r in results {
        let (name, message) = match &r.outcome {
            Some(Outcome::Acquire(pb::AcquireResponse {
                outcome: Some(pb::acquire_response::Outcome::Grant(g)),
            })) => {
                grants.push(*g);
                s.decisions += 1;
                continue;
            }
            Some(
                Outcome::Decide(_) | Outcome::Report(_) | Outcome::Acquire(_) | Outcome::Release(_),
            ) => {
                s.decisions += 1;
                continue;
            }
            Some(Outcome::Error(e)) => (reason_name(e.reason), e.message.as_str()),
            None => ("no outcome".to_string(), ""),
        };
        s.reasons.entry(name).or_insert((0, message.to_string())).0 += 1;
    }
}

/// Loops one Batch call of `k` items until `end_at`.
async fn batch_client(
    mut c: AllocatorClient<Channel>,
    n: usize,
    k: usize,
    start_at: Instant,
    end_at: Instant,
) -> Stats {
    let mut h = histogram();
    let mut s = Stats::default();
    let mut grants = Vec::new();
    let mut seq = 0u64;
    while Instant::now() < end_at {
        seq += 1;
        let items = batch_items(n, seq, k, &grants);
        let mix = mix_of(k, grants.len());
        let t0 = Instant::now();
        let r = c.batch(pb::BatchRequest { items }).await;
        let measuring = t0 >= start_at;
        if measuring {
            s.add_mix(mix);
        }
        match r {
            Ok(r) => {
                let results = r.into_inner().results;
                if measuring {
                    let _ = h.record(t0.elapsed().as_micros() as u64);
                    tally(&results, &mut grants, &mut s);
                } else {
                    tally(&results, &mut grants, &mut Stats::default());
                }
            }
            Err(_) if measuring => s.errors += 1,
            Err(_) => {}
        }
    }
    s.calls = Some(h);
    s
}

/// One closed-loop phase: `clients` clients from `warmup` on for `secs`; also Raft entries/s.
async fn closed_loop(c: &Cluster, a: &Args, batch: Option<usize>, on: Clients) -> (Stats, f64) {
    let start_at = Instant::now() + Duration::from_secs(a.warmup_secs);
    let end_at = start_at + Duration::from_secs(a.secs);
    let mut tasks = Vec::new();
    for n in 0..a.clients {
        let client = c.connect(on).await;
        tasks.push(on.spawn(async move {
            match batch {
                None => unary_client(client, n, start_at, end_at).await,
                Some(k) => batch_client(client, n, k, start_at, end_at).await,
            }
        }));
    }
    tokio::time::sleep_until(start_at.into()).await;
    let first = c.log_index();
    let cpu0 = CpuSplit::now();
    tokio::time::sleep_until(end_at.into()).await;
    let entries = (c.log_index() - first) as f64 / a.secs as f64;
    let cpu = CpuSplit::now().since(cpu0);
    let mut all = Stats::default();
    for t in tasks {
        all.add(t.await.expect("client task"));
    }
    all.cpu = (on == Clients::Own).then_some(cpu);
    (all, entries)
}

/// Open loop: Batch calls of `k` items started every `every`, each with a deadline, for `secs`
/// after a warm-up; counts decisions committed per second (goodput) and refusals. The schedule
/// and the calls run on the client runtime.
async fn open_loop(c: &Cluster, a: &Args, k: usize, every: Duration, on: Clients) -> (Stats, f64) {
    let clients: Vec<_> = clients_of(c, a.clients, on).await;
    let log_index = c.log_index_source();
    let (warmup, secs) = (a.warmup_secs, a.secs);
    let (mut s, entries) = on
        .run(open_loop_on(clients, log_index, warmup, secs, k, every))
        .await;
    // With shared threads every thread counts as the nodes': no split to report.
    s.cpu = s.cpu.filter(|_| on == Clients::Own);
    (s, entries)
}

/// The body of [`open_loop`], on the client runtime.
async fn open_loop_on(
    clients: Vec<AllocatorClient<Channel>>,
    log_index: impl Fn() -> u64,
    warmup_secs: u64,
    secs: u64,
    k: usize,
    every: Duration,
) -> (Stats, f64) {
    let start_at = Instant::now() + Duration::from_secs(warmup_secs);
    let end_at = start_at + Duration::from_secs(secs);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    let mut seq = 0u64;
    let mut first = None;
    let granted: Vec<Arc<std::sync::Mutex<Vec<pb::Grant>>>> =
        clients.iter().map(|_| Arc::default()).collect();
    while Instant::now() < end_at {
        tick.tick().await;
        if first.is_none() && Instant::now() >= start_at {
            first = Some((log_index(), CpuSplit::now()));
        }
        seq += 1;
        let n = (seq % clients.len() as u64) as usize;
        let mut client = clients[n].clone();
        // The grants of this client's latest answer are reported in this call, as the closed
        // loop (phase 3) does, so that the overload phase offers the capacity phase's mix.
        let slot = granted[n].clone();
        let grants = std::mem::take(&mut *slot.lock().expect("grants slot"));
        let items = batch_items(n, seq, k, &grants);
        let mix = mix_of(k, grants.len());
        tasks.push(tokio::spawn(async move {
            let t0 = Instant::now();
            let mut req = tonic::Request::new(pb::BatchRequest { items });
            req.set_timeout(CALL_DEADLINE);
            let r = client.batch(req).await;
            let took = t0.elapsed();
            let results = r.map(|r| r.into_inner().results);
            if let Ok(results) = &results {
                let mut grants = Vec::new();
                tally(results, &mut grants, &mut Stats::default());
                if !grants.is_empty() {
                    *slot.lock().expect("grants slot") = grants;
                }
            }
            (t0, took, results, mix)
        }));
    }
    let last = log_index();
    let cpu_end = CpuSplit::now();
    let mut s = Stats::default();
    let mut h = histogram();
    for t in tasks {
        let (t0, took, r, mix) = t.await.expect("call task");
        if t0 < start_at {
            continue;
        }
        s.add_mix(mix);
        let answered = match r {
            Ok(results) => {
                tally(&results, &mut Vec::new(), &mut s);
                true
            }
            // A call refused as a whole, OVERLOADED (shed before decoding): each of its items
            // is refused for that reason, as when the queue refuses them one by one.
            Err(st) => match error_detail::of(&st) {
                Some(d) if d.reason == pb::ErrorReason::Overloaded as i32 => {
                    let name = reason_name(d.reason);
                    s.reasons.entry(name).or_insert((0, d.message)).0 += k as u64;
                    s.whole_calls_refused += 1;
                    true
                }
                _ => {
                    s.errors += 1;
                    false
                }
            },
        };
        if answered {
            let _ = h.record(took.as_micros() as u64);
            let at = (t0 - start_at).as_micros() as u64;
            s.starts.push((at, took.as_micros() as u64));
        }
    }
    s.calls = Some(h);
    let (first_index, cpu0) = first.unwrap_or((last, cpu_end));
    s.cpu = Some(cpu_end.since(cpu0));
    let entries = (last - first_index) as f64 / secs as f64;
    (s, entries)
}

/// The calls of an open-loop phase per `every_ms` of start time: count, p99 and max latency.
fn print_timeline(s: &Stats, every_ms: u64) {
    let mut buckets: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for &(at, took) in &s.starts {
        buckets
            .entry(at / (every_ms * 1000))
            .or_default()
            .push(took);
    }
    println!("| start, ms | calls | p99 ms | max ms |");
    println!("|---:|---:|---:|---:|");
    for (b, mut v) in buckets {
        v.sort_unstable();
        let p99 = v[(v.len() * 99 / 100).min(v.len() - 1)];
        let max = v[v.len() - 1];
        println!(
            "| {} | {} | {:.2} | {:.2} |",
            b * every_ms,
            v.len(),
            p99 as f64 / 1000.0,
            max as f64 / 1000.0
        );
    }
}

async fn clients_of(c: &Cluster, n: usize, on: Clients) -> Vec<AllocatorClient<Channel>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(c.connect(on).await);
    }
    v
}

/// A table row, and the line listing the phase's refused items by reason.
fn row_of(name: &str, s: &Stats, entries: f64, secs: u64, base: f64) -> (String, String) {
    (
        row(name, s, entries, secs, base),
        match s.whole_calls_refused {
            0 => format!("* {name}: {}{}", s.reasons(), s.mix()),
            n => format!(
                "* {name}: {}; {n} calls refused whole, before decoding (shed){}",
                s.reasons(),
                s.mix()
            ),
        },
    )
}

fn row(name: &str, s: &Stats, entries: f64, secs: u64, base: f64) -> String {
    let h = s.calls.as_ref().expect("a histogram");
    let rate = s.decisions as f64 / secs as f64;
    format!(
        "| {name} | {rate:.0} | {} | {entries:.0} | {:.1} | {} | {:.2} | {:.2} | {:.2} | {} ({} overloaded) | {} | {} | {} | {} |",
        // Runs of one phase (`--only`) have no unbatched phase to compare with (base 1.0).
        if base > 1.0 {
            format!("{:.1}×", rate / base)
        } else {
            "-".to_string()
        },
        if entries > 0.0 { rate / entries } else { 0.0 },
        h.len(),
        h.value_at_quantile(0.50) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.max() as f64 / 1000.0,
        s.refused(),
        s.overloaded(),
        s.errors,
        cores(s.cpu.map(|c| c.nodes), secs),
        cores(s.cpu.map(|c| c.clients), secs),
        node_us_per_decision(s).map_or_else(|| "-".to_string(), |us| format!("{us:.1}")),
    )
}

/// CPU-seconds over `secs` as cores in use, or "-" when not measured.
fn cores(cpu_secs: Option<f64>, secs: u64) -> String {
    cpu_secs.map_or_else(|| "-".to_string(), |c| format!("{:.2}", c / secs as f64))
}

/// The nodes' CPU per committed decision over the measured window, µs.
fn node_us_per_decision(s: &Stats) -> Option<f64> {
    let nodes = s.cpu?.nodes;
    (s.decisions > 0 && nodes > 0.0).then(|| nodes * 1e6 / s.decisions as f64)
}

#[tokio::main]
async fn main() {
    let a = args();
    let mut rows = Vec::new();
    if a.only_at_rate {
        let s = at_rate(&a, 1.0, &mut rows).await;
        print_rows(&a, &rows);
        if a.timeline_ms > 0 {
            print_timeline(&s, a.timeline_ms);
        }
        return;
    }
    let base_rate = match a.only_overload {
        true => 1.0,
        false => latency_phases(&a, &mut rows).await,
    };

    let c = Cluster::start(Some(a.commit.clone()), &a.timings)
        .await
        .via_follower(a.via_follower);
    let (s, entries) = closed_loop(&c, &a, Some(a.batch), Clients::Own).await;
    c.shutdown().await;
    let capacity = s.decisions as f64 / a.secs as f64;
    let capacity_stats = s;
    let name = format!("group commit, Batch of {} items", a.batch);
    rows.push(row_of(&name, &capacity_stats, entries, a.secs, base_rate));

    let at_rate_stats = match a.only_overload {
        true => None,
        false => Some(at_rate(&a, base_rate, &mut rows).await),
    };

    // Offered: `overload` × capacity, in calls of `batch` items on a fixed schedule.
    let calls_per_s = (capacity * a.overload as f64 / a.batch as f64).max(1.0);
    let every = Duration::from_secs_f64(1.0 / calls_per_s);
    let c = Cluster::start(Some(a.commit.clone()), &a.timings)
        .await
        .via_follower(a.via_follower);
    let (s, entries) = open_loop(&c, &a, a.batch, every, Clients::Own).await;
    eprintln!("after the overload phase: {}", c.health());
    c.shutdown().await;
    let name = format!(
        "overload: {:.0} offered/s ({}× capacity), {} ms deadlines",
        calls_per_s * a.batch as f64,
        a.overload,
        CALL_DEADLINE.as_millis()
    );
    rows.push(row_of(&name, &s, entries, a.secs, base_rate));
    print_rows(&a, &rows);
    print_overload(&capacity_stats, &s, a.secs);
    if let (true, Some(s)) = (a.timeline_ms > 0, &at_rate_stats) {
        print_timeline(s, a.timeline_ms);
    }
}

/// Phases 1 and 2 (unary calls, unbatched then grouped); returns phase 1's decisions/s, the
/// base of the "vs unbatched" column.
async fn latency_phases(a: &Args, rows: &mut Vec<(String, String)>) -> f64 {
    let c = Cluster::start(None, &a.timings).await;
    let (base, entries) = closed_loop(&c, a, None, Clients::Shared).await;
    c.shutdown().await;
    let base_rate = (base.decisions as f64 / a.secs as f64).max(1.0);
    rows.push(row_of(
        "unbatched, unary Acquire + Report",
        &base,
        entries,
        a.secs,
        base_rate,
    ));

    let c = Cluster::start(Some(a.commit.clone()), &a.timings).await;
    let (s, entries) = closed_loop(&c, a, None, Clients::Shared).await;
    c.shutdown().await;
    rows.push(row_of(
        "group commit, unary Acquire + Report",
        &s,
        entries,
        a.secs,
        base_rate,
    ));

    base_rate
}

/// Goodput under overload against the capacity phase, as measured and per CPU-second the
/// nodes had: a ratio near 1 in the second means the nodes did as much per CPU-second while
/// refusing the excess, so what goodput lost went to the clients' CPU, not to the nodes' work.
fn print_overload(capacity: &Stats, overload: &Stats, secs: u64) {
    let per_s = |s: &Stats| s.decisions as f64 / secs as f64;
    let per_node_cpu = |s: &Stats| node_us_per_decision(s).map(|us| 1e6 / us);
    let (o, c) = (
        overload.cpu.unwrap_or_default(),
        capacity.cpu.unwrap_or_default(),
    );
    println!();
    println!(
        "Overload against capacity: goodput {:.2}× ({:.0} against {:.0} decisions/s); nodes' CPU \
         {:.2} against {:.2} cores, clients' {:.2} against {:.2}; decisions per node CPU-second {}",
        per_s(overload) / per_s(capacity).max(1.0),
        per_s(overload),
        per_s(capacity),
        o.nodes / secs as f64,
        c.nodes / secs as f64,
        o.clients / secs as f64,
        c.clients / secs as f64,
        match (per_node_cpu(overload), per_node_cpu(capacity)) {
            (Some(o), Some(c)) => format!("{:.2}× ({o:.0} against {c:.0})", o / c),
            _ => "- (no CPU reading)".to_string(),
        }
    );
}

/// Phase 4: a given load on the schedule of `rate` decisions/s, in calls of `batch` items;
/// `base_rate` is the unbatched phase's decisions/s (1.0 when run alone, `--only at-rate`).
async fn at_rate(a: &Args, base_rate: f64, rows: &mut Vec<(String, String)>) -> Stats {
    let every = Duration::from_secs_f64(a.batch as f64 / a.rate as f64);
    let c = Cluster::start(Some(a.commit.clone()), &a.timings).await;
    let (s, entries) = open_loop(&c, a, a.batch, every, Clients::Shared).await;
    c.shutdown().await;
    let name = format!(
        "at rate: {} offered/s (open loop), {} ms deadlines",
        a.rate,
        CALL_DEADLINE.as_millis()
    );
    rows.push(row_of(&name, &s, entries, a.secs, base_rate));
    s
}

fn print_rows(a: &Args, rows: &[(String, String)]) {
    println!(
        "3 nodes, loopback, sled fsync per append; {} clients{}, {} s measured after {} s warm-up; group commit {:?}; snapshot every {} entries{}",
        a.clients,
        if a.via_follower {
            " (of a follower in the Batch and overload phases)"
        } else {
            ""
        },
        a.secs,
        a.warmup_secs,
        a.commit,
        a.timings.snapshot_every_logs,
        if a.timings.stagger_snapshots {
            ", voters in turn"
        } else {
            ", all voters at once (--no-stagger)"
        }
    );
    println!("| phase | committed decisions/s | vs unbatched | Raft entries/s | decisions per entry | calls | p50 ms | p99 ms | max ms | refused items | failed calls | nodes' CPU, cores | clients' CPU, cores | nodes' CPU µs per decision |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (r, _) in rows {
        println!("{r}");
    }
    println!();
    println!("Refused items by reason (first message seen):");
    for (_, why) in rows {
        println!("{why}");
    }
}
