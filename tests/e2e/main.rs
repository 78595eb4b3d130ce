//! The Acme story, shortened, on real processes: 3 allocator processes and 7 agents on
//! loopback, driven through the agents' Envoy RLS API.
//!
//! Invariants: admitted ≤ contract + computed bound in every part; the bound never exceeds
//! Σ max grant over the holders; no process panics; every process exits cleanly.

use allot_simulations::local::{Deployment, Plan};
use allot_simulations::scenario::{self, Timing};
use std::path::PathBuf;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acme_story_keeps_every_contract() {
    let bin = allot_e2e::bin_dir();
    for b in ["allot-allocator", "allot-agent"] {
        assert!(
            bin.join(b).exists(),
            "{} missing in {}: run `cargo build --release --workspace --bins` (scripts/test.sh does)",
            b,
            bin.display()
        );
    }
    let data = std::env::temp_dir().join(format!("allot-e2e-{}", std::process::id()));
    let plan = Plan {
        bin_dir: bin,
        policies: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/examples")),
        data_dir: data.clone(),
        agents: vec![
            ("eu-west".into(), 3),
            ("us-east".into(), 3),
            ("ap-south".into(), 1),
        ],
        envoy: None,
        gateway_regions: Vec::new(),
    };
    let mut d = Deployment::start(&plan).await.expect("deployment starts");
    let report = scenario::acme(&mut d, Timing::SHORT).await;
    let unclean = d.shutdown().await;
    let report = report.expect("scenario runs");
    println!("{}", report.table());

    for row in &report.rows {
        assert!(row.within, "outside its contract: {row:?}");
    }
    // Part a: six acme gateways hold at most one lease each of max_grant 8.
    let bound = report.figures["a_bound_tokens"].as_f64().unwrap();
    assert!(bound <= 6.0 * 8.0, "bound {bound} exceeds Σ max grant");
    let admitted = report.figures["a_admitted"].as_u64().unwrap();
    assert!(admitted >= 1, "the burst admitted nothing");
    assert!(unclean.is_empty(), "unclean exits: {unclean:?}");

    let mut panics = Vec::new();
    for entry in std::fs::read_dir(data.join("logs")).expect("logs") {
        let path = entry.expect("log").path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.contains("panicked") {
            panics.push(path.display().to_string());
        }
    }
    assert!(panics.is_empty(), "panics in {panics:?}");
    let _ = std::fs::remove_dir_all(&data);
}
