//! The `ShouldRateLimit` answer, encoded straight from the verdict (issue 13 item 5): the
//! protobuf bytes of the `RateLimitResponse` that [`response`](super::response) builds, written
//! into the transport's buffer without building that message (its `Vec`s and `String`s would
//! be allocated per request). A test holds the bytes to prost's encoding of [`response`]'s
//! message for every kind of verdict.

use super::{code, duration, unit};
use crate::api::proto_out::{
    message_header, message_len, opt_str, opt_varint, opt_varint_len, str_len, varint, varint_len,
};
use crate::api::{rate_limit_header_values, rule_limit, Verdict};
use allot_proto::envoy::service::ratelimit::v3::{rate_limit_response, RateLimitResponse};
use prost::bytes::BufMut;
use prost::Message;

/// What `ShouldRateLimit` answers.
#[derive(Debug)]
pub enum RlsAnswer {
    /// A decided request, encoded from its verdict.
    Decided(Verdict),
    /// A domain no config names: OK with this many statuses and no limit (as
    /// envoyproxy/ratelimit answers a domain it does not know).
    UnknownDomain(usize),
    /// Anything else (invalid input refused as OVER_LIMIT with its reason): a built message.
    Built(RateLimitResponse),
}

impl RlsAnswer {
    /// The answer as prost's message (allocates; for the generated service trait and tests).
    pub fn to_response(&self) -> RateLimitResponse {
        match self {
            RlsAnswer::Decided(v) => super::response(v),
            RlsAnswer::UnknownDomain(n) => super::unknown_domain(*n),
            RlsAnswer::Built(r) => r.clone(),
        }
    }

    /// Appends the answer's protobuf encoding (the bytes of [`to_response`](Self::to_response)
    /// as prost encodes them) to `buf`, allocating nothing.
    pub fn encode_into(&self, buf: &mut impl BufMut) {
        match self {
            RlsAnswer::Decided(v) => encode_verdict(v, buf),
            RlsAnswer::UnknownDomain(n) => {
                let ok = rate_limit_response::Code::Ok as u64;
                varint(1, ok, buf);
                for _ in 0..*n {
                    message_header(2, varint_len(1, ok), buf);
                    varint(1, ok, buf);
                }
            }
            RlsAnswer::Built(r) => r.encode_raw(buf),
        }
    }
}

/// The fields of one `DescriptorStatus`, as [`response`](super::response) sets them.
struct Status<'a> {
    code: u64,
    /// `current_limit`: (name, requests_per_unit, unit).
    limit: Option<(&'a str, u64, u64)>,
    remaining: u64,
    /// `duration_until_reset`: (seconds, nanos).
    reset: Option<(u64, u64)>,
}

impl<'a> Status<'a> {
    fn of(v: &'a Verdict, i: usize) -> Self {
        let s = &v.statuses[i];
        let limit = s.limit.and(v.rule(i)).and_then(|r| {
            let (rpu, u, _) = rule_limit(r)?;
            let rpu = u32::try_from(rpu).unwrap_or(u32::MAX);
            Some((r.name.as_str(), u64::from(rpu), unit(u) as u64))
        });
        let remaining = match limit {
            Some(_) => u64::from(u32::try_from(s.remaining).unwrap_or(u32::MAX)),
            None => 0,
        };
        let reset = limit.map(|_| {
            let d = duration(s.reset_after);
            // Both non-negative: seconds saturate at i64::MAX, nanos are below 10⁹.
            (d.seconds as u64, d.nanos as u64)
        });
        Status {
            code: code(s.code) as u64,
            limit,
            remaining,
            reset,
        }
    }

    fn limit_len(&self) -> Option<usize> {
        self.limit.map(|(name, rpu, unit)| {
            str_len(3, name) + opt_varint_len(1, rpu) + opt_varint_len(2, unit)
        })
    }

    fn reset_len(&self) -> Option<usize> {
        self.reset
            .map(|(secs, nanos)| opt_varint_len(1, secs) + opt_varint_len(2, nanos))
    }

    fn len(&self) -> usize {
        opt_varint_len(1, self.code)
            + self.limit_len().map_or(0, |n| message_len(2, n))
            + opt_varint_len(3, self.remaining)
            + self.reset_len().map_or(0, |n| message_len(4, n))
    }

    fn encode(&self, buf: &mut impl BufMut) {
        opt_varint(1, self.code, buf);
        if let (Some((name, rpu, unit)), Some(len)) = (self.limit, self.limit_len()) {
            // In tag order, as prost writes them (the .proto declares name, tag 3, first).
            message_header(2, len, buf);
            opt_varint(1, rpu, buf);
            opt_varint(2, unit, buf);
            opt_str(3, name, buf);
        }
        opt_varint(3, self.remaining, buf);
        if let (Some((secs, nanos)), Some(len)) = (self.reset, self.reset_len()) {
            message_header(4, len, buf);
            opt_varint(1, secs, buf);
            opt_varint(2, nanos, buf);
        }
    }
}

fn encode_verdict(v: &Verdict, buf: &mut impl BufMut) {
    varint(1, code(v.outcome.code) as u64, buf);
    for i in 0..v.statuses.len() {
        let s = Status::of(v, i);
        message_header(2, s.len(), buf);
        s.encode(buf);
    }
    for (name, value) in rate_limit_header_values(v) {
        let mut digits = itoa::Buffer::new();
        let value = digits.format(value);
        message_header(3, str_len(1, name) + str_len(2, value), buf);
        opt_str(1, name, buf);
        opt_str(2, value, buf);
    }
}
