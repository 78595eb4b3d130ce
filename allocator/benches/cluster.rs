//! Committed Acquire and Report operations per second on a 3-node loopback cluster, with p50 /
//! p99 latency (issue 3). Not a test: run it in release mode and record the table in
//! `docs/benchmarks.md`.
//!
//! ```text
//! cargo bench -p allot-allocator --bench cluster -- --clients 16 --secs 10
//! ```
//!
//! The three nodes run in this process (each with its own sled database in a temporary
//! directory and its own loopback gRPC server); the clients are gRPC clients of the leader, so
//! every operation pays the full path: HTTP/2, proposal, replication to a quorum with an fsync
//! on each node, apply, reply. Each client loops: Acquire one token, then Report its spend.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use allot_allocator::daemon::{Daemon, DaemonConfig};
use allot_allocator::raft::{NodeConfig, RaftTimings, SystemClock};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::allocator_client::AllocatorClient;
use hdrhistogram::Histogram;
use tokio::net::TcpListener;
use tonic::transport::Channel;

/// A policy that never runs dry during the run, so every Acquire is a committed grant.
const POLICY: &str = "domain: bench
descriptors:
  - key: tenant
    rate_limit:
      unit: second
      requests_per_unit: 1000000000
      burst: 1000000000
      name: bench-global
      lease: {ttl_ms: 60000, max_grant: 10, max_drift_ms: 500}
";

struct Args {
    clients: usize,
    secs: u64,
    warmup_secs: u64,
}

fn args() -> Args {
    let mut a = Args {
        clients: 16,
        secs: 10,
        warmup_secs: 2,
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    // `cargo bench` adds flags of its own (e.g. `--bench`); unknown ones are ignored.
    while i < argv.len() {
        let next = argv.get(i + 1).and_then(|v| v.parse::<u64>().ok());
        match (argv[i].as_str(), next) {
            ("--clients", Some(v)) => a.clients = v.max(1) as usize,
            ("--secs", Some(v)) => a.secs = v.max(1),
            ("--warmup-secs", Some(v)) => a.warmup_secs = v,
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

#[derive(Default)]
struct Stats {
    acquire: Option<Histogram<u64>>,
    report: Option<Histogram<u64>>,
    denied: u64,
    errors: u64,
}

fn histogram() -> Histogram<u64> {
    // 1 µs to 60 s at 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("static histogram bounds are valid")
}

async fn client_loop(
    mut c: AllocatorClient<Channel>,
    n: usize,
    start_at: Instant,
    end_at: Instant,
) -> Stats {
    let mut acq = histogram();
    let mut rep = histogram();
    let mut s = Stats::default();
    let mut seq = 0u64;
    let key = pb::PolicyKey {
        domain: "bench".into(),
        entries: vec![pb::DescriptorEntry {
            key: "tenant".into(),
            value: "acme".into(),
        }],
    };
    loop {
        let t0 = Instant::now();
        if t0 >= end_at {
            break;
        }
        let measuring = t0 >= start_at;
        seq += 1;
        let r = c
            .acquire(pb::AcquireRequest {
                key: Some(key.clone()),
                region: "eu-west".into(),
                holder: format!("gw-{n}"),
                want: 1_000_000,
                demand_per_s: 0,
                request_id: format!("r-{n}-{seq}"),
            })
            .await;
        let grant = match r.map(|r| r.into_inner().outcome) {
            Ok(Some(pb::acquire_response::Outcome::Grant(g))) => g,
            Ok(_) => {
                s.denied += 1;
                continue;
            }
            Err(_) => {
                s.errors += 1;
                continue;
            }
        };
        if measuring {
            let _ = acq.record(t0.elapsed().as_micros() as u64);
        }
        let t1 = Instant::now();
        let r = c
            .report(pb::ReportRequest {
                allocation_id: grant.allocation_id,
                epoch: grant.epoch,
                cumulative_spend: grant.granted / 2,
            })
            .await;
        match r {
            Ok(_) if measuring => {
                let _ = rep.record(t1.elapsed().as_micros() as u64);
            }
            Ok(_) => {}
            Err(_) => s.errors += 1,
        }
    }
    s.acquire = Some(acq);
    s.report = Some(rep);
    s
}

fn row(name: &str, h: &Histogram<u64>, secs: u64) -> String {
    format!(
        "| {name} | {} | {:.0} | {:.2} | {:.2} | {:.2} |",
        h.len(),
        h.len() as f64 / secs as f64,
        h.value_at_quantile(0.50) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0,
        h.max() as f64 / 1000.0,
    )
}

#[tokio::main]
async fn main() {
    let a = args();
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
                timings: RaftTimings::default(),
            },
            members: members.clone(),
            init: id == 1,
            tick_every: Duration::from_millis(250),
            policies: Vec::new(),
        };
        let d = Daemon::start(config, Arc::new(SystemClock), listener)
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
    let addr = format!("http://{}", members[&leader]);
    let channel = tonic::transport::Endpoint::from_shared(addr)
        .expect("valid address")
        .connect()
        .await
        .expect("connect to the leader");
    AllocatorClient::new(channel.clone())
        .put_policy(pb::PutPolicyRequest {
            yaml: POLICY.into(),
            expected_version: 0,
        })
        .await
        .expect("policy installed");

    let start_at = Instant::now() + Duration::from_secs(a.warmup_secs);
    let end_at = start_at + Duration::from_secs(a.secs);
    let tasks: Vec<_> = (0..a.clients)
        .map(|n| {
            // One HTTP/2 connection per client, as separate agents would have.
            let ch = channel.clone();
            let members = members.clone();
            tokio::spawn(async move {
                let c = match tonic::transport::Endpoint::from_shared(format!(
                    "http://{}",
                    members[&leader]
                )) {
                    Ok(ep) => ep.connect().await.unwrap_or(ch),
                    Err(_) => ch,
                };
                client_loop(AllocatorClient::new(c), n, start_at, end_at).await
            })
        })
        .collect();
    let mut acq = histogram();
    let mut rep = histogram();
    let (mut denied, mut errors) = (0, 0);
    for t in tasks {
        let s = t.await.expect("client task");
        if let Some(h) = &s.acquire {
            acq.add(h).expect("same bounds");
        }
        if let Some(h) = &s.report {
            rep.add(h).expect("same bounds");
        }
        denied += s.denied;
        errors += s.errors;
    }
    println!(
        "3 nodes, loopback, {} clients, {} s measured after {} s warm-up; leader = node {leader}",
        a.clients, a.secs, a.warmup_secs
    );
    println!("| operation | count | ops/s | p50 ms | p99 ms | max ms |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!("{}", row("Acquire (committed grant)", &acq, a.secs));
    println!("{}", row("Report (committed)", &rep, a.secs));
    let mut both = acq.clone();
    both.add(&rep).expect("same bounds");
    println!("{}", row("Acquire + Report", &both, a.secs));
    println!("denials: {denied}, errors: {errors}");
    for (_, d) in daemons {
        let _ = d.shutdown().await;
    }
}
