//! The leased key tables of one config snapshot.

use super::KeyLease;
use allot_common::config::{Rule, RuleLimit, Scope};
use allot_common::descriptor::Entry;
use allot_common::keyed::{Keyed, ShardedTable};
use allot_common::name::NameIndex;
use std::sync::Arc;

/// Per domain, per rule index: the rule's lease key table (`None` for rules that are not
/// leased). Built by [`LeaseBook::apply`](super::LeaseBook::apply) from one config snapshot.
#[derive(Debug, Default)]
pub struct LeaseTables(pub(super) NameIndex<Vec<Option<Arc<ShardedTable<KeyLease>>>>>);

impl LeaseTables {
    pub(super) fn table(
        &self,
        domain: &str,
        rule_index: u32,
    ) -> Option<&Arc<ShardedTable<KeyLease>>> {
        self.0.get(domain)?.get(rule_index as usize)?.as_ref()
    }

    /// The lease state of key `entries` of rule `rule_index` in `domain`, if it exists.
    pub fn existing(
        &self,
        domain: &str,
        rule_index: u32,
        entries: &[Entry<'_>],
    ) -> Option<Arc<Keyed<KeyLease>>> {
        let table = self.table(domain, rule_index)?;
        table.get(entries, table.hash(entries))
    }
}

/// Whether an agent leases this rule from the allocator.
pub fn leased(r: &Rule) -> bool {
    r.scope == Scope::Global && matches!(r.limit, RuleLimit::Limited { .. })
}
