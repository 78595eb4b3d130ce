//! A tiny [`App`] for exercising the Raft layer without the ledger: named counters whose value
//! resets once its time-to-live has passed, measured with the leader-stamped time.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::app::{App, AppError};
use super::codec::{decode, encode};

/// One counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    /// Current value.
    pub value: u64,
    /// Stamped time (Unix ms) from which the counter counts as expired.
    pub expires_at_ms: u64,
}

/// A command for [`CounterApp`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CounterCmd {
    /// Adds `by` to counter `key` (restarting from 0 if it expired) and sets its expiry to
    /// `ttl_ms` milliseconds after the stamped time.
    Add {
        /// Counter name.
        key: String,
        /// Amount to add (saturating).
        by: u64,
        /// Time to live from now, ms.
        ttl_ms: u64,
    },
    /// Deletes counter `key`.
    Remove {
        /// Counter name.
        key: String,
    },
}

/// The result of a [`CounterCmd`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterResponse {
    /// Value after the command (0 after `Remove`).
    pub value: u64,
    /// Expiry after the command, Unix ms (0 after `Remove`).
    pub expires_at_ms: u64,
    /// The clamped stamped time the command was applied at, Unix ms.
    pub applied_at_ms: u64,
}

/// Named expiring counters.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CounterApp {
    counters: BTreeMap<String, Counter>,
}

impl CounterApp {
    /// The value of `key` at `now_ms` (Unix ms), `None` when absent or expired.
    pub fn get(&self, key: &str, now_ms: u64) -> Option<u64> {
        self.counters
            .get(key)
            .filter(|c| now_ms < c.expires_at_ms)
            .map(|c| c.value)
    }

    /// All counters, expired ones included.
    pub fn counters(&self) -> &BTreeMap<String, Counter> {
        &self.counters
    }
}

impl App for CounterApp {
    type Command = CounterCmd;
    type Response = CounterResponse;

    fn apply(&mut self, cmd: &CounterCmd, now_ms: u64) -> CounterResponse {
        match cmd {
            CounterCmd::Add { key, by, ttl_ms } => {
                let counter = self.counters.entry(key.clone()).or_insert(Counter {
                    value: 0,
                    expires_at_ms: 0,
                });
                if now_ms >= counter.expires_at_ms {
                    counter.value = 0;
                }
                counter.value = counter.value.saturating_add(*by);
                counter.expires_at_ms = now_ms.saturating_add(*ttl_ms);
                CounterResponse {
                    value: counter.value,
                    expires_at_ms: counter.expires_at_ms,
                    applied_at_ms: now_ms,
                }
            }
            CounterCmd::Remove { key } => {
                self.counters.remove(key);
                CounterResponse {
                    value: 0,
                    expires_at_ms: 0,
                    applied_at_ms: now_ms,
                }
            }
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        // A map of strings and integers always encodes; an empty snapshot would only make
        // restore fail loudly, never silently lose state.
        encode(&self.counters).unwrap_or_default()
    }

    fn restore(bytes: &[u8]) -> Result<Self, AppError> {
        let counters = decode(bytes).map_err(|e| AppError::CorruptSnapshot(e.to_string()))?;
        Ok(Self { counters })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add(key: &str, by: u64, ttl_ms: u64) -> CounterCmd {
        CounterCmd::Add {
            key: key.into(),
            by,
            ttl_ms,
        }
    }

    #[test]
    fn counter_expires_at_stamped_time() {
        let mut app = CounterApp::default();
        assert_eq!(app.apply(&add("a", 2, 100), 1_000).value, 2);
        assert_eq!(app.apply(&add("a", 3, 100), 1_099).value, 5);
        assert_eq!(app.get("a", 1_198), Some(5));
        assert_eq!(app.get("a", 1_199), None);
        assert_eq!(app.apply(&add("a", 1, 100), 1_199).value, 1);
    }

    #[test]
    fn snapshot_round_trips_and_rejects_garbage() {
        let mut app = CounterApp::default();
        app.apply(&add("x", 7, 50), 10);
        app.apply(&add("y", 1, 50), 20);
        let restored = CounterApp::restore(&app.snapshot()).expect("restore");
        assert_eq!(restored, app);
        assert!(matches!(
            CounterApp::restore(&[0xff, 0xff, 0xff]),
            Err(AppError::CorruptSnapshot(_))
        ));
    }
}
