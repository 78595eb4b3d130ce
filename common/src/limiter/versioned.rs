//! Config versions (design §10 "Config versions"): an applied [`ConfigSet`] becomes an immutable
//! [`Snapshot`]; key tables of rules whose id (key shape) is unchanged carry over, and their keys
//! move to the new parameters lazily, at the snapshot's activation time.

use super::{Limiter, Map, NEXT_LIMITER};
use crate::config::{ConfigSet, DomainConfig, RuleLimit};
use crate::descriptor::{Request, RequestError};
use crate::keyed::KeyTable;
use crate::name::NameIndex;
use crate::units::Nanos;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A domain of a snapshot with its rules' key tables.
#[derive(Debug)]
pub struct SnapshotDomain {
    /// The validated config.
    pub config: DomainConfig,
    /// One key table per rule, by rule index.
    pub(super) tables: Vec<Arc<KeyTable>>,
}

impl SnapshotDomain {
    /// The key table of rule `i`.
    pub fn table(&self, i: usize) -> &Arc<KeyTable> {
        &self.tables[i]
    }
}

/// An immutable config version.
#[derive(Debug)]
pub struct Snapshot {
    /// Increases by one with every applied config, from 1.
    pub version: u64,
    /// When it took effect, in ns; state changes of this version start here.
    pub activated_at: Nanos,
    domains: NameIndex<SnapshotDomain>,
}

impl Snapshot {
    /// The domain named `name`.
    pub fn domain(&self, name: &str) -> Option<&SnapshotDomain> {
        self.domains.get(name)
    }

    /// All domains.
    pub fn domains(&self) -> impl Iterator<Item = &SnapshotDomain> {
        self.domains.values()
    }
}

impl Snapshot {
    /// Validates `req` and finds its domain.
    #[inline]
    pub(super) fn domain_of(&self, req: &Request<'_>) -> Result<&SnapshotDomain, RequestError> {
        req.validate()?;
        self.domains
            .get(req.domain)
            .ok_or_else(|| RequestError::UnknownDomain(req.domain.to_string()))
    }
}

impl Limiter {
    /// A limiter deciding with `config` from `now` on.
    pub fn new(config: ConfigSet, now: Nanos) -> Self {
        let l = Limiter {
            current: ArcSwap::from_pointee(Snapshot {
                version: 0,
                activated_at: now,
                domains: NameIndex::default(),
            }),
            generation: AtomicU64::new(0),
            id: NEXT_LIMITER.fetch_add(1, Ordering::Relaxed),
            tables: Mutex::new(Map::default()),
        };
        l.apply(config, now);
        l
    }

    /// Makes `config` the current version at `now`; returns its version number. State of rules
    /// with the same id (same key shape) carries over; other state is dropped.
    pub fn apply(&self, config: ConfigSet, now: Nanos) -> u64 {
        let mut tables = self.tables.lock();
        let old = self.current.load();
        let version = old.version + 1;
        let mut next: Map<String, Arc<KeyTable>> = Map::default();
        let mut domains = NameIndex::default();
        for d in config.domains() {
            let mut ts = Vec::with_capacity(d.rules.len());
            for r in &d.rules {
                let t = tables
                    .get(&r.id)
                    .cloned()
                    .unwrap_or_else(|| Arc::new(KeyTable::new(r.max_keys)));
                t.set_max_keys(r.max_keys);
                if let RuleLimit::Limited { params, .. } = r.limit {
                    t.transition_all(&params, version, now);
                }
                next.insert(r.id.clone(), t.clone());
                ts.push(t);
            }
            domains.insert(
                &d.domain,
                SnapshotDomain {
                    config: d.clone(),
                    tables: ts,
                },
            );
        }
        *tables = next;
        self.current.store(Arc::new(Snapshot {
            version,
            activated_at: now,
            domains,
        }));
        // After the store: a decision that sees this generation loads the new snapshot.
        self.generation.fetch_add(1, Ordering::Release);
        version
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }
}
