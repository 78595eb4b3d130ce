//! The glue between the pure ledger and the Raft layer: [`Ledger`] as the replicated [`App`]
//! (applied at the leader-stamped time of each entry), its snapshot encoding (bincode 2 via
//! [`super::codec`]), and its group commit ([`Batching`]: many commands in one
//! [`Command::Batch`] entry).

use super::app::{App, AppError};
use super::codec::{decode, encode};
use super::group_commit::Batching;
use crate::ledger::{Command, Ledger, Response};

impl App for Ledger {
    type Command = Command;
    type Response = Response;

    fn apply(&mut self, cmd: &Command, stamped_now_ms: u64) -> Response {
        self.apply_at(cmd, stamped_now_ms)
    }

    fn snapshot(&self) -> Vec<u8> {
        // Serialising plain data into a Vec cannot fail; an empty snapshot would be refused by
        // `restore` rather than silently installed.
        encode(self).unwrap_or_default()
    }

    fn restore(bytes: &[u8]) -> Result<Self, AppError> {
        let mut l: Ledger = decode(bytes).map_err(|e| AppError::CorruptSnapshot(e.to_string()))?;
        l.rebuild_derived()
            .map_err(|e| AppError::CorruptSnapshot(e.to_string()))?;
        Ok(l)
    }
}

impl Batching for Ledger {
    fn batch(cmds: Vec<Command>) -> Command {
        Command::Batch(cmds)
    }

    fn unbatch(r: Response) -> Option<Vec<Response>> {
        match r {
            Response::Batch(all) => Some(all),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Acquire, PolicyKey};

    const POLICY: &str = "domain: api\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 10}\n";

    fn with_grant() -> Ledger {
        let mut l = Ledger::default();
        let put = Command::PutPolicy {
            yaml: POLICY.into(),
            expected_version: 0,
            request_id: String::new(),
        };
        assert!(matches!(
            l.apply(&put, 1_000),
            Response::PolicyPut { version: 1, .. }
        ));
        let acquire = Command::Acquire(Acquire {
            key: PolicyKey {
                domain: "api".into(),
                entries: vec![("tenant".into(), "acme".into())],
            },
            region: "eu".into(),
            holder: "gw".into(),
            want: 1_000_000,
            demand_per_s: 0,
            want_rate_per_s: 0,
            request_id: "r1".into(),
        });
        assert!(matches!(l.apply(&acquire, 1_000), Response::Granted(_)));
        l
    }

    #[test]
    fn a_snapshot_restores_the_same_ledger_with_its_policies_parsed() {
        let l = with_grant();
        let bytes = l.snapshot();
        let r = Ledger::restore(&bytes).expect("restore");
        assert_eq!(r.snapshot(), bytes);
        assert_eq!(r.allocation(1), l.allocation(1));
        // The parsed documents were rebuilt: the restored ledger decides as the original does.
        let mut a = l.clone();
        let mut b = r;
        let status = |x: &Ledger| {
            x.status(
                &PolicyKey {
                    domain: "api".into(),
                    entries: vec![("tenant".into(), "acme".into())],
                },
                1_000,
            )
        };
        assert_eq!(status(&a), status(&b));
        assert!(status(&b).is_ok());
        assert_eq!(
            a.apply(&Command::Tick, 2_000),
            b.apply(&Command::Tick, 2_000)
        );
    }

    #[test]
    fn truncated_or_garbage_snapshots_are_refused() {
        let bytes = with_grant().snapshot();
        for bad in [&bytes[..bytes.len() / 2], &[0xff, 0xff, 0xff][..], &[][..]] {
            assert!(matches!(
                Ledger::restore(bad),
                Err(AppError::CorruptSnapshot(_))
            ));
        }
    }

    #[test]
    fn a_batch_is_one_command_and_its_answers_unbatch_in_order() {
        let cmds = vec![Command::Tick, Command::Tick];
        assert_eq!(Ledger::batch(cmds.clone()), Command::Batch(cmds));
        let rs = vec![Response::Ticked, Response::Ticked];
        assert_eq!(Ledger::unbatch(Response::Batch(rs.clone())), Some(rs));
        assert_eq!(Ledger::unbatch(Response::Ticked), None);
    }
}
