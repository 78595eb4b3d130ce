//! Request descriptors (Envoy's `RateLimitDescriptor`) and their canonical keys (design §10
//! "Keys").
//!
//! A key is the descriptor's entries encoded with length prefixes, so the encoding is injective:
//! `("a", "b_c")` and `("a_b", "c")`, or "é" and "e" + U+0301, never share a counter. Keys and
//! values compare byte for byte, with no normalisation. Sizes are bounded so that state and
//! memory stay bounded whatever the caller sends.

use std::hash::Hasher;

/// Most entries one descriptor may have.
pub const MAX_ENTRIES: usize = 16;
/// Most descriptors one request may have.
pub const MAX_DESCRIPTORS: usize = 32;
/// Longest key, value or domain, in bytes.
pub const MAX_PART_BYTES: usize = 1024;
/// Longest canonical key of one descriptor, in bytes (bounds memory per key: with the default
/// `max_keys` a rule's keys take at most about 400 MB even when every key is this long).
pub const MAX_KEY_BYTES: usize = 4096;
/// Largest cost (hits) one descriptor may ask for, in whole tokens: Envoy's `uint32 hits_addend`.
pub const MAX_COST_TOKENS: u64 = u32::MAX as u64;

/// One `key=value` entry of a descriptor, borrowed from the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The entry's key; non-empty.
    pub key: &'a str,
    /// The entry's value; non-empty.
    pub value: &'a str,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor<'a> {
    /// Entries, outermost first; 1 to [`MAX_ENTRIES`].
    pub entries: &'a [Entry<'a>],
    /// This descriptor's own cost in whole tokens, when given (0 checks without spending).
    pub hits_addend: Option<u64>,
}

/// A rate-limit request (Envoy's `RateLimitRequest`), borrowed: building one allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    /// The config domain.
    pub domain: &'a str,
    /// 1 to [`MAX_DESCRIPTORS`] descriptors, all decided together (all-or-nothing).
    pub descriptors: &'a [Descriptor<'a>],
    /// Cost of every descriptor without its own; `None` or `Some(0)` mean 1.
    pub hits_addend: Option<u64>,
}

/// Why a request was refused as invalid. An invalid request is decided on nothing and spends
/// nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// `domain` is empty.
    #[error("domain is empty")]
    EmptyDomain,
    /// No config defines this domain.
    #[error("unknown domain {0:?}")]
    UnknownDomain(String),
    /// The request has no descriptor.
    #[error("request has no descriptors")]
    NoDescriptors,
    /// Too many descriptors.
    #[error("request has {got} descriptors; at most {max} are accepted")]
    TooManyDescriptors {
        /// Count given.
        got: usize,
        /// Limit.
        max: usize,
    },
    /// A descriptor has no entry.
    #[error("descriptors[{descriptor}] has no entries")]
    NoEntries {
        /// Descriptor index.
        descriptor: usize,
    },
    /// A descriptor has too many entries.
    #[error("descriptors[{descriptor}] has {got} entries; at most {max} are accepted")]
    TooManyEntries {
        /// Descriptor index.
        descriptor: usize,
        /// Count given.
        got: usize,
        /// Limit.
        max: usize,
    },
    /// An entry's key or value is empty.
    #[error("descriptors[{descriptor}].entries[{entry}].{field} is empty")]
    EmptyPart {
        /// Descriptor index.
        descriptor: usize,
        /// Entry index.
        entry: usize,
        /// `key` or `value`.
        field: &'static str,
    },
    /// A key, value or domain is too long.
    #[error("{what} is {got} bytes; at most {max} are accepted")]
    TooLong {
        /// Which part.
        what: String,
        /// Length given.
        got: usize,
        /// Limit.
        max: usize,
    },
    /// A cost beyond `u32`.
    #[error("descriptors[{descriptor}].hits_addend is {got}; at most {max} is accepted")]
    CostTooLarge {
        /// Descriptor index.
        descriptor: usize,
        /// Cost given.
        got: u64,
        /// Limit.
        max: u64,
    },
}

