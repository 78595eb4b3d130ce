//! One key's state behind one compare-and-swap (design §10 "All or nothing"): a bucket
//! whose numbers fit is kept as one 128-bit word ([`RateAlgorithm::pack`]) that a decision
//! replaces with a single compare-and-swap; any other state, and any operation that needs more
//! than one key or more than the word (config transitions, eviction, multi-descriptor
//! requests), uses the mutex beside it.
//!
//! The protocol: the word holds either a packed state or [`SLOW`]. Whoever locks the mutex
//! first *takes* the word (swaps in `SLOW`, unpacking a packed state into the mutex), so no
//! compare-and-swap can succeed while the lock is held; unlocking puts the packed state back
//! when it packs. A decision on the word that finds `SLOW` locks the mutex instead. Either way
//! every change of the state is one atomic step on the word or happens under the lock while
//! the word is `SLOW`: a token is never spent twice and never created.
//!
//! [`RateAlgorithm::pack`]: crate::algorithm::RateAlgorithm::pack

use parking_lot::{Mutex, MutexGuard};
use portable_atomic::AtomicU128;
use std::sync::atomic::{AtomicU64, Ordering};

/// The word of a cell whose state is in its mutex (never a packed state).
pub const SLOW: u128 = u128::MAX;

/// Replaces `word` by `new` if it is `current` (`Ok(current)`), else leaves it (`Err` with
/// the word as it is): `compare_exchange` (sequentially consistent either way).
///
/// On x86-64 with `cmpxchg16b` (every x86-64 CPU since about 2006; checked at run time unless
/// the build targets it), where portable-atomic's `AtomicU128` uses it too
/// ([`inline_cmpxchg16b`]), this is the instruction in line. portable-atomic's own call, made
/// through a function pointer chosen at run time, returned its answer through memory: on the
/// decision path that cost 2–3 ns of ~23 with the real clock, whose read the
/// compare-and-swap waits for.
#[inline(always)]
fn compare_exchange(word: &AtomicU128, current: u128, new: u128) -> Result<u128, u128> {
    #[cfg(all(target_arch = "x86_64", target_pointer_width = "64"))]
    if inline_cmpxchg16b() {
        // SAFETY: portable-atomic's `AtomicU128` is lock-free here (checked just above), so
        // the CPU has `cmpxchg16b` and portable-atomic itself accesses the word only with
        // lock-free 16-byte instructions (`cmpxchg16b`, or aligned `vmovdqa` where it deems
        // that atomic), so this locked read-modify-write is atomic with respect to all of
        // them; `as_ptr` is valid for the cell's lifetime and 16-byte aligned
        // (portable-atomic's `AtomicU128` is).
        return unsafe { cmpxchg16b(word.as_ptr(), current, new) };
    }
    word.compare_exchange(current, new, Ordering::AcqRel, Ordering::Acquire)
}

/// Whether [`compare_exchange`] runs `lock cmpxchg16b` in line: exactly when portable-atomic
/// implements `AtomicU128` with lock-free 16-byte instructions itself (`cmpxchg16b` at compile
/// time, or found by its run-time check: the same CPUID bit as
/// `is_x86_feature_detected!("cmpxchg16b")`, cached). The CPU's having the instruction is not
/// enough: built with `--cfg portable_atomic_no_outline_atomics`, for SGX or under Miri,
/// portable-atomic keeps the word behind its lock-based fallback, which an in-line
/// instruction would bypass (lost updates). Miri cannot run inline asm at all.
#[cfg(all(target_arch = "x86_64", target_pointer_width = "64"))]
#[inline(always)]
fn inline_cmpxchg16b() -> bool {
    !cfg!(miri) && AtomicU128::is_lock_free()
}

