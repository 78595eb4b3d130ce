//! How the sled stores make a write durable before they acknowledge it.
//!
//! Production flushes on sled's thread pool ([`Flush::Background`]) so the runtime thread never
//! blocks on `fsync`. A deterministic simulation cannot use that: the flush completes on another
//! OS thread at a moment real scheduling decides, so the simulated instant at which Raft learns
//! an entry is durable would differ from run to run. [`Flush::Inline`] flushes on the calling
//! thread instead: the write is durable when the call returns, at the same simulated instant on
//! every run (issue 12 item 1).
//!
//! The same choice places the stores' other work off the request path: blocking I/O on tokio's
//! blocking pool ([`Flush::off_runtime`]), clean-up nothing waits for ([`Flush::detach`]), and
//! long computations on a thread of their own at a low CPU priority ([`Flush::in_background`]);
//! each at once on the calling thread in a simulation.

/// Where the sled stores run their flushes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Flush {
    /// On sled's thread pool, awaited (`flush_async`): the runtime thread stays free.
    #[default]
    Background,
    /// On the calling thread (`flush`), blocking it until the data is on disk. For simulations
    /// on simulated time; a server should not block its runtime this way.
    Inline,
}

impl Flush {
    /// Flushes `tree` (a whole database flushes through any of its trees) the chosen way;
    /// returns the bytes written, as sled does.
    ///
    /// # Errors
    /// sled's error when the flush fails.
    pub async fn run(self, tree: &sled::Tree) -> sled::Result<usize> {
        match self {
            Flush::Background => tree.flush_async().await,
            Flush::Inline => tree.flush(),
        }
    }

    /// Runs `f` (blocking file I/O, or a long computation) where this mode runs such work: on
    /// tokio's blocking pool ([`Flush::Background`]: the runtime threads stay free, and what `f`
    /// allocates for a while comes from another thread's heap than the runtime's), or at once on
    /// the calling thread ([`Flush::Inline`]: at the same simulated instant on every run).
    ///
    /// # Errors
    /// An I/O error of kind `Other` when the blocking task panicked or was cancelled.
    pub async fn off_runtime<T: Send + 'static>(
        self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<T> {
        match self {
            Flush::Background => tokio::task::spawn_blocking(f)
                .await
                .map_err(std::io::Error::other),
            Flush::Inline => Ok(f()),
        }
    }

    /// Runs `f` where [`Flush::off_runtime`] would, without waiting for it: on tokio's blocking
    /// pool ([`Flush::Background`]), or at once on the calling thread ([`Flush::Inline`], so
    /// that a simulation sees its effect at the same instant on every run). For clean-up whose
    /// effect nothing waits for; `f` reports its own failures.
    pub fn detach(self, f: impl FnOnce() + Send + 'static) {
        match self {
            Flush::Background => {
                // The handle is dropped: the task runs to its end whether or not it is awaited.
                drop(tokio::task::spawn_blocking(f));
            }
            Flush::Inline => f(),
        }
    }

    /// Runs `f` (a long computation nothing latency-critical waits for, such as encoding a
    /// snapshot) on a thread of its own at a lower CPU priority ([`BACKGROUND_NICE`]), or at
    /// once on the calling thread ([`Flush::Inline`]). On a busy node the runtime's threads
    /// then take the CPU from it as soon as they wake: at the same priority, three snapshot
    /// encodings on two cores held the cluster bench's calls for up to 130 ms each time.
    ///
    /// When no thread can be started (a thread limit reached), `f` runs on tokio's blocking
    /// pool at the usual priority instead ([`Flush::off_runtime`]).
    ///
    /// # Errors
    /// An I/O error of kind `Other` when `f` panicked.
    pub async fn in_background<T: Send + 'static>(
        self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<T> {
        if self == Flush::Inline {
            return Ok(f());
        }
        // `f` is shared with the fallback: the spawn fails before the thread takes it.
        let work = std::sync::Arc::new(parking_lot::Mutex::new(Some(f)));
        let (tx, rx) = tokio::sync::oneshot::channel();
        let theirs = work.clone();
        let spawned = std::thread::Builder::new()
            .name("allot-background".into())
            .spawn(move || {
                lower_this_threads_priority();
                if let Some(f) = theirs.lock().take() {
                    // The receiver may be gone (the caller was cancelled): nothing to do.
                    let _ = tx.send(f());
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no thread for background work; it runs on the blocking pool");
            let f = work.lock().take();
            return match f {
                Some(f) => self.off_runtime(f).await,
                None => Err(std::io::Error::other("background work taken by no thread")),
            };
        }
        rx.await
            .map_err(|_| std::io::Error::other("the background work panicked"))
    }
}

/// The nice value of [`Flush::in_background`]'s threads (0 is the default, 19 the lowest
/// priority): CFS gives such a thread about a tenth of a core against one busy at the default
/// (weights 110 and 1024), and the whole of an otherwise idle one. Not 19 (1/70 of a core):
/// on a saturated node a snapshot would then take a minute, holding on to the ledger's old
/// tree nodes and the unpurged log all along.
pub const BACKGROUND_NICE: i32 = 10;

/// Lowers the calling thread's CPU priority to [`BACKGROUND_NICE`], never raises it (a thread
/// starts at its creator's nice value, which a process started with `nice` has raised); on
/// Linux a thread's nice value is its own. Best effort: a refusal leaves the thread as it was.
fn lower_this_threads_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: the gettid system call, getpriority and setpriority take no pointers; they read
    // and change only this thread's nice value. (The system call, not glibc's `gettid`, which
    // needs glibc 2.30.)
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        // -1 is also getpriority's error value; for the calling thread it cannot fail, and a
        // -1 read would only make the thread take BACKGROUND_NICE.
        let now = libc::getpriority(libc::PRIO_PROCESS, tid);
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, now.max(BACKGROUND_NICE));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn background_work_runs_at_the_lower_priority_and_returns_its_value() {
        #[cfg(target_os = "linux")]
        // SAFETY: getpriority takes no pointer; errno is not needed for a thread's own value.
        let nice = || unsafe {
            libc::getpriority(
                libc::PRIO_PROCESS,
                libc::syscall(libc::SYS_gettid) as libc::id_t,
            )
        };
        #[cfg(not(target_os = "linux"))]
        let nice = || BACKGROUND_NICE;
        let before = nice();
        let (value, niced) = Flush::Background
            .in_background(move || (41 + 1, nice()))
            .await
            .expect("ran");
        assert_eq!((value, niced), (42, before.max(BACKGROUND_NICE)));
        assert_eq!(nice(), before, "the caller's thread keeps its priority");
        let inline = Flush::Inline.in_background(|| 7).await.expect("ran");
        assert_eq!(inline, 7);
    }

    #[tokio::test]
    async fn a_panic_in_background_work_is_an_error_not_a_hang() {
        let r = Flush::Background
            .in_background(|| -> u8 { panic!("encoder bug") })
            .await;
        assert!(r.is_err());
    }

    #[tokio::test]
    async fn detached_work_runs_at_once_inline_and_eventually_in_the_background() {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let d = done.clone();
        Flush::Inline.detach(move || d.store(true, std::sync::atomic::Ordering::SeqCst));
        assert!(
            done.load(std::sync::atomic::Ordering::SeqCst),
            "inline: done on return"
        );
        let (tx, rx) = tokio::sync::oneshot::channel();
        Flush::Background.detach(move || {
            let _ = tx.send(());
        });
        rx.await.expect("the detached work ran");
    }
}