impl<'a> Request<'a> {
    /// Checks sizes, emptiness and costs (not the domain's existence).
    ///
    /// # Errors
    /// The first [`RequestError`] found.
    #[inline]
    pub fn validate(&self) -> Result<(), RequestError> {
        if self.is_well_formed() {
            Ok(())
        } else {
            Err(self.first_error())
        }
    }

    /// Whether [`validate`](Self::validate) passes: the same bounds in one pass without
    /// building an error (the decision path); [`first_error`](Self::first_error) says which.
    #[inline]
    fn is_well_formed(&self) -> bool {
        // `len - 1 < max` checks 1 ≤ len ≤ max in one comparison.
        let within = |len: usize, max: usize| len.wrapping_sub(1) < max;
        let cost_ok = |h: Option<u64>| h.is_none_or(|h| h <= MAX_COST_TOKENS);
        within(self.domain.len(), MAX_PART_BYTES)
            && within(self.descriptors.len(), MAX_DESCRIPTORS)
            && cost_ok(self.hits_addend)
            && self.descriptors.iter().all(|d| {
                within(d.entries.len(), MAX_ENTRIES)
                    && cost_ok(d.hits_addend)
                    && d.entries.iter().all(|e| {
                        within(e.key.len(), MAX_PART_BYTES) && within(e.value.len(), MAX_PART_BYTES)
                    })
                    && encoded_len(d.entries) <= MAX_KEY_BYTES
            })
    }

    /// The first error [`validate`](Self::validate) reports, in the order it checks.
    #[cold]
    #[inline(never)]
    fn first_error(&self) -> RequestError {
        match self.find_error() {
            Err(e) => e,
            // Only called when `is_well_formed` failed, so some check fails here too.
            Ok(()) => RequestError::NoDescriptors,
        }
    }

