//! Descriptors as the wire formats carry them, borrowed as the decision core's (no copies, and
//! no allocation for requests of up to [`INLINE_ENTRIES`] entries in up to
//! [`INLINE_DESCRIPTORS`] descriptors).

use super::ApiError;
use allot_common::descriptor::{
    Descriptor, Entry, Request, RequestError, MAX_COST_TOKENS, MAX_DESCRIPTORS, MAX_ENTRIES,
};
use smallvec::SmallVec;

/// Entries of a request held inline (without allocating) by [`BorrowedEntries`].
pub const INLINE_ENTRIES: usize = 8;
/// Descriptors of a request held inline (without allocating) by [`BorrowedDescriptors`].
pub const INLINE_DESCRIPTORS: usize = 4;

/// A request's entries borrowed as the core's, all descriptors' in order.
pub type BorrowedEntries<'a> = SmallVec<[Entry<'a>; INLINE_ENTRIES]>;
/// A request's descriptors borrowed as the core's.
pub type BorrowedDescriptors<'a> = SmallVec<[Descriptor<'a>; INLINE_DESCRIPTORS]>;

/// A descriptor as a wire format carries it; implemented by each adapter's message type.
pub trait WireDescriptor {
    /// The entry type.
    type Entry: WireEntry;
    /// Entries, outermost first.
    fn entries(&self) -> &[Self::Entry];
    /// Its own cost, tokens, when given.
    fn hits_addend(&self) -> Option<u64>;
}

/// A descriptor entry as a wire format carries it.
pub trait WireEntry {
    /// Key.
    fn key(&self) -> &str;
    /// Value.
    fn value(&self) -> &str;
}

/// Borrows the entries of `descs` as the decision core's [`Entry`]s (no string is copied).
/// Counts are checked here, before anything is collected, so an oversized request costs no
/// more than its own decoding.
///
/// # Errors
/// [`RequestError::TooManyDescriptors`] or [`RequestError::TooManyEntries`].
pub fn borrow_entries<D: WireDescriptor>(descs: &[D]) -> Result<BorrowedEntries<'_>, RequestError> {
    if descs.len() > MAX_DESCRIPTORS {
        return Err(RequestError::TooManyDescriptors {
            got: descs.len(),
            max: MAX_DESCRIPTORS,
        });
    }
    let mut total = 0;
    for (i, d) in descs.iter().enumerate() {
        if d.entries().len() > MAX_ENTRIES {
            return Err(RequestError::TooManyEntries {
                descriptor: i,
                got: d.entries().len(),
                max: MAX_ENTRIES,
            });
        }
        total += d.entries().len();
    }
    let mut out = BorrowedEntries::with_capacity(total);
    for d in descs {
        out.extend(d.entries().iter().map(|e| Entry {
            key: e.key(),
            value: e.value(),
        }));
    }
    Ok(out)
}

/// The decision core's descriptors over `entries` (from [`borrow_entries`] of the same `descs`).
pub fn borrow_descriptors<'a, D: WireDescriptor>(
    descs: &[D],
    entries: &'a [Entry<'a>],
) -> BorrowedDescriptors<'a> {
    let mut out = BorrowedDescriptors::with_capacity(descs.len());
    let mut at = 0;
    for d in descs {
        let n = d.entries().len();
        out.push(Descriptor {
            entries: &entries[at..at + n],
            hits_addend: d.hits_addend(),
        });
        at += n;
    }
    out
}

/// A request-level cost from a wire field where 0 means 1.
///
/// # Errors
/// [`ApiError::Malformed`] when it exceeds `u32` (Envoy's `hits_addend` range).
pub fn request_cost(field: &str, cost: u64) -> Result<Option<u64>, ApiError> {
    if cost > MAX_COST_TOKENS {
        return Err(ApiError::Malformed(format!(
            "{field} is {cost}; at most {MAX_COST_TOKENS} is accepted"
        )));
    }
    Ok((cost > 0).then_some(cost))
}

