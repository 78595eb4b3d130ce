//! The book as the decision core sees it: [`GlobalLimits`] over one snapshot's tables.

use super::decision_path::Mode;
use super::{LeaseBook, LeaseReservation, LeaseTables};
use crate::lease::charge::ChargeLog;
use allot_common::global::{GlobalDecision, GlobalKey, GlobalLimits};
use allot_common::units::{Micros, Nanos};

/// The book as seen with one [`LeaseTables`]: the [`GlobalLimits`] a decision made with the
/// snapshot those tables were built from uses, so the snapshot and the tables come from one
/// load (see `Enforcer`).
#[derive(Debug, Clone, Copy)]
pub struct LeaseView<'a> {
    book: &'a LeaseBook,
    tables: &'a LeaseTables,
    charges: Option<&'a ChargeLog>,
}

impl<'a> LeaseView<'a> {
    /// `book` deciding with `tables`.
    pub fn new(book: &'a LeaseBook, tables: &'a LeaseTables) -> Self {
        LeaseView {
            book,
            tables,
            charges: None,
        }
    }

    /// As [`new`](Self::new), recording in `charges` what each admitted leased descriptor
    /// charged, for a decision that may be refunded later (issue 10 item 5).
    pub fn recording(book: &'a LeaseBook, tables: &'a LeaseTables, charges: &'a ChargeLog) -> Self {
        LeaseView {
            book,
            tables,
            charges: Some(charges),
        }
    }

    /// Decides in `mode`, recording the charge when asked to (a commit is then decided as a
    /// reservation, so what it charged is known).
    fn decide_recorded(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
        mode: Mode,
    ) -> GlobalDecision<LeaseReservation> {
        let Some(log) = self.charges else {
            return self.book.decide(self.tables, key, cost, now, mode);
        };
        let d = self.book.decide(self.tables, key, cost, now, Mode::Reserve);
        if let Some(r) = &d.reservation {
            if let Some(kl) = self
                .tables
                .existing(key.domain, key.rule_index, key.entries)
            {
                log.record(key.entries, kl, r);
            }
        }
        d
    }
}

impl GlobalLimits for LeaseView<'_> {
    type Reservation = LeaseReservation;

    #[inline]
    fn reserve(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<LeaseReservation> {
        self.decide_recorded(key, cost, now, Mode::Reserve)
    }

    #[inline]
    fn commit(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<LeaseReservation> {
        self.decide_recorded(key, cost, now, Mode::Commit)
    }

    fn peek(
        &self,
        key: GlobalKey<'_>,
        cost: Micros,
        now: Nanos,
    ) -> GlobalDecision<LeaseReservation> {
        self.book.decide(self.tables, key, cost, now, Mode::Peek)
    }

    fn cancel(&self, r: LeaseReservation) {
        if let Some(log) = self.charges {
            log.forget(&r);
        }
        self.book.cancel(r)
    }

    /// A refund that does not say which allocation was charged goes nowhere: only the charged
    /// allocation may take tokens back, and only while it is live (issue 10 item 5). Refunds of
    /// leased descriptors go through what their decision recorded
    /// ([`Charged::refund`](crate::lease::charge::Charged::refund)).
    fn refund(&self, _key: GlobalKey<'_>, _micros: Micros, _now: Nanos) {}
}
