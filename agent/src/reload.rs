//! Policy reload (design §10 "Config versions", seed §28): the agent reads its policy file or
//! folder again on SIGHUP and, when `policy_reload_ms` is set, at every poll, and makes a valid
//! changed set current through [`Decider::apply`]. State of unchanged rules carries over, leased
//! keys size their next Acquire by the new rule, keys of rules no longer leased release what
//! they hold ([`LeaseBook::apply`](crate::lease::LeaseBook::apply)), and a decision in flight
//! finishes under the version it started with.
//!
//! A SIGHUP applies changed files at once (the operator says they are complete); a poll only
//! once the previous poll read the same changed bytes, so a file or folder caught half-way
//! through a non-atomic write is not applied. Bytes equal to the current version's are never
//! applied again, so a poll never bumps the version of an unchanged file (comparing contents,
//! not modification times, which a ConfigMap's symlink swap or a copy may not change).
//!
//! An unreadable or invalid set changes nothing: the current version keeps deciding, the error
//! is logged and counted once per distinct failure (`allot_agent_policy_reloads{result=
//! "rejected"}`, `allot_agent_policy_reload_ok` 0).

use crate::api::Decider;
use crate::server::first_leased;
use allot_common::config::{read_policy_documents, ConfigError, ConfigSet, PolicyDocument};
use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::watch;

/// A SIGHUP handler, to be installed before the agent announces itself ready: from then on
/// SIGHUP reloads (its default action would end the process). `None`, logged, when it cannot
/// be installed; the poll still runs.
pub fn hangup_signal() -> Option<Signal> {
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGHUP: policies reload only by polling");
            None
        }
    }
}

/// Why a reload was refused; the current policies stay in force.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadError {
    /// The files could not be read or are not a valid policy set (names the file, the field
    /// and the value, as at start).
    #[error(transparent)]
    Policies(#[from] ConfigError),
    /// A rule became `scope: global` on an agent started without an allocator.
    #[error(
        "policy {rule:?} has scope: global (leased from the allocator) but this agent has no \
         allocator endpoint"
    )]
    LeasedWithoutAllocator {
        /// The rule's name.
        rule: String,
    },
}

/// What one check of the policy files did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reload {
    /// The files hold what is deciding now; nothing applied.
    Unchanged,
    /// The files were put back to what is deciding now after a refusal: nothing applied, and
    /// the refusal is over (logged, so the last word in the log is not the error).
    Restored,
    /// A poll read changed files for the first time: they are applied when the next poll reads
    /// the same bytes (a writer may be half-way through a file or a folder), or at once on
    /// SIGHUP.
    Changing,
    /// A new version is deciding.
    Applied {
        /// Its version number.
        version: u64,
    },
    /// Refused; the current version keeps deciding.
    Rejected {
        /// Why.
        error: ReloadError,
        /// The previous check was refused for the same reason (not logged or counted again).
        repeated: bool,
    },
}

/// The agent's policy files and what was last made of them.
pub struct PolicyFiles {
    path: PathBuf,
    leasing: bool,
    decider: Arc<Decider>,
    state: Mutex<Seen>,
}

/// What one read of the policy files gave: the documents, or why they could not be read.
type Read = Result<Vec<PolicyDocument>, ConfigError>;

/// The contents deciding now, a changed read seen once by a poll, and the last refused read.
struct Seen {
    current: Vec<PolicyDocument>,
    changing: Option<Read>,
    refused: Option<(Read, ReloadError)>,
}

