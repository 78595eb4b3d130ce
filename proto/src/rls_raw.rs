//! `envoy.service.ratelimit.v3.RateLimitRequest` with its strings as raw bytes: the same field
//! numbers and wire types, but `bytes` where the proto says `string`, so a body that is a
//! well-formed protobuf apart from UTF-8 decodes (issue 10 item 16).
//!
//! Envoy copies request header values (which HTTP/1 lets carry bytes 0x80–0xFF) into the
//! request's `string` fields without checking UTF-8; prost refuses such a `string`, and an RLS
//! error lets the request through Envoy by default. A server decodes this mirror only after
//! [`RateLimitRequest`](crate::envoy::service::ratelimit::v3::RateLimitRequest) failed, to tell
//! "not UTF-8 at `path`" (refused as OVER_LIMIT) from "not a protobuf" (an error).

use crate::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;

/// `RateLimitRequest` with `domain`, keys and values as bytes (field numbers 1–3 as Envoy's).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawRateLimitRequest {
    /// `domain` (string in Envoy's proto).
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    /// `descriptors`.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RawDescriptor>,
    /// `hits_addend`.
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `RateLimitDescriptor` with its entries' strings as bytes (field numbers 1–4 as Envoy's).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RawDescriptor {
    /// `entries`.
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<RawEntry>,
    /// `limit`, decoded only so that a malformed override fails here as in the real message.
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    /// `hits_addend` (`google.protobuf.UInt64Value`).
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<u64>,
    /// `is_negative_hits`.
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

/// `RateLimitDescriptor.Entry` with `key` and `value` as bytes.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct RawEntry {
    /// `key` (string in Envoy's proto).
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    /// `value` (string in Envoy's proto).
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

impl RawRateLimitRequest {
    /// The path of the first string field that is not UTF-8, in Envoy's field names
    /// (`domain`, `descriptors[i].entries[j].key`, `descriptors[i].entries[j].value`), or `None`
    /// when every string is UTF-8.
    pub fn first_non_utf8(&self) -> Option<String> {
        if std::str::from_utf8(&self.domain).is_err() {
            return Some("domain".to_string());
        }
        self.descriptors.iter().enumerate().find_map(|(i, d)| {
            d.entries.iter().enumerate().find_map(|(j, e)| {
                let bad = |b: &[u8]| std::str::from_utf8(b).is_err();
                let field = if bad(&e.key) {
                    "key"
                } else if bad(&e.value) {
                    "value"
                } else {
                    return None;
                };
                Some(format!("descriptors[{i}].entries[{j}].{field}"))
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor, RateLimitDescriptor,
    };
    use crate::envoy::service::ratelimit::v3::RateLimitRequest;
    use prost::Message;

    fn request(value: &str) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![
                    rate_limit_descriptor::Entry {
                        key: "a".into(),
                        value: "ok".into(),
                    },
                    rate_limit_descriptor::Entry {
                        key: "tenant".into(),
                        value: value.into(),
                    },
                ],
                limit: None,
                hits_addend: Some(u64::MAX),
                is_negative_hits: true,
            }],
            hits_addend: u32::MAX,
        }
    }

    /// Replaces the first occurrence of `from` in `bytes` by `to` (same length).
    fn patch(bytes: &mut [u8], from: &[u8], to: &[u8]) {
        let at = bytes.windows(from.len()).position(|w| w == from).unwrap();
        bytes[at..at + from.len()].copy_from_slice(to);
    }

    /// The mirror reads every field of a valid request as the real message does.
    #[test]
    fn valid_request_decodes_the_same_through_the_mirror() {
        let bytes = request("acme").encode_to_vec();
        let raw = RawRateLimitRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(raw.domain, b"d");
        assert_eq!(raw.hits_addend, u32::MAX);
        let d = &raw.descriptors[0];
        assert_eq!((d.hits_addend, d.is_negative_hits), (Some(u64::MAX), true));
        assert_eq!(d.entries[1].key, b"tenant");
        assert_eq!(d.entries[1].value, b"acme");
        assert_eq!(raw.first_non_utf8(), None);
        assert_eq!(raw.encode_to_vec(), bytes);
    }

    /// obs-text in a value: the real message refuses it, the mirror names the field.
    #[test]
    fn non_utf8_value_fails_the_real_message_and_is_named_by_the_mirror() {
        let mut bytes = request("acme").encode_to_vec();
        patch(&mut bytes, b"acme", b"\xffcm\x80");
        assert!(RateLimitRequest::decode(bytes.as_slice()).is_err());
        let raw = RawRateLimitRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            raw.first_non_utf8().as_deref(),
            Some("descriptors[0].entries[1].value")
        );
        patch(&mut bytes, b"tenant", b"tenan\xc3");
        let raw = RawRateLimitRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            raw.first_non_utf8().as_deref(),
            Some("descriptors[0].entries[1].key")
        );
        let mut domain = request("acme").encode_to_vec();
        patch(&mut domain, &[0x0a, 0x01, b'd'], &[0x0a, 0x01, 0xfe]);
        let raw = RawRateLimitRequest::decode(domain.as_slice()).unwrap();
        assert_eq!(raw.first_non_utf8().as_deref(), Some("domain"));
    }

    /// A body that is not a protobuf fails the mirror too.
    #[test]
    fn truncated_body_fails_the_mirror() {
        assert!(RawRateLimitRequest::decode(&b"\x12\x64\x0a\x00"[..]).is_err());
    }
}
