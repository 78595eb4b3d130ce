//! sled's I/O thread pool wakes one thread per task (the patch in `vendor/sled`,
//! `ALLOT-PATCH.md`): upstream sled 0.34.7 woke every idle worker (seven at least) for each
//! flush and each log-buffer write, which made those threads about half of a loaded allocator
//! node's CPU (`docs/benchmarks.md`, "sled's pool wakes one thread").
//!
//! Checked from outside, without timing: the context switches of the `sled-io-*` threads over
//! [`FLUSHES`] awaited flushes, read from `/proc/self/task/*/status`. A woken thread that finds
//! nothing to do still switches in and out. Measured on the 2-core CI machine, flushes 1 ms
//! apart, 10–15 runs each: 12.4–15.4 switches a flush with upstream's pool (the [patch]
//! removed), quiet or with a busy loop on one core; 3.0–3.5 with the patched one (a flush is
//! two tasks, the flush and the log buffer's write, plus waits on sled's condition variables).
//! The bound, 6, lies between. This test is its own binary because the pool is process-wide.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Awaited flushes the test makes, each after a small write.
const FLUSHES: u64 = 200;

/// Idle workers sled's pool keeps (`DESIRED_WAITING_THREADS`).
const POOL_WORKERS: usize = 7;

/// Most context switches of the `sled-io` threads per flush that the test accepts.
const BOUND: f64 = 6.0;

/// Context switches (voluntary and involuntary) of each `sled-io-*` thread of this process, by
/// thread id. A thread that has not yet named itself (std names a thread from inside it, once
/// it first runs) is not counted yet.
fn sled_io_switches() -> std::io::Result<HashMap<String, u64>> {
    let mut by_thread = HashMap::new();
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("sled-io") {
            continue;
        }
        let tid = dir
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        by_thread.insert(tid, switches_of(&dir.join("status"))?);
    }
    Ok(by_thread)
}

/// Sum of `voluntary_ctxt_switches` and `nonvoluntary_ctxt_switches` in a task's status file
/// (0 when the thread exited meanwhile).
fn switches_of(status: &Path) -> std::io::Result<u64> {
    let Ok(text) = std::fs::read_to_string(status) else {
        return Ok(0);
    };
    Ok(text
        .lines()
        .filter(|l| l.contains("ctxt_switches:"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
        .sum())
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "current_thread")]
async fn a_flush_wakes_one_sled_io_thread_not_every_idle_one() {
    let db = sled::Config::new()
        .temporary(true)
        .flush_every_ms(None)
        .open()
        .expect("temporary sled");
    let tree = db.open_tree("log").expect("tree");
    // The pool's threads start with the first task; wait (bounded) until all of them run and
    // have named themselves, so that every switch from here on is counted.
    tree.insert(b"warm", b"up".as_slice()).expect("insert");
    tree.flush_async().await.expect("flush");
    let started = Instant::now();
    let mut before = sled_io_switches().expect("read /proc/self/task");
    while before.len() < POOL_WORKERS && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        before = sled_io_switches().expect("read /proc/self/task");
    }
    assert!(
        before.len() >= POOL_WORKERS,
        "sled keeps {POOL_WORKERS} idle workers; {} named within 10 s",
        before.len()
    );
    for i in 0..FLUSHES {
        tree.insert(i.to_be_bytes(), b"entry".as_slice())
            .expect("insert");
        tree.flush_async().await.expect("flush");
        // Lets the workers settle back into their wait between flushes, as between a loaded
        // node's appends: a flush that finds them still on the mutex wakes fewer of them.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let after = sled_io_switches().expect("read /proc/self/task");
    let switches: u64 = after
        .iter()
        .map(|(tid, n)| n.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum();
    let per_flush = switches as f64 / FLUSHES as f64;
    println!(
        "{} sled-io threads, {per_flush:.2} context switches per flush",
        after.len()
    );
    assert!(
        per_flush >= 0.5,
        "the flushes should have run on sled's pool: {per_flush:.2} switches per flush"
    );
    assert!(
        per_flush < BOUND,
        "{per_flush:.2} context switches of sled's I/O threads per flush: the pool wakes \
         every idle thread again (is the [patch.crates-io] of vendor/sled in place?)"
    );
}