/// `lock cmpxchg16b` on `dst`: see [`compare_exchange`]. (Only with 64-bit pointers: the
/// address is used as all of RDI, which x32's 32-bit pointer would not fill.)
///
/// # Safety
/// The CPU must support `cmpxchg16b`; `dst` must be valid for reads and writes, 16-byte
/// aligned, and accessed by others only atomically.
#[cfg(all(target_arch = "x86_64", target_pointer_width = "64"))]
#[inline(always)]
unsafe fn cmpxchg16b(dst: *mut u128, current: u128, new: u128) -> Result<u128, u128> {
    let (prev_lo, prev_hi): (u64, u64);
    // The instruction takes the new value in RCX:RBX. RBX cannot be named as an operand (LLVM
    // may use it for itself), so the low half goes in through RSI and is swapped with RBX
    // around the instruction, which puts RBX back. Every operand is in a named register:
    // one the compiler chose could be RBX itself.
    // SAFETY: the caller's guarantees; besides the named registers the instruction changes
    // only the flags, and RBX is restored.
    unsafe {
        std::arch::asm!(
            "xchg rsi, rbx",
            "lock cmpxchg16b xmmword ptr [rdi]",
            "mov rbx, rsi",
            in("rdi") dst,
            inout("rsi") new as u64 => _,
            inout("rax") current as u64 => prev_lo,
            inout("rdx") (current >> 64) as u64 => prev_hi,
            in("rcx") (new >> 64) as u64,
            options(nostack),
        );
    }
    // Swapped exactly when the word was `current` (RDX:RAX then still holds it).
    let prev = u128::from(prev_lo) | (u128::from(prev_hi) << 64);
    if prev == current {
        Ok(prev)
    } else {
        Err(prev)
    }
}

/// A state that may be kept packed in a [`StateCell`]'s word, given `C` (what it needs besides
/// itself to pack: the algorithm, or nothing for a state that carries its parameters).
pub trait Packs<C: ?Sized> {
    /// The word for this state; `None` when it has none (it then stays in the mutex).
    fn pack(&self, ctx: &C) -> Option<u128>;
    /// Replaces this state by the one `word` (from [`pack`](Self::pack)) holds.
    fn unpack(&mut self, ctx: &C, word: u128);
}

/// A key's state: a packed word, or `S` behind a mutex (see the module doc), with a [`Hint`]
/// `H` of the word's value.
#[derive(Debug)]
#[repr(C)]
pub struct StateCell<S, H = NoHint> {
    word: AtomicU128,
    hint: H,
    slow: Mutex<S>,
}

/// Where a [`StateCell`]'s compare-and-swap takes its expected value from.
pub trait Hint: Default {
    /// A guess of the word, or `None` to load it.
    fn guess(&self) -> Option<u128>;
    /// Records the word just written.
    fn set(&self, word: u128);
}

/// No hint: the word is loaded (a key among many, whose word was written long ago).
#[derive(Debug, Default)]
pub struct NoHint;

impl Hint for NoHint {
    #[inline(always)]
    fn guess(&self) -> Option<u128> {
        None
    }

    #[inline(always)]
    fn set(&self, _: u128) {}
}

/// The last word written, in two halves: the expected value of the next compare-and-swap. Only
/// a guess (possibly stale, or halves of two words): the compare-and-swap checks it and
/// returns the current word when it is wrong. It spares a 16-byte load of the word right after
/// the previous 16-byte compare-and-swap wrote it, which the store buffer does not forward and
/// which cost as much as the compare-and-swap itself here: for one key decided over and over
/// ([`DirectLimiter`](crate::direct::DirectLimiter)).
#[derive(Debug, Default)]
pub struct WordHint([AtomicU64; 2]);

impl Hint for WordHint {
    #[inline(always)]
    fn guess(&self) -> Option<u128> {
        let low = self.0[0].load(Ordering::Relaxed);
        let high = self.0[1].load(Ordering::Relaxed);
        Some(u128::from(low) | (u128::from(high) << 64))
    }

    #[inline(always)]
    fn set(&self, word: u128) {
        self.0[0].store(word as u64, Ordering::Relaxed);
        self.0[1].store((word >> 64) as u64, Ordering::Relaxed);
    }
}