impl std::fmt::Debug for PolicyFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyFiles")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl PolicyFiles {
    /// The policies at `path`, of which `current` (as read at start) decide now through
    /// `decider`; `leasing`: the agent has an allocator (else a `scope: global` rule is refused,
    /// as at start).
    pub fn new(
        path: PathBuf,
        current: Vec<PolicyDocument>,
        leasing: bool,
        decider: Arc<Decider>,
    ) -> Self {
        PolicyFiles {
            path,
            leasing,
            decider,
            state: Mutex::new(Seen {
                current,
                changing: None,
                refused: None,
            }),
        }
    }

    /// Reads the files and applies them if they changed and are valid: at once when an operator
    /// `asked` (SIGHUP), else (a poll) only when the previous poll read the same changed bytes,
    /// so a file or folder caught half-way through a non-atomic write is not applied. Never
    /// fails: a refusal is an outcome ([`Reload::Rejected`]) and leaves the deciding version as
    /// it was. Blocking (file reads, and the new version's transition of every key table):
    /// call it off the async workers.
    pub fn check(&self, asked: bool) -> Reload {
        let mut seen = self.state.lock();
        let read: Read = read_policy_documents(&self.path);
        let outcome = if read.as_ref().is_ok_and(|docs| *docs == seen.current) {
            match seen.refused.take() {
                Some(_) => Reload::Restored,
                None => Reload::Unchanged,
            }
        } else if let Some((_, error)) = seen.refused.as_ref().filter(|(r, _)| *r == read) {
            // The same bytes (or the same read error) as the last refusal: refused again,
            // without validating, logging or counting them again.
            Reload::Rejected {
                error: error.clone(),
                repeated: true,
            }
        } else if !asked && seen.changing.as_ref() != Some(&read) {
            seen.changing = Some(read);
            return self.counted(Reload::Changing);
        } else {
            let applied = read.clone().map_err(ReloadError::from).and_then(|docs| {
                let version = self.apply(&docs)?;
                Ok((docs, version))
            });
            match applied {
                Ok((docs, version)) => {
                    seen.current = docs;
                    seen.refused = None;
                    Reload::Applied { version }
                }
                Err(error) => {
                    seen.refused = Some((read, error.clone()));
                    Reload::Rejected {
                        error,
                        repeated: false,
                    }
                }
            }
        };
        seen.changing = None;
        self.counted(outcome)
    }

    /// Validates `docs` whole (as at start) into a config set.
    fn validate(&self, docs: &[PolicyDocument]) -> Result<ConfigSet, ReloadError> {
        let set = ConfigSet::from_documents(docs)?;
        if !self.leasing {
            if let Some(rule) = first_leased(&set) {
                return Err(ReloadError::LeasedWithoutAllocator { rule });
            }
        }
        Ok(set)
    }

    /// Validates `docs` whole and makes them the deciding version; returns its number.
    fn apply(&self, docs: &[PolicyDocument]) -> Result<u64, ReloadError> {
        Ok(self.decider.apply(self.validate(docs)?))
    }

    /// Counts `outcome` in the metrics and returns it.
    fn counted(&self, outcome: Reload) -> Reload {
        self.count(&outcome);
        outcome
    }

    fn count(&self, outcome: &Reload) {
        let c = &self.decider.metrics().reloads;
        c.checks.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Reload::Changing => {}
            Reload::Unchanged | Reload::Restored => c.last_ok.store(1, Ordering::Relaxed),
            Reload::Applied { .. } => {
                c.applied.fetch_add(1, Ordering::Relaxed);
                c.last_ok.store(1, Ordering::Relaxed);
            }
            Reload::Rejected { repeated, .. } => {
                if !repeated {
                    c.rejected.fetch_add(1, Ordering::Relaxed);
                }
                c.last_ok.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Checks the files on every signal of `hangup` ([`hangup_signal`]) and, with `poll`, every
    /// `poll`, logging what changed, until `shutdown` turns true.
    pub async fn watch(
        self: Arc<Self>,
        mut hangup: Option<Signal>,
        poll: Option<Duration>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut tick = poll.map(|p| {
            let mut t = tokio::time::interval_at(tokio::time::Instant::now() + p, p);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        });
        loop {
            let asked = tokio::select! {
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { return } else { continue },
                Some(_) = async { hangup.as_mut()?.recv().await } => true,
                _ = async { tick.as_mut().expect("guarded").tick().await }, if tick.is_some() => false,
            };
            let me = self.clone();
            match tokio::task::spawn_blocking(move || me.check(asked)).await {
                Ok(outcome) => self.log(&outcome, asked),
                Err(e) => tracing::error!(error = %e, "policy reload check failed"),
            }
        }
    }

    /// Logs a check's outcome: an applied or newly refused set always, "unchanged" only when
    /// an operator asked (SIGHUP).
    fn log(&self, outcome: &Reload, asked: bool) {
        let path = self.path.display();
        match outcome {
            Reload::Applied { version } => {
                tracing::info!(policies = %path, version, "policies reloaded")
            }
            Reload::Rejected { error, repeated } if asked || !repeated => {
                tracing::error!(policies = %path, %error, "policy reload refused; the current policies stay")
            }
            Reload::Restored => {
                tracing::info!(policies = %path, "policy files are the running version again; the refusal is over")
            }
            Reload::Unchanged if asked => {
                tracing::info!(policies = %path, "policies unchanged")
            }
            Reload::Changing => {
                tracing::info!(policies = %path, "policy files changed; read again at the next poll before anything is applied")
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::TrackingSettings;
    use crate::lease::LeaseSettings;
    use crate::server::Agent;
    use allot_common::clock::ManualClock;
    use allot_common::descriptor::{Descriptor, Entry, Request};
    use allot_common::limiter::Code;

    fn policy(per_minute: u32) -> String {
        format!(
            "domain: api\ndescriptors:\n  - key: client\n    rate_limit: {{unit: minute, \
             requests_per_unit: {per_minute}, scope: local}}\n"
        )
    }

    struct Rig {
        dir: tempfile::TempDir,
        decider: Arc<Decider>,
        files: PolicyFiles,
    }

    impl Rig {
        fn new(per_minute: u32) -> Rig {
            let dir = tempfile::tempdir().expect("tempdir");
            std::fs::write(dir.path().join("api.yaml"), policy(per_minute)).expect("write");
            let docs = read_policy_documents(dir.path()).expect("read");
            let agent = Agent::build(
                ConfigSet::from_documents(&docs).expect("valid"),
                LeaseSettings::new("a", "r"),
                TrackingSettings::default(),
                &[],
                Arc::new(ManualClock::new(0)),
            )
            .expect("builds");
            let decider = agent.decider.clone();
            let files = PolicyFiles::new(dir.path().to_path_buf(), docs, false, decider.clone());
            Rig {
                dir,
                decider,
                files,
            }
        }

        fn write(&self, name: &str, text: &str) {
            std::fs::write(self.dir.path().join(name), text).expect("write");
        }

        fn check(&self, client: &str) -> Code {
            let e = [Entry {
                key: "client",
                value: client,
            }];
            let d = [Descriptor {
                entries: &e,
                hits_addend: None,
            }];
            let req = Request {
                domain: "api",
                descriptors: &d,
                hits_addend: None,
            };
            let mut st = Vec::new();
            let o = self
                .decider
                .enforcer()
                .decide_now(&req, &mut st)
                .expect("valid");
            o.code
        }

        fn counters(&self) -> (u64, u64, u64, u64) {
            let c = &self.decider.metrics().reloads;
            let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            (l(&c.applied), l(&c.rejected), l(&c.last_ok), l(&c.version))
        }
    }

    #[test]
    fn unchanged_files_apply_nothing_and_keep_the_version() {
        let r = Rig::new(2);
        assert_eq!(r.files.check(true), Reload::Unchanged);
        // Rewritten with the same bytes: still the same policies.
        r.write("api.yaml", &policy(2));
        assert_eq!(r.files.check(true), Reload::Unchanged);
        assert_eq!(r.counters(), (0, 0, 1, 1));
    }

    #[test]
    fn a_changed_valid_file_decides_from_the_next_request_and_keeps_the_keys_state() {
        let r = Rig::new(2);
        assert_eq!(r.check("a"), Code::Ok);
        assert_eq!(r.check("a"), Code::Ok);
        assert_eq!(r.check("a"), Code::OverLimit);
        r.write("api.yaml", &policy(5));
        assert_eq!(r.files.check(true), Reload::Applied { version: 2 });
        // Same rule (domain and key path): the bucket carries over and its capacity grows by
        // the increase, 3 tokens (design §10 "Config versions"), no refill on a stopped clock.
        for _ in 0..3 {
            assert_eq!(r.check("a"), Code::Ok);
        }
        assert_eq!(r.check("a"), Code::OverLimit);
        assert_eq!(r.counters(), (1, 0, 1, 2));
        assert_eq!(r.files.check(true), Reload::Unchanged);
    }

    #[test]
    fn an_invalid_file_is_refused_once_and_the_current_policies_keep_deciding() {
        let r = Rig::new(2);
        r.write("api.yaml", "domain: api\ndescriptors:\n  - key: client\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n");
        let Reload::Rejected { error, repeated } = r.files.check(true) else {
            panic!("refused")
        };
        assert!(!repeated);
        assert!(error.to_string().contains("fortnight"), "{error}");
        // Checked again (a poll): the same refusal, counted once.
        assert!(matches!(
            r.files.check(true),
            Reload::Rejected { repeated: true, .. }
        ));
        assert_eq!(r.counters(), (0, 1, 0, 1));
        assert_eq!(r.check("b"), Code::Ok);
        assert_eq!(r.check("b"), Code::Ok);
        assert_eq!(
            r.check("b"),
            Code::OverLimit,
            "version 1's limit of 2 still decides"
        );
        // Mended: applied, and the gauge is back to 1.
        r.write("api.yaml", &policy(3));
        assert_eq!(r.files.check(true), Reload::Applied { version: 2 });
        assert_eq!(r.counters(), (1, 1, 1, 2));
    }

    #[test]
    fn a_second_domain_defining_the_same_one_is_refused_whole() {
        let r = Rig::new(2);
        r.write("b.yaml", &policy(9));
        assert!(matches!(r.files.check(true), Reload::Rejected { .. }));
        assert_eq!(r.check("c"), Code::Ok);
        assert_eq!(r.check("c"), Code::Ok);
        assert_eq!(r.check("c"), Code::OverLimit);
    }

    #[test]
    fn a_leased_rule_is_refused_on_an_agent_without_an_allocator() {
        let r = Rig::new(2);
        r.write(
            "api.yaml",
            &policy(2).replace("scope: local", "scope: global"),
        );
        assert_eq!(
            r.files.check(true),
            Reload::Rejected {
                error: ReloadError::LeasedWithoutAllocator {
                    rule: "api|client".into()
                },
                repeated: false
            }
        );
        assert_eq!(r.counters(), (0, 1, 0, 1));
    }

    #[test]
    fn removed_files_are_refused_and_change_nothing() {
        let r = Rig::new(2);
        std::fs::remove_file(r.dir.path().join("api.yaml")).expect("rm");
        let Reload::Rejected { error, .. } = r.files.check(true) else {
            panic!("refused")
        };
        assert!(error.to_string().contains("no config files"), "{error}");
        assert_eq!(r.check("d"), Code::Ok);
        assert_eq!(r.counters().3, 1);
    }

    #[test]
    fn a_poll_applies_a_change_only_once_two_reads_agree() {
        let r = Rig::new(2);
        // A writer half-way: the first poll sees a valid prefix of the new file.
        r.write("api.yaml", "domain: api\ndescriptors: []\n");
        assert_eq!(r.files.check(false), Reload::Changing);
        // The write completes before the next poll: seen once more, then applied.
        r.write("api.yaml", &policy(3));
        assert_eq!(r.files.check(false), Reload::Changing);
        assert_eq!(r.counters().3, 1, "nothing applied yet");
        assert_eq!(r.files.check(false), Reload::Applied { version: 2 });
        assert_eq!(r.files.check(false), Reload::Unchanged);
        // A change reverted before the second poll is never applied.
        r.write("api.yaml", &policy(9));
        assert_eq!(r.files.check(false), Reload::Changing);
        r.write("api.yaml", &policy(3));
        assert_eq!(r.files.check(false), Reload::Unchanged);
        assert_eq!(r.files.check(false), Reload::Unchanged);
        assert_eq!(r.counters(), (1, 0, 1, 2));
        assert_eq!(
            r.decider.metrics().reloads.checks.load(Ordering::Relaxed),
            7
        );
    }

    #[test]
    fn polls_report_a_lasting_refusal_once_and_ride_out_a_passing_read_error() {
        let r = Rig::new(2);
        r.write("api.yaml", "domain: api\ndescriptors: [{key: client, rate_limit: {unit: fortnight, requests_per_unit: 1}}]\n");
        assert_eq!(r.files.check(false), Reload::Changing);
        assert!(matches!(
            r.files.check(false),
            Reload::Rejected {
                repeated: false,
                ..
            }
        ));
        for _ in 0..3 {
            assert!(matches!(
                r.files.check(false),
                Reload::Rejected { repeated: true, .. }
            ));
        }
        assert_eq!(r.counters(), (0, 1, 0, 1));
        // Put right: applied after two polls.
        r.write("api.yaml", &policy(4));
        assert_eq!(r.files.check(false), Reload::Changing);
        assert_eq!(r.files.check(false), Reload::Applied { version: 2 });
        // A folder caught between a removal and a re-creation: one poll sees it empty, the
        // next sees the file back; nothing is refused or applied.
        std::fs::remove_file(r.dir.path().join("api.yaml")).expect("rm");
        assert_eq!(r.files.check(false), Reload::Changing);
        r.write("api.yaml", &policy(4));
        assert_eq!(r.files.check(false), Reload::Unchanged);
        assert_eq!(r.counters(), (1, 1, 1, 2));
    }

    #[test]
    fn files_put_back_after_a_refusal_end_it_without_a_new_version() {
        let r = Rig::new(2);
        r.write("api.yaml", "domain: api\ndescriptors: [}\n");
        assert!(matches!(r.files.check(true), Reload::Rejected { .. }));
        r.write("api.yaml", &policy(2));
        assert_eq!(r.files.check(true), Reload::Restored);
        assert_eq!(r.files.check(true), Reload::Unchanged);
        assert_eq!(r.counters(), (0, 1, 1, 1));
    }
}
