//! The glue between the pure ledger and the Raft layer: [`Ledger`] as the replicated [`App`]
//! (applied at the leader-stamped time of each entry), its snapshot encoding (bincode 2 via
//! [`super::codec`]), and its group commit ([`Batching`]: many commands in one
//! [`Command::Batch`] entry).

use super::app::{App, AppError};
use super::codec::{decode, decode_prefix, encode};
use super::group_commit::Batching;
use crate::ledger::{Command, Ledger, Response};

impl App for Ledger {
    type Command = Command;
    type Response = Response;

    fn apply(&mut self, cmd: &Command, stamped_now_ms: u64) -> Response {
        self.apply_at(cmd, stamped_now_ms)
    }

    /// The ledger's bytes, then its incarnation's. bincode has no field versions: a field
    /// added to the ledger would make every older snapshot undecodable, while bytes appended
    /// after it leave an older snapshot a valid prefix (read as "no incarnation").
    fn snapshot(&self) -> Vec<u8> {
        // A snapshot's copy is completed first: the same bytes as the ledger it was taken from.
        let l = self.whole();
        // Serialising plain data into a Vec cannot fail; an empty snapshot would be refused by
        // `restore` rather than silently installed.
        match (encode(&*l), encode(&l.stored_incarnation())) {
            (Ok(mut bytes), Ok(tail)) => {
                bytes.extend_from_slice(&tail);
                bytes
            }
            _ => Vec::new(),
        }
    }

    /// Independent of the number of keys: the large tables are copy-on-write (see [`Ledger`]).
    fn snapshot_copy(&self) -> Self {
        Ledger::snapshot_copy(self)
    }

    /// Rebuilds what [`Ledger::snapshot_copy`] left out ([`Ledger::completed`]), then encodes.
    fn into_snapshot(self) -> Vec<u8> {
        self.completed().snapshot()
    }

    fn restore(bytes: &[u8]) -> Result<Self, AppError> {
        let corrupt = |e: bincode::error::DecodeError| AppError::CorruptSnapshot(e.to_string());
        let (mut l, read): (Ledger, usize) = decode_prefix(bytes).map_err(corrupt)?;
        let tail = &bytes[read..];
        let incarnation = if tail.is_empty() {
            None
        } else {
            Some(decode::<u64>(tail).map_err(corrupt)?)
        };
        l.restore_incarnation(incarnation);
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
    fn a_snapshot_carries_the_incarnation_and_an_older_one_still_restores() {
        let l = with_grant();
        assert_eq!(l.incarnation(), 1_000, "the first entry's stamp");
        assert_eq!(
            Ledger::restore(&l.snapshot())
                .expect("restore")
                .incarnation(),
            1_000
        );
        // A snapshot written before incarnations: the ledger's bytes alone. It restores, and
        // never takes an incarnation (a replica replaying the log instead would take another):
        // it fences nothing by incarnation, as before.
        let mut legacy = Ledger::restore(&encode(&l).expect("encode")).expect("legacy restore");
        assert_eq!(legacy.incarnation(), 0);
        legacy.apply(&Command::Tick, 2_000);
        assert_eq!(legacy.incarnation(), 0);
        let other = Command::InIncarnation {
            incarnation: 7,
            command: Box::new(Command::Report {
                allocation_id: 1,
                epoch: 1,
                holder: "gw".into(),
                cumulative_spend: 1,
            }),
        };
        assert!(matches!(
            legacy.apply(&other, 2_000),
            Response::Reported { .. }
        ));
        // One that had applied nothing takes one at its first command, as any.
        let mut empty =
            Ledger::restore(&encode(&Ledger::default()).expect("encode")).expect("restore");
        empty.apply(&Command::Tick, 3_000);
        assert_eq!(empty.incarnation(), 3_000);
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

    /// A length prefix claiming 2^40 entries, in place of each of the ledger's leading fields
    /// in turn (an empty ledger writes each as one zero byte): refused as corrupt, never an
    /// attempt to reserve that many entries (imbl's own decoding would reserve them and abort
    /// the process; `ledger::persistent`).
    #[test]
    fn a_forged_table_length_is_refused_not_allocated() {
        let empty = Ledger::default().snapshot();
        assert!(empty.len() > 14 && empty[..14].iter().all(|b| *b == 0));
        for at in 0..14 {
            let mut forged = vec![0u8; at];
            // bincode's varint: 0xFD, then a little-endian u64.
            forged.push(0xFD);
            forged.extend_from_slice(&(1u64 << 40).to_le_bytes());
            assert!(
                matches!(Ledger::restore(&forged), Err(AppError::CorruptSnapshot(_))),
                "a forged length at byte {at}"
            );
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
