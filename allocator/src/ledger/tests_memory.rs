//! Heap per key of the ledger's tables (issue 13 item 3), measured with glibc's `mallinfo2`
//! (bytes in use, chunk headers and rounding included) as `allot-bench memory --part leased`
//! loads it: one Acquire per key, each granted a 15-minute allocation.
//!
//! Ignored: it measures the whole process's heap, so it must run alone, and in release (a debug
//! build checks every invariant after every command, O(keys) each):
//! `cargo test --release -p allot-allocator --lib heap_per_leased_key -- --ignored --nocapture --test-threads=1`

use super::tests::T0;
use super::*;

const LEASED: &str = "domain: memory-leased\ndescriptors:\n  - key: tenant\n    rate_limit: {name: per-tenant-leased, unit: second, requests_per_unit: 100, burst: 100, max_keys: 250000, lease: {ttl_ms: 900000}}\n";

/// Bytes glibc has handed out and not taken back, all arenas.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_in_use() -> i64 {
    // SAFETY: mallinfo2 only reads the allocator's own statistics.
    let m = unsafe { libc::mallinfo2() };
    m.uordblks as i64 + m.hblkhd as i64
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap_in_use() -> i64 {
    0
}

/// The ledger after one Acquire per key, as the bench's agent sends them.
fn leased(keys: u64) -> Ledger {
    let mut l = Ledger::default();
    let put = Command::PutPolicy {
        yaml: LEASED.into(),
        expected_version: 0,
        request_id: String::new(),
    };
    assert!(matches!(l.apply_at(&put, T0), Response::PolicyPut { .. }));
    for i in 0..keys {
        let now = T0 + i / 2;
        let cmd = Command::Acquire(Acquire {
            key: PolicyKey {
                domain: "memory-leased".into(),
                entries: vec![("tenant".into(), format!("t-{i}"))],
            },
            region: "eu-west".into(),
            holder: "eu-west-1".into(),
            want: 1_000_000,
            demand_per_s: 0,
            want_rate_per_s: 0,
            request_id: format!("eu-west-1-{}-{i}", 1_733_000_000_000_000_000u64 + i * 1_000),
        });
        let r = l.apply_at(&cmd, now);
        assert!(matches!(r, Response::Granted(_)), "{r:?}");
    }
    l
}

#[test]
#[ignore = "measures the process heap: run alone, in release"]
fn heap_per_leased_key() {
    let keys = 100_000u64;
    let before = heap_in_use();
    let mut l = leased(keys);
    let total = heap_in_use() - before;
    let per = |x: i64| x as f64 / keys as f64;
    println!("ledger heap: {:.0} B/key ({total} B)", per(total));
    let at = heap_in_use();
    let t = std::time::Instant::now();
    let copy = l.clone();
    let clone_t = t.elapsed();
    // Ledger::clone: the persistent tables shared, the rest copied.
    println!("a clone: {:.0} B/key, {clone_t:?}", per(heap_in_use() - at));
    let t = std::time::Instant::now();
    drop(copy);
    println!("its drop: {:?}", t.elapsed());
    // What the state machine takes for a snapshot, while every apply waits for it.
    let t = std::time::Instant::now();
    let copy = l.snapshot_copy();
    println!("a snapshot's copy: {:?}", t.elapsed());
    let at = heap_in_use();
    let t = std::time::Instant::now();
    let bytes = crate::raft::App::into_snapshot(copy);
    println!("its encoding, off the lock: {:?}", t.elapsed());
    println!(
        "its snapshot: {:.0} B/key encoded, {:.0} B/key heap",
        bytes.len() as f64 / keys as f64,
        per(heap_in_use() - at)
    );
    drop(bytes);
    let mut part = |name: &str, f: &mut dyn FnMut(&mut Ledger)| {
        let at = heap_in_use();
        f(&mut l);
        println!("{name:>14}: {:>5.0} B/key", per(at - heap_in_use()));
    };
    let trim = || {
        let t = std::time::Instant::now();
        // SAFETY: as `heap_in_use`.
        unsafe { libc::malloc_trim(0) };
        t.elapsed()
    };
    println!("malloc_trim: {:?}, again {:?}", trim(), trim());
    part("requests", &mut |l| {
        l.requests.clear();
        l.request_times = Default::default();
    });
    part("demands", &mut |l| l.demands.clear());
    part("deadlines", &mut |l| l.deadlines.clear());
    part("allocations", &mut |l| l.allocations.clear());
    part("index", &mut |l| l.index = Default::default());
    part("keys", &mut |l| l.keys.clear());
    part("names", &mut |l| l.names = Default::default());
    println!(
        "malloc_trim after freeing: {:?}, again {:?}",
        trim(),
        trim()
    );
    println!("left: {:.0} B/key", per(heap_in_use() - before));
}
