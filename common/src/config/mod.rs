//! Limit configuration: the envoyproxy/ratelimit YAML format with Allot's additions
//! (`../shared/acceptance/README.md` is the contract), loaded from one file or a folder of files
//! (one domain each), validated before anything is decided.
//!
//! ```yaml
//! domain: acme
//! descriptors:
//!   - key: tenant              # no value: one counter per tenant value
//!     descriptors:
//!       - key: operation
//!         value: search         # this value only
//!         rate_limit:
//!           unit: second        # second | minute | hour | day
//!           unit_multiplier: 1  # period = unit × multiplier
//!           requests_per_unit: 10
//!           algorithm: token_bucket   # gcra | fixed_window | sliding_window | sliding_log
//!           burst: 40           # buckets only; defaults to requests_per_unit
//!           scope: global       # global (leased from the allocator) | local (per agent)
//!           failure_mode: deny  # deny | emergency: what an agent does when its allocation runs out
//!           max_keys: 100000    # distinct values kept at once; idle ones are evicted
//!           max_in_flight: 50   # optional concurrency cap per key (agent only)
//!           fuse: {requests_per_unit: 100, burst: 200}  # loose local flood fuse (agent only)
//!           lease: {ttl_ms: 5000, max_grant: 20, max_drift_ms: 500}   # allocator leasing
//!           # lease also takes max_regions: 64 (regions per key), max_holders: 1024 (holders
//!           # per key and region) and max_allocations: 4096 (live allocations per key and
//!           # region) that the allocator keeps state for
//!           quota: {limit: 20000000, period: month}                  # calendar budget (UTC)
//!           regions: [{region: eu-west, share: "50%"}, {region: us-east, rate: 4}]
//!           shares_mode: weighted   # weighted (shares are guarantees and weights) | cap
//!         shadow_mode: false
//! ```

mod error;
mod raw;
mod validate;

pub use error::ConfigError;

use crate::algorithm::LimitParams;
use crate::descriptor::Entry;
use crate::name::NameIndex;
use crate::units::{Micros, NANOS_PER_SEC};
use hashbrown::HashMap;
use std::path::{Path, PathBuf};

type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Default of `max_keys`: distinct descriptor values one rule keeps state for at once.
pub const DEFAULT_MAX_KEYS: u64 = 100_000;

/// Largest `requests_per_unit` a `sliding_log` rule may have: its memory is O(L) per key.
pub const MAX_SLIDING_LOG_LIMIT: u64 = 100_000;

/// The `unit` of a rate limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3 600 s.
    Hour,
    /// 86 400 s.
    Day,
}

impl Unit {
    /// The unit's length in nanoseconds.
    pub fn nanos(self) -> u64 {
        NANOS_PER_SEC
            * match self {
                Unit::Second => 1,
                Unit::Minute => 60,
                Unit::Hour => 3_600,
                Unit::Day => 86_400,
            }
    }

    /// Envoy's spelling in `RateLimitResponse.RateLimit.Unit` (`SECOND`, …).
    pub fn envoy_name(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Unit> {
        match s.to_ascii_lowercase().as_str() {
            "second" => Some(Unit::Second),
            "minute" => Some(Unit::Minute),
            "hour" => Some(Unit::Hour),
            "day" => Some(Unit::Day),
            _ => None,
        }
    }
}

/// Where a limit is enforced (design §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Scope {
    /// One global budget, leased to agents by the allocator.
    #[default]
    Global,
    /// Each agent enforces the whole limit on its own: the contract is per instance.
    Local,
}

/// What an agent does when its allocation is spent and the allocator is unreachable (design §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FailureMode {
    /// Deny (429 with Retry-After).
    #[default]
    Deny,
    /// Admit from a bounded local emergency bucket, counted in the overshoot bound.
    Emergency,
}

/// Calendar period of a quota, in UTC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarPeriod {
    /// 00:00 UTC to 00:00 UTC.
    Day,
    /// The first of the month 00:00 UTC to the first of the next.
    Month,
}

