//! Settings of request tracking by the API facade.

/// Settings of request tracking by request id (reservations, held concurrency slots, tombstones),
/// in milliseconds; the `gateway:` section of the settings file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrackingSettings {
    /// A reservation's lifetime when the Reserve does not say, ms (default 30 000).
    pub default_reserve_ttl_ms: u64,
    /// Longest lifetime a Reserve may ask for, ms (default 3 600 000).
    pub max_reserve_ttl_ms: u64,
    /// How long a checked request's concurrency slots are held without a `Done`, ms (default
    /// 60 000): a gateway that forgets a request cannot leak its slots for longer.
    pub slot_ttl_ms: u64,
    /// How long a settled or expired reservation is remembered (repeated Settles get the same
    /// answer), ms (default 300 000).
    pub tombstone_ms: u64,
    /// Most requests tracked at once (memory bound; default 100 000).
    pub max_tracked: usize,
}

impl Default for TrackingSettings {
    fn default() -> Self {
        TrackingSettings {
            default_reserve_ttl_ms: 30_000,
            max_reserve_ttl_ms: 3_600_000,
            slot_ttl_ms: 60_000,
            tombstone_ms: 300_000,
            max_tracked: 100_000,
        }
    }
}
