//! Buffers reused across requests, so that deciding a request allocates nothing once a thread
//! has served a few (issue 13 item 5): a [`Pooled`] value is taken from its thread's pool (or
//! made when the pool is empty) and goes back, emptied but with its capacity, to the pool of the
//! thread that drops it.

use allot_common::limiter::DescriptorStatus;
use std::cell::RefCell;
use std::thread::LocalKey;

/// Most buffers of one kind a thread keeps (more are freed): enough for the requests one
/// runtime worker has in flight at once.
const KEEP: usize = 16;

/// A buffer kind with a per-thread pool.
pub trait Reuse: Default + 'static {
    /// Empties the buffer, keeping its capacity.
    fn reset(&mut self);
    /// This kind's per-thread pool.
    fn pool() -> &'static LocalKey<RefCell<Vec<Self>>>;
}

thread_local! {
    static STATUSES: RefCell<Vec<Vec<DescriptorStatus>>> = const { RefCell::new(Vec::new()) };
    static STRINGS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

impl Reuse for Vec<DescriptorStatus> {
    fn reset(&mut self) {
        self.clear();
    }
    fn pool() -> &'static LocalKey<RefCell<Vec<Self>>> {
        &STATUSES
    }
}

impl Reuse for String {
    fn reset(&mut self) {
        self.clear();
    }
    fn pool() -> &'static LocalKey<RefCell<Vec<Self>>> {
        &STRINGS
    }
}

/// A buffer from its thread's pool, returned to the dropping thread's pool.
#[derive(Debug)]
pub struct Pooled<T: Reuse>(T);

impl<T: Reuse> Pooled<T> {
    /// An empty buffer: one kept by this thread, or a new one.
    pub fn take() -> Self {
        let reused = T::pool()
            .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.pop()))
            .ok()
            .flatten();
        Pooled(reused.unwrap_or_default())
    }
}

impl<T: Reuse> Drop for Pooled<T> {
    fn drop(&mut self) {
        let mut buf = std::mem::take(&mut self.0);
        buf.reset();
        // A thread that is exiting, or whose pool is full or in use, frees the buffer.
        let _ = T::pool().try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                if p.len() < KEEP {
                    p.push(buf);
                }
            }
        });
    }
}

impl<T: Reuse + Clone> Clone for Pooled<T> {
    fn clone(&self) -> Self {
        let mut c = Pooled::<T>::take();
        c.0.clone_from(&self.0);
        c
    }
}

impl<T: Reuse> std::ops::Deref for Pooled<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Reuse> std::ops::DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}