/// A calendar budget (e.g. 20 M units a month) that the allocator's grants also draw from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CalendarQuota {
    /// Budget per period, in microtokens.
    pub limit: Micros,
    /// The period.
    pub period: CalendarPeriod,
}

/// How the allocator leases a global limit (design §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleLease {
    /// Lease length in milliseconds (default 5 000).
    pub ttl_ms: u64,
    /// Largest single grant, in microtokens (default: a quarter of the capacity, at least 1 token).
    pub max_grant: Micros,
    /// Maximum clock drift between allocator and agents in milliseconds (default 500): an
    /// allocation is dead only at expires-at + this.
    pub max_drift_ms: u64,
    /// Most regions the allocator keeps state for per policy key (default
    /// [`DEFAULT_MAX_REGIONS`]): region names are client-chosen, so an Acquire or Decide from
    /// one more region is refused with RESOURCE_EXHAUSTED (issue 10 item 11). At least the
    /// number of configured `regions`.
    pub max_regions: u64,
    /// Most holders (agents) whose recent asks the allocator keeps per policy key and region
    /// for fair division (default [`DEFAULT_MAX_HOLDERS`]); an ask from one more holder while
    /// that many asked within the idle window is refused with RESOURCE_EXHAUSTED.
    pub max_holders: u64,
    /// Most live allocations the allocator keeps per policy key and region (default
    /// [`DEFAULT_MAX_ALLOCATIONS`]): each Acquire of a client-chosen request id can make one,
    /// so an Acquire beyond it is refused with RESOURCE_EXHAUSTED until one ends.
    pub max_allocations: u64,
}

/// Default of `lease.max_regions`: regions kept per policy key.
pub const DEFAULT_MAX_REGIONS: u64 = 64;

/// Default of `lease.max_holders`: holders whose asks are kept per policy key and region.
pub const DEFAULT_MAX_HOLDERS: u64 = 1_024;

/// Default of `lease.max_allocations`: live allocations kept per policy key and region (a few
/// per holder at the default `max_holders`).
pub const DEFAULT_MAX_ALLOCATIONS: u64 = 4 * DEFAULT_MAX_HOLDERS;

/// Largest `lease.max_regions`, `lease.max_holders` and `lease.max_allocations`: the allocator
/// scans these tables on a key's grant path, so they stay small.
pub const MAX_TABLE_CAP: u64 = 1 << 16;

/// A region's share of a global limit (design §5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionShare {
    /// Region name, e.g. `eu-west`.
    pub region: String,
    /// Share of rate and capacity in parts per million (1 000 000 = all).
    pub share_ppm: u32,
}

/// How a global limit's regional shares divide it (design §5).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum SharesMode {
    /// Shares are guaranteed minimums and weights: a region with demand gets at least its
    /// share within one handoff, and what idle regions leave is divided among the busy ones by
    /// weight (weighted max-min by demand). A share of 0 still means nothing.
    #[default]
    Weighted,
    /// Shares are hard caps that only an operator moves (`allotctl shares set`).
    Cap,
}

/// Parts per million in a whole.
pub const PPM: u32 = 1_000_000;

/// The limit a rule applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleLimit {
    /// `unlimited: true`: never limits.
    Unlimited,
    /// A validated limit.
    Limited {
        /// Exact algorithm parameters.
        params: LimitParams,
        /// `requests_per_unit` as configured (Envoy's `current_limit`).
        requests_per_unit: u64,
        /// `unit` as configured.
        unit: Unit,
        /// `unit_multiplier` as configured.
        unit_multiplier: u64,
    },
}