    fn find_error(&self) -> Result<(), RequestError> {
        if self.domain.is_empty() {
            return Err(RequestError::EmptyDomain);
        }
        if self.domain.len() > MAX_PART_BYTES {
            return Err(RequestError::TooLong {
                what: "domain".into(),
                got: self.domain.len(),
                max: MAX_PART_BYTES,
            });
        }
        if self.descriptors.is_empty() {
            return Err(RequestError::NoDescriptors);
        }
        if self.descriptors.len() > MAX_DESCRIPTORS {
            return Err(RequestError::TooManyDescriptors {
                got: self.descriptors.len(),
                max: MAX_DESCRIPTORS,
            });
        }
        if let Some(h) = self.hits_addend {
            if h > MAX_COST_TOKENS {
                return Err(RequestError::CostTooLarge {
                    descriptor: 0,
                    got: h,
                    max: MAX_COST_TOKENS,
                });
            }
        }
        for (i, d) in self.descriptors.iter().enumerate() {
            if d.entries.is_empty() {
                return Err(RequestError::NoEntries { descriptor: i });
            }
            if d.entries.len() > MAX_ENTRIES {
                return Err(RequestError::TooManyEntries {
                    descriptor: i,
                    got: d.entries.len(),
                    max: MAX_ENTRIES,
                });
            }
            if encoded_len(d.entries) > MAX_KEY_BYTES {
                return Err(RequestError::TooLong {
                    what: format!("descriptors[{i}] (all keys and values)"),
                    got: encoded_len(d.entries),
                    max: MAX_KEY_BYTES,
                });
            }
            if let Some(h) = d.hits_addend {
                if h > MAX_COST_TOKENS {
                    return Err(RequestError::CostTooLarge {
                        descriptor: i,
                        got: h,
                        max: MAX_COST_TOKENS,
                    });
                }
            }
            for (j, e) in d.entries.iter().enumerate() {
                for (field, part) in [("key", e.key), ("value", e.value)] {
                    if part.is_empty() {
                        return Err(RequestError::EmptyPart {
                            descriptor: i,
                            entry: j,
                            field,
                        });
                    }
                    if part.len() > MAX_PART_BYTES {
                        return Err(RequestError::TooLong {
                            what: format!("descriptors[{i}].entries[{j}].{field}"),
                            got: part.len(),
                            max: MAX_PART_BYTES,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Cost of descriptor `i` in whole tokens: its own `hits_addend` when present (0 means a
    /// check that spends nothing), else the request's, where absent or 0 means 1.
    pub fn cost_tokens(&self, i: usize) -> u64 {
        match self.descriptors[i].hits_addend {
            Some(h) => h,
            None => match self.hits_addend {
                None | Some(0) => 1,
                Some(h) => h,
            },
        }
    }
}

/// An owned descriptor: entries (key, value) and its own `hits_addend`.
pub type OwnedDescriptor = (Vec<(String, String)>, Option<u64>);

/// A request that owns its strings (parsed from JSON, or kept to refund later);
/// [`OwnedRequest::with_request`] lends it out as a borrowed [`Request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedRequest {
    /// Domain.
    pub domain: String,
    /// Per descriptor: entries (key, value) and its own `hits_addend`.
    pub descriptors: Vec<OwnedDescriptor>,
    /// Request-level cost.
    pub hits_addend: Option<u64>,
}

impl OwnedRequest {
    /// Copies `req`.
    pub fn from_request(req: &Request<'_>) -> Self {
        OwnedRequest {
            domain: req.domain.to_string(),
            descriptors: req
                .descriptors
                .iter()
                .map(|d| {
                    (
                        d.entries
                            .iter()
                            .map(|e| (e.key.to_string(), e.value.to_string()))
                            .collect(),
                        d.hits_addend,
                    )
                })
                .collect(),
            hits_addend: req.hits_addend,
        }
    }

    /// Calls `f` with the borrowed form of this request (allocates the entry arrays).
    pub fn with_request<R>(&self, f: impl FnOnce(&Request<'_>) -> R) -> R {
        let entries: Vec<Vec<Entry<'_>>> = self
            .descriptors
            .iter()
            .map(|(es, _)| es.iter().map(|(k, v)| Entry { key: k, value: v }).collect())
            .collect();
        let descriptors: Vec<Descriptor<'_>> = entries
            .iter()
            .zip(&self.descriptors)
            .map(|(es, (_, h))| Descriptor {
                entries: es,
                hits_addend: *h,
            })
            .collect();
        f(&Request {
            domain: &self.domain,
            descriptors: &descriptors,
            hits_addend: self.hits_addend,
        })
    }
}

/// Bytes of the canonical key for `entries`.
pub fn encoded_len(entries: &[Entry<'_>]) -> usize {
    entries
        .iter()
        .map(|e| 8 + e.key.len() + e.value.len())
        .sum()
}

/// The canonical key: for each entry, `len(key)` (u32 BE), key, `len(value)` (u32 BE), value.
pub fn encode_key(entries: &[Entry<'_>]) -> Box<[u8]> {
    let mut out = Vec::with_capacity(encoded_len(entries));
    for e in entries {
        for part in [e.key, e.value] {
            out.extend_from_slice(&(part.len() as u32).to_be_bytes());
            out.extend_from_slice(part.as_bytes());
        }
    }
    out.into_boxed_slice()
}

/// Whether `key` is the canonical key of `entries`, without building it.
#[inline]
pub fn key_matches(entries: &[Entry<'_>], key: &[u8]) -> bool {
    if key.len() != encoded_len(entries) {
        return false;
    }
    // The lengths agree, so every part below lies inside `key`; `get` keeps that unchecked
    // assumption from ever panicking.
    let mut at = 0usize;
    for e in entries {
        for part in [e.key.as_bytes(), e.value.as_bytes()] {
            let n = part.len();
            let Some(len) = key.get(at..at + 4) else {
                return false;
            };
            if len != (n as u32).to_be_bytes() {
                return false;
            }
            match key.get(at + 4..at + 4 + n) {
                Some(bytes) if crate::name::bytes_eq(bytes, part) => at += 4 + n,
                _ => return false,
            }
        }
    }
    true
}

/// Feeds the values of `entries` to `h` (no allocation). A key table only has to spread its
/// keys, equality is [`key_matches`] on the whole canonical key, and the entries' *keys* are
/// the same for every key of one rule (matching walks the rule's node path key by key), so
/// hashing them would add nothing but work. Values go in without length prefixes: with foldhash
/// (every key table's hasher, the only caller's; a hasher that does not mix lengths in would
/// hash those two alike) each `write` rotates the state by its length, so `("ab", "c")`
/// and `("a", "bc")` still hash apart. Both cuts save ~60 instructions a decision against
/// hashing every key and length (issue 13 item 4).
#[inline]
pub(crate) fn hash_entries(entries: &[Entry<'_>], h: &mut impl Hasher) {
    for e in entries {
        h.write(e.value.as_bytes());
    }
}

/// Decodes a canonical key into (key, value) pairs; `None` when the bytes are not one.
pub fn decode_key(mut key: &[u8]) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let take = |rest: &mut &[u8]| -> Option<String> {
        if rest.len() < 4 {
            return None;
        }
        let (len, tail) = rest.split_at(4);
        let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
        if tail.len() < len {
            return None;
        }
        let (bytes, tail) = tail.split_at(len);
        *rest = tail;
        String::from_utf8(bytes.to_vec()).ok()
    };
    while !key.is_empty() {
        let k = take(&mut key)?;
        let v = take(&mut key)?;
        out.push((k, v));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e<'a>(k: &'a str, v: &'a str) -> Entry<'a> {
        Entry { key: k, value: v }
    }

    #[test]
    fn keys_that_join_alike_stay_distinct() {
        let a = encode_key(&[e("a", "b_c")]);
        let b = encode_key(&[e("a_b", "c")]);
        assert_ne!(a, b);
        let composed = encode_key(&[e("a", "\u{e9}")]);
        let decomposed = encode_key(&[e("a", "e\u{301}")]);
        assert_ne!(composed, decomposed);
        let two = encode_key(&[e("a", "b"), e("c", "d")]);
        let one = encode_key(&[e("a", "b\0\0\0\u{1}c")]);
        assert_ne!(two, one);
        assert!(key_matches(&[e("a", "b_c")], &a));
        assert!(!key_matches(&[e("a_b", "c")], &a));
        assert_eq!(
            decode_key(&two).unwrap(),
            vec![("a".into(), "b".into()), ("c".into(), "d".into())]
        );
        assert_eq!(decode_key(&[0, 0, 0, 9, 1]), None);
    }

    /// Lengths around every bound: 0, 1, the bound and one past it.
    fn edge_len(max: usize) -> impl proptest::strategy::Strategy<Value = usize> {
        proptest::sample::select(vec![0, 1, 2, max - 1, max, max + 1])
    }

    fn edge_cost() -> impl proptest::strategy::Strategy<Value = Option<u64>> {
        proptest::sample::select(vec![
            None,
            Some(0),
            Some(MAX_COST_TOKENS),
            Some(MAX_COST_TOKENS + 1),
        ])
    }

    proptest::proptest! {
        /// The one-pass check the decision path uses accepts exactly what the detailed check
        /// (which names the error) accepts.
        #[test]
        fn fast_validation_agrees_with_the_detailed_one(
            domain in edge_len(MAX_PART_BYTES),
            cost in edge_cost(),
            descs in proptest::collection::vec(
                (proptest::collection::vec((edge_len(MAX_PART_BYTES), edge_len(MAX_PART_BYTES)), 0..=MAX_ENTRIES + 1), edge_cost()),
                0..=3,
            ),
            many in proptest::bool::weighted(0.1),
        ) {
            let text = "k".repeat(MAX_PART_BYTES + 1);
            let owned: Vec<(Vec<Entry<'_>>, Option<u64>)> = descs
                .iter()
                .map(|(es, h)| {
                    (es.iter().map(|&(k, v)| Entry { key: &text[..k], value: &text[..v] }).collect(), *h)
                })
                .collect();
            let mut ds: Vec<Descriptor<'_>> = owned
                .iter()
                .map(|(es, h)| Descriptor { entries: es, hits_addend: *h })
                .collect();
            if many {
                let one = ds.first().copied().unwrap_or(Descriptor { entries: &[], hits_addend: None });
                ds.resize(MAX_DESCRIPTORS + 1, one);
            }
            let r = Request { domain: &text[..domain], descriptors: &ds, hits_addend: cost };
            proptest::prop_assert_eq!(r.is_well_formed(), r.find_error().is_ok());
            proptest::prop_assert_eq!(r.validate(), r.find_error());
        }

        /// `key_matches` is equality of canonical keys, for keys that differ anywhere.
        #[test]
        fn key_matches_is_equality_of_encoded_keys(
            a in proptest::collection::vec(("[ab]{1,9}", "[ab_]{0,20}"), 1..4),
            b in proptest::collection::vec(("[ab]{1,9}", "[ab_]{0,20}"), 1..4),
        ) {
            let ea: Vec<Entry<'_>> = a.iter().map(|(k, v)| Entry { key: k, value: v }).collect();
            let eb: Vec<Entry<'_>> = b.iter().map(|(k, v)| Entry { key: k, value: v }).collect();
            let (ka, kb) = (encode_key(&ea), encode_key(&eb));
            proptest::prop_assert!(key_matches(&ea, &ka));
            proptest::prop_assert_eq!(key_matches(&ea, &kb), ka == kb);
            proptest::prop_assert!(!key_matches(&ea, &ka[..ka.len() - 1]));
        }
    }

    #[test]
    fn request_validation_names_the_problem() {
        let ents = [e("k", "")];
        let d = [Descriptor {
            entries: &ents,
            hits_addend: None,
        }];
        let r = Request {
            domain: "x",
            descriptors: &d,
            hits_addend: None,
        };
        assert_eq!(
            r.validate(),
            Err(RequestError::EmptyPart {
                descriptor: 0,
                entry: 0,
                field: "value"
            })
        );
        let ents = [e("k", "v")];
        let d = [Descriptor {
            entries: &ents,
            hits_addend: Some(u64::MAX),
        }];
        let r = Request {
            domain: "x",
            descriptors: &d,
            hits_addend: None,
        };
        assert!(matches!(
            r.validate(),
            Err(RequestError::CostTooLarge { .. })
        ));
        let r = Request {
            domain: "",
            descriptors: &d,
            hits_addend: None,
        };
        assert_eq!(r.validate(), Err(RequestError::EmptyDomain));
        let r = Request {
            domain: "x",
            descriptors: &[],
            hits_addend: None,
        };
        assert_eq!(r.validate(), Err(RequestError::NoDescriptors));
        let long = "x".repeat(MAX_PART_BYTES + 1);
        let ents = [e("k", &long)];
        let d = [Descriptor {
            entries: &ents,
            hits_addend: None,
        }];
        let r = Request {
            domain: "x",
            descriptors: &d,
            hits_addend: None,
        };
        assert!(matches!(r.validate(), Err(RequestError::TooLong { .. })));
    }

    #[test]
    fn cost_follows_envoy_hits_addend_rules() {
        let ents = [e("k", "v")];
        let d = [
            Descriptor {
                entries: &ents,
                hits_addend: None,
            },
            Descriptor {
                entries: &ents,
                hits_addend: Some(0),
            },
            Descriptor {
                entries: &ents,
                hits_addend: Some(7),
            },
        ];
        let r = Request {
            domain: "x",
            descriptors: &d,
            hits_addend: None,
        };
        assert_eq!(
            (r.cost_tokens(0), r.cost_tokens(1), r.cost_tokens(2)),
            (1, 0, 7)
        );
        let r = Request {
            domain: "x",
            descriptors: &d,
            hits_addend: Some(0),
        };
        assert_eq!(r.cost_tokens(0), 1);
        let r = Request {
            domain: "x",
            descriptors: &d,
            hits_addend: Some(3),
        };
        assert_eq!(r.cost_tokens(0), 3);
    }
}
