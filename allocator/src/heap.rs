//! How the allocator's process uses glibc's heap (issue 13 item 3).
//!
//! glibc gives threads heaps of their own (arenas, up to eight per core) so that they do not
//! wait on each other's allocations; each keeps its own free pages. The ledger is changed by
//! whichever runtime thread applies the next entry, so it ended up spread over several arenas,
//! each partly used. `allot-bench memory --part leased` at 100,000 keys (docs/benchmarks.md,
//! 2026-12-05, median of three rounds): 2,124 bytes a key (1,897–2,129) with the default
//! arenas, 1,408 (1,396–1,653) with two ([`limit_arenas`]); single rounds with one arena gave
//! 1,363. The ledger's own heap is 1,272 bytes a key (`ledger::tests_memory`). Small
//! allocations mostly come from each thread's cache without taking an arena's lock, so two
//! arenas cost the runtime's two worker threads little.
//!
//! `free` hands memory back to the system only from the top of a heap; whole pages freed in
//! the middle stay resident until reused, and the allocator frees there often (Raft entries,
//! RPC buffers and decoded batches live for one command; a snapshot frees a copy of the whole
//! state). `malloc_trim` returns them: after each snapshot and once every [`RELEASE_EVERY`], so
//! freed pages stay resident for one period at most. Its effect on the leased figure was within
//! that figure's spread (2,311 → 2,124 bytes a key, ranges overlapping). Cost, measured on a
//! ledger of 100,000 keys: 6 ms the first time, 30–40 µs when little was freed since, 70 ms
//! after 127 MB was freed (the pages handed back); a page handed back and used again costs a
//! page fault.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

use crate::raft::Flush;

/// How often a node hands its free heap pages back to the system.
pub const RELEASE_EVERY: Duration = Duration::from_secs(1);

/// Most heaps (arenas) glibc gives the process's threads: the main thread's and one shared by
/// the others (see the module docs).
pub const MAX_ARENAS: i32 = 2;

/// Limits glibc to [`MAX_ARENAS`] heaps (elsewhere a no-op). Call it first thing in `main`,
/// before any thread is started: arenas made before it are kept.
pub fn limit_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a parameter of the allocator; it takes no pointer.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, MAX_ARENAS);
    }
}

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