/// One configured rule: a node of the descriptor tree that carries a `rate_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Canonical identity: domain and the (key, value-or-any) path, e.g.
    /// `acme|tenant|operation=search`. Two config versions with the same id have the same key
    /// shape, so per-key state carries over between them (design §10 "Config versions").
    pub id: String,
    /// `rate_limit.name` when given, else the id; reported as the policy name.
    pub name: String,
    /// What it limits.
    pub limit: RuleLimit,
    /// Decide and count, but always answer OK (design §10 "All or nothing").
    pub shadow_mode: bool,
    /// Where it is enforced.
    pub scope: Scope,
    /// What an agent does when coordination is unavailable.
    pub failure_mode: FailureMode,
    /// Distinct keys kept at once.
    pub max_keys: u64,
    /// Concurrency cap per key (design §10 "Concurrency"): requests in flight at once, released
    /// when the gateway reports the request done; `None` when not capped.
    pub max_in_flight: Option<u64>,
    /// Local fuse (design §10 "Local fuse"): a loose token bucket an agent checks per key before
    /// spending leased tokens, so floods are rejected without touching the allocator. Same unit
    /// as the rule; `None` when not configured.
    pub fuse: Option<LimitParams>,
    /// Calendar quota, when configured.
    pub quota: Option<CalendarQuota>,
    /// Lease settings for the allocator.
    pub lease: RuleLease,
    /// Regional shares; empty means every region draws from the one global bucket.
    pub regions: Vec<RegionShare>,
    /// How `regions` divide the limit (`shares_mode`, default weighted).
    pub shares_mode: SharesMode,
    /// Config file it came from.
    pub source: PathBuf,
}

#[derive(Debug, Clone, Default)]
struct Node {
    children: NameIndex<Children>,
    rule: Option<usize>,
}

#[derive(Debug, Clone, Default)]
struct Children {
    by_value: NameIndex<usize>,
    any: Option<usize>,
}

/// One validated domain: its descriptor tree and rules.
#[derive(Debug, Clone)]
pub struct DomainConfig {
    /// The domain name.
    pub domain: String,
    /// The file it was read from.
    pub source: PathBuf,
    /// Every rule, in file order.
    pub rules: Vec<Rule>,
    nodes: Vec<Node>,
}

impl DomainConfig {
    /// The rule a request descriptor matches (by index into [`rules`](Self::rules)), or `None`
    /// when it matches no node with a `rate_limit` (then it is not limited).
    ///
    /// Walks the tree entry by entry: a child with the entry's exact value wins over one without a
    /// value; an entry that matches no child means no match. Keys and values compare byte for byte.
    pub fn match_rule<'a, I>(&self, entries: I) -> Option<usize>
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let mut node = 0usize;
        let mut any = false;
        for (key, value) in entries {
            any = true;
            node = self.child(node, key, value)?;
        }
        if !any {
            return None;
        }
        self.nodes[node].rule
    }

    /// [`match_rule`](Self::match_rule) on a request descriptor's entries, the form every
    /// decision and refund path holds them in: the same walk over the slice itself, in line
    /// (the decision path's; through the generic iterator it was a call of ~85 instructions
    /// for one entry, issue 13 item 4).
    #[inline]
    pub fn match_entries(&self, entries: &[Entry<'_>]) -> Option<usize> {
        if entries.is_empty() {
            return None;
        }
        let mut node = 0usize;
        for e in entries {
            node = self.child(node, e.key, e.value)?;
        }
        self.nodes[node].rule
    }

    /// The node an entry leads to from `node`: the child with its exact value, else the one
    /// without a value; `None` when its key has no child. A key without valued children (a rule
    /// per key, the usual case) skips the value lookup.
    #[inline]
    fn child(&self, node: usize, key: &str, value: &str) -> Option<usize> {
        let children = self.nodes[node].children.get(key)?;
        if children.by_value.is_empty() {
            return children.any;
        }
        match children.by_value.get(value) {
            Some(&n) => Some(n),
            None => children.any,
        }
    }
}

/// The policy documents at `path`: every `*.yaml` / `*.yml` file of a folder (subfolders are
/// not read), sorted by name so domains load in the same order everywhere; or `path` itself when
/// it is not a folder, whatever its name. The one rule by which the agent, the allocator and the
/// tools find policy files; an empty list (a folder without one) is for the caller to judge.
///
/// # Errors
/// The I/O error of reading `path` or listing the folder.
pub fn policy_paths(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !std::fs::metadata(path)?.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path)? {
        let p = entry?.path();
        let yaml = matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("yaml") | Some("yml")
        );
        if yaml && p.is_file() {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// One policy file as read: its path and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyDocument {
    /// The file.
    pub file: PathBuf,
    /// Its contents (UTF-8).
    pub text: String,
}