impl<S, H: Hint> StateCell<S, H> {
    /// A cell holding `state`, packed (with `ctx`) when it packs.
    pub fn new<C: ?Sized>(state: S, ctx: &C) -> Self
    where
        S: Packs<C>,
    {
        let word = state.pack(ctx).unwrap_or(SLOW);
        let hint = H::default();
        hint.set(word);
        StateCell {
            word: AtomicU128::new(word),
            hint,
            slow: Mutex::new(state),
        }
    }

    /// Replaces the packed state by `f(word)`'s new word with one compare-and-swap (retried
    /// when another decision changed the word first) and returns `f`'s answer for the word it
    /// replaced. `None`, with nothing changed, when the state is not packed now or `f` gives
    /// no new word (it does not pack): then lock the cell. `f` may run several times; only
    /// the run whose word was replaced counts. A new word equal to the old one is not written
    /// (a decision that changes nothing is a read).
    #[inline]
    pub fn update<R>(&self, mut f: impl FnMut(u128) -> Option<(R, u128)>) -> Option<R> {
        // Start from the hint; a wrong one only costs a failed compare-and-swap, which returns
        // the current word.
        let (mut w, mut checked) = match self.hint.guess() {
            Some(w) => (w, false),
            None => (self.word.load(Ordering::Acquire), true),
        };
        loop {
            if w == SLOW && !checked {
                w = self.word.load(Ordering::Acquire);
                checked = true;
            }
            if w == SLOW {
                return None;
            }
            let (r, next) = f(w)?;
            if next == w {
                // A read: valid when `w` is the current word, not just the hint.
                if checked {
                    return Some(r);
                }
                w = self.word.load(Ordering::Acquire);
                checked = true;
                continue;
            }
            match compare_exchange(&self.word, w, next) {
                Ok(_) => {
                    self.hint.set(next);
                    return Some(r);
                }
                Err(current) => {
                    w = current;
                    checked = true;
                }
            }
        }
    }

    /// Locks the cell: the guard's state is current (a packed word is taken into it, with
    /// `ctx`) and no compare-and-swap succeeds until the guard is dropped, which packs it back.
    #[inline]
    pub fn lock<'a, C: ?Sized>(&'a self, ctx: &'a C) -> CellGuard<'a, S, C, H>
    where
        S: Packs<C>,
    {
        self.take(self.slow.lock(), ctx)
    }

    /// As [`lock`](Self::lock), `None` when the mutex is held by someone else right now.
    pub fn try_lock<'a, C: ?Sized>(&'a self, ctx: &'a C) -> Option<CellGuard<'a, S, C, H>>
    where
        S: Packs<C>,
    {
        self.slow.try_lock().map(|g| self.take(g, ctx))
    }

    #[inline]
    fn take<'a, C: ?Sized>(
        &'a self,
        mut guard: MutexGuard<'a, S>,
        ctx: &'a C,
    ) -> CellGuard<'a, S, C, H>
    where
        S: Packs<C>,
    {
        let w = self.word.swap(SLOW, Ordering::AcqRel);
        if w != SLOW {
            S::unpack(&mut guard, ctx, w);
        }
        CellGuard {
            word: &self.word,
            hint: &self.hint,
            guard,
            ctx,
        }
    }
}

/// The locked state of a [`StateCell`]; packs it back into the word when dropped.
pub struct CellGuard<'a, S: Packs<C>, C: ?Sized = (), H: Hint = NoHint> {
    word: &'a AtomicU128,
    hint: &'a H,
    guard: MutexGuard<'a, S>,
    ctx: &'a C,
}

impl<S: Packs<C> + std::fmt::Debug, C: ?Sized, H: Hint> std::fmt::Debug for CellGuard<'_, S, C, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CellGuard").field(&*self.guard).finish()
    }
}

impl<S: Packs<C>, C: ?Sized, H: Hint> std::ops::Deref for CellGuard<'_, S, C, H> {
    type Target = S;
    fn deref(&self) -> &S {
        &self.guard
    }
}

