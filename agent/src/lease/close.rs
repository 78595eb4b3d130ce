//! Closing allocations before their final spend is read (issue 10 item 3): a closed allocation
//! refuses every spend in the same compare-and-swap that would have spent, so the spend a Release
//! carries is final — no request decided while the Release is on its way can add to it.

use super::book::LeaseBook;

/// Closes every allocation the book holds (graceful shutdown, before the Releases); returns how
/// many were open. Decisions after this find nothing to spend and follow the key's answer for an
/// exhausted allocation.
pub fn close_all(book: &LeaseBook) -> usize {
    let mut closed = 0;
    for table in book.all_tables() {
        table.for_each(|k| {
            for a in k.value.allocations().iter() {
                if !a.is_closed() {
                    a.close();
                    closed += 1;
                }
            }
        });
    }
    closed
}