/// Reads the policy documents at `path` ([`policy_paths`]).
///
/// # Errors
/// [`ConfigError::Io`] for an unreadable path or file, [`ConfigError::Empty`] for a folder
/// without a policy file.
pub fn read_policy_documents(path: &Path) -> Result<Vec<PolicyDocument>, ConfigError> {
    let files = policy_paths(path).map_err(|e| ConfigError::Io {
        file: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if files.is_empty() {
        return Err(ConfigError::Empty {
            dir: path.to_path_buf(),
        });
    }
    files
        .into_iter()
        .map(|file| match std::fs::read_to_string(&file) {
            Ok(text) => Ok(PolicyDocument { file, text }),
            Err(e) => Err(ConfigError::Io {
                message: e.to_string(),
                file,
            }),
        })
        .collect()
}

/// A validated set of domains: what a limiter decides with.
#[derive(Debug, Clone, Default)]
pub struct ConfigSet {
    domains: Map<String, DomainConfig>,
}

impl ConfigSet {
    /// Loads a YAML file, or every `*.yaml` / `*.yml` file of a folder (one domain each).
    ///
    /// # Errors
    /// [`ConfigError`] naming the file, the field path and the bad value, for unreadable files,
    /// YAML syntax errors, unknown fields, invalid values, or a domain defined twice.
    pub fn load(path: &Path) -> Result<ConfigSet, ConfigError> {
        ConfigSet::from_documents(&read_policy_documents(path)?)
    }

    /// Validates documents already read ([`read_policy_documents`]): one domain each, in order.
    /// A reload keeps the documents it built from, so it can tell a changed file from an
    /// unchanged one without reading twice.
    ///
    /// # Errors
    /// As [`load`](Self::load), except I/O.
    pub fn from_documents(docs: &[PolicyDocument]) -> Result<ConfigSet, ConfigError> {
        let mut set = ConfigSet::default();
        for doc in docs {
            set.insert(ConfigSet::parse_domain(&doc.text, &doc.file)?)?;
        }
        Ok(set)
    }

    /// Parses and validates one domain from YAML text; `file` names it in errors.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn parse_domain(text: &str, file: &Path) -> Result<DomainConfig, ConfigError> {
        validate::domain(text, file)
    }

    /// Parses one YAML document into a set with that single domain.
    ///
    /// # Errors
    /// As [`load`](Self::load).
    pub fn from_yaml(text: &str, file: &Path) -> Result<ConfigSet, ConfigError> {
        let mut set = ConfigSet::default();
        set.insert(ConfigSet::parse_domain(text, file)?)?;
        Ok(set)
    }

    /// Adds a domain.
    ///
    /// # Errors
    /// [`ConfigError::DuplicateDomain`] when the domain is already present.
    pub fn insert(&mut self, d: DomainConfig) -> Result<(), ConfigError> {
        if let Some(other) = self.domains.get(&d.domain) {
            return Err(ConfigError::DuplicateDomain {
                domain: d.domain.clone(),
                first: other.source.clone(),
                second: d.source.clone(),
            });
        }
        self.domains.insert(d.domain.clone(), d);
        Ok(())
    }

    /// The domain named `name`.
    pub fn domain(&self, name: &str) -> Option<&DomainConfig> {
        self.domains.get(name)
    }

    /// All domains, in no particular order.
    pub fn domains(&self) -> impl Iterator<Item = &DomainConfig> {
        self.domains.values()
    }

    /// The same limits, every rule enforced with `scope` (design §2): `Scope::Local` makes one
    /// process the whole limiter, with no allocator, e.g. an agent replaying a trace on its own.
    pub fn with_scope(mut self, scope: Scope) -> ConfigSet {
        for d in self.domains.values_mut() {
            for r in &mut d.rules {
                r.scope = scope;
            }
        }
        self
    }
}