impl<S: Packs<C>, C: ?Sized, H: Hint> std::ops::DerefMut for CellGuard<'_, S, C, H> {
    fn deref_mut(&mut self) -> &mut S {
        &mut self.guard
    }
}

impl<S: Packs<C>, C: ?Sized, H: Hint> Drop for CellGuard<'_, S, C, H> {
    #[inline]
    fn drop(&mut self) {
        // Before the mutex unlocks (the fields drop after this body), so the next holder
        // takes what this one left.
        if let Some(w) = S::pack(&self.guard, self.ctx) {
            self.word.store(w, Ordering::Release);
            self.hint.set(w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_exchange_compares_and_answers_both_halves() {
        let vals = [
            0,
            1,
            u128::from(u64::MAX),
            1 << 64,
            (1 << 64) | 1,
            u128::MAX - 1,
            u128::MAX,
        ];
        for &a in &vals {
            for &b in &vals {
                let w = AtomicU128::new(a);
                // A wrong expectation (differing in either half) changes nothing.
                for &wrong in vals.iter().filter(|&&v| v != a) {
                    assert_eq!(compare_exchange(&w, wrong, b), Err(a));
                    assert_eq!(w.load(Ordering::SeqCst), a);
                }
                assert_eq!(compare_exchange(&w, a, b), Ok(a));
                assert_eq!(w.load(Ordering::SeqCst), b);
                // portable-atomic's own operations see and replace what it wrote.
                assert_eq!(w.swap(a, Ordering::SeqCst), b);
                assert_eq!(compare_exchange(&w, a, a), Ok(a));
            }
        }
    }

    /// The in-line `lock cmpxchg16b` is atomic only with respect to other atomic 16-byte
    /// accesses: it must not run where portable-atomic keeps the word behind its lock-based
    /// fallback (built with `--cfg portable_atomic_no_outline_atomics`, on SGX, under Miri),
    /// which the CPU's having `cmpxchg16b` does not rule out.
    #[cfg(all(target_arch = "x86_64", target_pointer_width = "64"))]
    #[test]
    fn the_inline_instruction_runs_only_where_portable_atomic_is_lock_free() {
        assert!(
            !inline_cmpxchg16b() || AtomicU128::is_lock_free(),
            "lock cmpxchg16b in line on a word portable-atomic guards with a lock"
        );
    }

    #[test]
    fn compare_exchanges_and_portable_atomics_own_updates_lose_nothing_to_each_other() {
        // One thread adds 1 by compare-and-swap loops, one by portable-atomic's fetch_add; the
        // counter starts just below 2^64, so the increments carry into the high half.
        const START: u128 = (1 << 64) - 1_000;
        const EACH: u128 = 200_000;
        let w = AtomicU128::new(START);
        let go = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                go.wait();
                for _ in 0..EACH {
                    let mut cur = w.load(Ordering::Acquire);
                    while let Err(now) = compare_exchange(&w, cur, cur + 1) {
                        cur = now;
                    }
                }
            });
            s.spawn(|| {
                go.wait();
                for _ in 0..EACH {
                    w.fetch_add(1, Ordering::AcqRel);
                }
            });
        });
        assert_eq!(w.load(Ordering::SeqCst), START + 2 * EACH);
    }

    #[test]
    fn concurrent_compare_exchanges_lose_no_update_across_the_halves() {
        // Two threads add 1 to a counter that starts just below 2^64 (every increment near the
        // start carries into the high half), by compare-and-swap loops.
        const START: u128 = (1 << 64) - 1_000;
        const EACH: u128 = 50_000;
        let w = AtomicU128::new(START);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..EACH {
                        let mut cur = w.load(Ordering::Acquire);
                        while let Err(now) = compare_exchange(&w, cur, cur + 1) {
                            cur = now;
                        }
                    }
                });
            }
        });
        assert_eq!(w.load(Ordering::SeqCst), START + 2 * EACH);
    }
}
