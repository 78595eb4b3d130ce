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
            match self
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
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
