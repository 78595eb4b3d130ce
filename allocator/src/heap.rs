//! How the allocator's process uses its heap (issue 9 item 3, issue 13 item 3).
//!
//! **mimalloc, not glibc's allocator** ([`ProcessAllocator`], installed by `allot-allocator`'s
//! `main` and by the cluster benchmark). Under a flood of Batch calls glibc's allocator took a
//! third of the process's CPU (`_int_malloc`, `malloc_consolidate`, `unlink_chunk`: the heap
//! fragmented by tens of thousands of in-flight messages of every size), and goodput collapsed
//! to a tenth to a fifth of capacity. Measured with `cargo bench -p allot-allocator --bench
//! cluster` (docs/benchmarks.md, 2026-12-06, two runs each): committed decisions/s in Batch
//! calls 32,845–32,922 with glibc, 49,818–56,966 with mimalloc (jemalloc, preloaded: about
//! 60,000); goodput at twice capacity 3,216–6,067/s with glibc, 15,984–28,726/s with mimalloc.
//! The price is memory: at 100,000 keys with live allocations (`allot-bench memory --part
//! leased`, median of three rounds) 1,724 bytes a key against glibc's 1,418 (the target is
//! 2,000), and 61 MB resident at start-up against 14 MB (mimalloc reserves its arenas eagerly;
//! `MIMALLOC_ARENA_EAGER_COMMIT=0` in the environment gave 36 MB and 1,558 bytes a key in one
//! round). jemalloc (2,634) and mimalloc 2.0 (3,218) missed the per-key target.
//!
//! glibc's allocator still serves code linked without the global allocator (the crate's tests,
//! simulations that embed nodes). For those, `free` hands memory back to the system only from
//! the top of a heap, and whole pages freed in the middle stay resident until reused;
//! [`release_free_memory`] (`malloc_trim`) returns them after each snapshot and once every
//! [`RELEASE_EVERY`]. Cost on a 100,000-key ledger under glibc: 6 ms the first time, 30–40 µs
//! when little was freed since, 70 ms after 127 MB was freed. Under mimalloc it finds almost
//! nothing to do (mimalloc purges freed pages itself, after a delay).

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::raft::Flush;

/// The global allocator of the allocator's binaries (`allot-allocator`, the cluster benchmark):
/// mimalloc, installed with `#[global_allocator] static A: ProcessAllocator = PROCESS_ALLOCATOR;`
/// (see the module docs for why not glibc's).
pub type ProcessAllocator = mimalloc::MiMalloc;

/// The value of [`ProcessAllocator`] to install.
pub const PROCESS_ALLOCATOR: ProcessAllocator = mimalloc::MiMalloc;

/// How often a node hands its free heap pages back to the system.
pub const RELEASE_EVERY: Duration = Duration::from_secs(1);

/// Hands every whole free page of the allocator's heaps back to the system (glibc; elsewhere a
/// no-op).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's own arenas; it touches
    // no memory in use and takes no pointer.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Spawns the periodic release, once every `every`, run where `flush` runs blocking work (off
/// the runtime's threads, or inline in a simulation).
pub fn spawn_release(every: Duration, flush: Flush) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            // A failure only means the blocking pool is shutting down; the next tick tries again.
            let _ = flush.off_runtime(release_free_memory).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_release_runs_until_its_task_is_stopped() {
        let task = spawn_release(Duration::from_millis(10), Flush::Inline);
        tokio::time::sleep(Duration::from_millis(35)).await;
        assert!(!task.is_finished());
        task.abort();
        assert!(task.await.is_err_and(|e| e.is_cancelled()));
    }
}