/// A check or reserve message read once for the decision core: its domain, its cost and its
/// descriptors' entries, borrowed (no string is copied). The core's [`Request`] borrows it in
/// turn: `let d = w.descriptors(); let req = w.request(&d);`.
#[derive(Debug)]
pub struct WireRequest<'a, D> {
    domain: &'a str,
    descs: &'a [D],
    hits: Option<u64>,
    entries: BorrowedEntries<'a>,
}

impl<'a, D: WireDescriptor> WireRequest<'a, D> {
    /// Reads `descs` of `domain` with the request-level `cost` (0 means 1), named `cost_field` in
    /// errors.
    ///
    /// # Errors
    /// As [`request_cost`], then as [`borrow_entries`].
    pub fn read(
        domain: &'a str,
        descs: &'a [D],
        cost_field: &str,
        cost: u64,
    ) -> Result<Self, ApiError> {
        let hits = request_cost(cost_field, cost)?;
        Ok(WireRequest {
            domain,
            descs,
            hits,
            entries: borrow_entries(descs)?,
        })
    }

    /// The core's descriptors over the entries read.
    pub fn descriptors(&self) -> BorrowedDescriptors<'_> {
        borrow_descriptors(self.descs, &self.entries)
    }

    /// The core's request over `descriptors` (from [`descriptors`](Self::descriptors)).
    pub fn request<'r>(&'r self, descriptors: &'r [Descriptor<'r>]) -> Request<'r> {
        Request {
            domain: self.domain,
            descriptors,
            hits_addend: self.hits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A descriptor of `(key, value)` entries with an optional own cost.
    #[derive(Debug)]
    struct Desc(Vec<(String, String)>, Option<u64>);

    impl WireEntry for (String, String) {
        fn key(&self) -> &str {
            &self.0
        }
        fn value(&self) -> &str {
            &self.1
        }
    }

    impl WireDescriptor for Desc {
        type Entry = (String, String);
        fn entries(&self) -> &[(String, String)] {
            &self.0
        }
        fn hits_addend(&self) -> Option<u64> {
            self.1
        }
    }

    fn desc(entries: &[(&str, &str)], hits: Option<u64>) -> Desc {
        let e = entries
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Desc(e, hits)
    }

    #[test]
    fn a_wire_request_borrows_each_descriptor_s_entries_in_order() {
        let descs = [
            desc(&[("tenant", "a"), ("path", "/x")], None),
            desc(&[("ip", "1.2.3.4")], Some(3)),
        ];
        let w = WireRequest::read("api", &descs, "cost", 0).expect("valid");
        let d = w.descriptors();
        let req = w.request(&d);
        assert_eq!((req.domain, req.hits_addend), ("api", None));
        assert_eq!(req.descriptors.len(), 2);
        let first: Vec<_> = req.descriptors[0].entries.iter().map(|e| e.value).collect();
        assert_eq!(first, ["a", "/x"]);
        assert_eq!(req.descriptors[1].entries[0].key, "ip");
        assert_eq!(req.descriptors[1].hits_addend, Some(3));
        let w = WireRequest::read("api", &descs, "cost", 7).expect("valid");
        assert_eq!(w.request(&w.descriptors()).hits_addend, Some(7));
    }

    #[test]
    fn the_cost_is_checked_before_the_entries_and_named_in_the_error() {
        // Too many descriptors *and* a cost above the bound: the cost is reported, by its field.
        let many: Vec<Desc> = (0..=MAX_DESCRIPTORS)
            .map(|_| desc(&[("k", "v")], None))
            .collect();
        let e = WireRequest::read("api", &many, "max_cost", MAX_COST_TOKENS + 1).unwrap_err();
        assert!(
            matches!(&e, ApiError::Malformed(m) if m.starts_with("max_cost")),
            "{e}"
        );
        let e = WireRequest::read("api", &many, "max_cost", MAX_COST_TOKENS).unwrap_err();
        assert!(
            matches!(e, ApiError::Invalid(RequestError::TooManyDescriptors { got, max })
                if got == MAX_DESCRIPTORS + 1 && max == MAX_DESCRIPTORS),
            "{e}"
        );
    }
}
