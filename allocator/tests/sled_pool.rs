//! sled's I/O thread pool wakes one thread per task (the patch in `vendor/sled`,
//! `ALLOT-PATCH.md`): upstream sled 0.34.7 woke every idle worker (seven at least) for each
//! flush and each log-buffer write, which made those threads about half of a loaded allocator
//! node's CPU (`docs/benchmarks.md`, "sled's pool wakes one thread").
//!
//! Checked from outside, without timing: the context switches of the `sled-io-*` threads over
//! [`FLUSHES`] awaited flushes, read from `/proc/self/task/*/status`. A woken thread that finds
//! nothing to do still switches in and out. Measured on the 2-core CI machine: 10.4 switches a
//! flush with upstream's pool (the [patch] removed), 3.1–3.5 with the patched one (a flush is two
//! tasks, the flush and the log buffer's write, plus waits on sled's condition variables). The
//! bound, 6, lies between. This test is its own binary because the pool is process-wide.

use std::path::Path;

/// Awaited flushes the test makes, each after a small write.
const FLUSHES: u64 = 200;

/// Context switches of every `sled-io-*` thread of this process (voluntary and involuntary).
fn sled_io_switches() -> std::io::Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task")? {
        let dir = task?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("sled-io") {
            continue;
        }
        total += switches_of(&dir.join("status"))?;
    }
    Ok(total)
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
    // The pool's threads start with the first task; let them start and settle first.
    tree.insert(b"warm", b"up".as_slice()).expect("insert");
    tree.flush_async().await.expect("flush");
    let before = sled_io_switches().expect("read /proc/self/task");
    let workers = std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("sled-io"))
        .count();
    assert!(workers >= 7, "sled keeps seven idle workers; saw {workers}");
    for i in 0..FLUSHES {
        tree.insert(i.to_be_bytes(), b"entry".as_slice())
            .expect("insert");
        tree.flush_async().await.expect("flush");
    }
    let per_flush = (sled_io_switches().expect("read /proc/self/task") - before) as f64
        / FLUSHES as f64;
    println!("{workers} sled-io threads, {per_flush:.2} context switches per flush");
    assert!(
        per_flush >= 0.5,
        "the flushes should have run on sled's pool: {per_flush:.2} switches per flush"
    );
    assert!(
        per_flush < 6.0,
        "{per_flush:.2} context switches of sled's I/O threads per flush: the pool wakes \
         every idle thread again (is the [patch.crates-io] of vendor/sled in place?)"
    );
}
