//! What the lease book asks of the lease manager.

use super::KeyLease;
use allot_common::keyed::Keyed;
use allot_common::units::Micros;
use std::sync::Arc;
use tokio::sync::oneshot;

/// What the lease manager is asked to do.
#[derive(Debug)]
pub enum LeaseEvent {
    /// The key needs an allocation (cold, exhausted, or below the low watermark).
    Acquire(Arc<Keyed<KeyLease>>),
    /// A central decision of the cost (µtokens) for a waiting request of a central key; the
    /// sender is dropped (or signalled) once the answer is recorded on the key.
    Decide(Arc<Keyed<KeyLease>>, Micros, oneshot::Sender<()>),
}
