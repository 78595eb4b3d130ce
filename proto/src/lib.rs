//! Protocol buffer types and gRPC stubs for Allot, generated at build time by `tonic-prost-build`.
//!
//! - [`allot::v1`]: the allocator's public API ([`allot::v1::allocator_server::Allocator`]), the
//!   internal Raft transport ([`allot::v1::raft_service_server::RaftService`]) and the agent's
//!   native gateway API ([`allot::v1::agent_server::Agent`]).
//! - [`envoy`]: the subset of Envoy's data-plane API needed to serve Envoy's rate limit service v3
//!   (`envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`), with Envoy's package names,
//!   message names and field numbers, so a stock Envoy can call an Allot agent.
//!
//! Google's well-known types (`google.protobuf.*`) map to [`prost_types`]. A failed allocator
//! call carries its typed [`allot::v1::ErrorDetail`] in the status details, inside a
//! `google.rpc.Status` ([`error_detail`]). A [`allot::v1::Member`] parses from `ID=HOST:PORT`
//! ([`member`]).

pub use prost_types;

pub mod error_detail;
pub mod member;
pub mod rls_raw;

/// `google.rpc`: the gRPC rich error model's [`google::rpc::Status`], the encoding of a failed
/// call's status details (see [`error_detail`]).
pub mod google {
    /// `google.rpc`: [`rpc::Status`].
    pub mod rpc {
        tonic::include_proto!("google.rpc");
    }
}

/// Allot's own protocols.
pub mod allot {
    /// Version 1 of the allocator API, the Raft transport and the agent API.
    ///
    /// In the allocator API token quantities are microtokens (1 token = 1_000_000), times are Unix milliseconds (UTC)
    /// and durations milliseconds; the agent API counts whole tokens, as Envoy does.
    pub mod v1 {
        tonic::include_proto!("allot.v1");
    }
}

/// The subset of Envoy's v3 API that the rate limit service uses.
pub mod envoy {
    /// `envoy.config.*`
    pub mod config {
        /// `envoy.config.core`
        pub mod core {
            /// `envoy.config.core.v3`: [`v3::HeaderValue`].
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }

    /// `envoy.type.*`
    pub mod r#type {
        /// `envoy.type.v3`: [`v3::RateLimitUnit`].
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }

    /// `envoy.extensions.*`
    pub mod extensions {
        /// `envoy.extensions.common`
        pub mod common {
            /// `envoy.extensions.common.ratelimit`
            pub mod ratelimit {
                /// `envoy.extensions.common.ratelimit.v3`: [`v3::RateLimitDescriptor`].
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }

    /// `envoy.service.*`
    pub mod service {
        /// `envoy.service.ratelimit`
        pub mod ratelimit {
            /// `envoy.service.ratelimit.v3`: the `RateLimitService` client and server, with
            /// [`v3::RateLimitRequest`] and [`v3::RateLimitResponse`].
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor, RateLimitDescriptor,
    };
    use super::envoy::service::ratelimit::v3::{
        rate_limit_response, RateLimitRequest, RateLimitResponse,
    };
    use prost::Message;

    /// Field numbers are the wire contract with Envoy: hand-encoded bytes must decode.
    #[test]
    fn rls_request_field_numbers_match_envoy() {
        let req = RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![rate_limit_descriptor::Entry {
                    key: "k".into(),
                    value: "v".into(),
                }],
                limit: None,
                hits_addend: Some(7),
                is_negative_hits: false,
            }],
            hits_addend: 3,
        };
        let bytes = req.encode_to_vec();
        // domain = 1 (LEN), descriptors = 2 (LEN), hits_addend = 3 (VARINT).
        assert_eq!(&bytes[..3], &[0x0a, 0x01, b'd']);
        assert_eq!(bytes[3], 0x12);
        assert_eq!(&bytes[bytes.len() - 2..], &[0x18, 0x03]);
        // Inside the descriptor: entries = 1, hits_addend (UInt64Value) = 3 wrapping value = 1.
        let descriptor = &bytes[5..bytes.len() - 2];
        assert_eq!(descriptor[0], 0x0a);
        assert_eq!(
            &descriptor[descriptor.len() - 4..],
            &[0x1a, 0x02, 0x08, 0x07]
        );
        assert_eq!(RateLimitRequest::decode(bytes.as_slice()).ok(), Some(req));
    }

    #[test]
    fn rls_response_codes_match_envoy() {
        assert_eq!(rate_limit_response::Code::Ok as i32, 1);
        assert_eq!(rate_limit_response::Code::OverLimit as i32, 2);
        assert_eq!(rate_limit_response::rate_limit::Unit::Week as i32, 7);
        let resp = RateLimitResponse {
            overall_code: rate_limit_response::Code::OverLimit as i32,
            ..Default::default()
        };
        assert_eq!(resp.encode_to_vec(), vec![0x08, 0x02]);
    }
}
