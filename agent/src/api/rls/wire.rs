//! The RLS service on the wire: a gRPC server for `ShouldRateLimit` whose decoder tells a body
//! that is a protobuf apart from UTF-8 from one that is not a protobuf at all (issue 10 item 16).
//!
//! Envoy copies header values, which HTTP/1 lets carry bytes 0x80–0xFF, into the request's
//! proto3 `string` fields without checking UTF-8. The generated server would answer such a body
//! INVALID_ARGUMENT before the handler runs, and Envoy lets a request through on an RLS error by
//! default, so one `x-tenant: \xff` header would bypass every limit. This decoder decodes
//! [`RateLimitRequest`] once, straight from the received buffer (a valid request costs nothing
//! more); only when that fails does it decode [`RawRateLimitRequest`] (the same message with
//! strings as bytes) to name the first non-UTF-8 field, which the service refuses as OVER_LIMIT.
//! Only a body that is not a protobuf is an error (INVALID_ARGUMENT; Envoy never sends one).

use super::{RlsAnswer, RlsService};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_server::SERVICE_NAME;
use allot_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use allot_proto::rls_raw::RawRateLimitRequest;
use prost::bytes::Buf;
use prost::Message;
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::body::Body as TonicBody;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{http, Body, BoxFuture, StdError};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::Status;

/// The gRPC path of `ShouldRateLimit`.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// A decoded `ShouldRateLimit` body.
#[derive(Debug, Clone, PartialEq)]
pub enum RlsRequest {
    /// A well-formed request.
    Valid(RateLimitRequest),
    /// A well-formed protobuf whose string field `field` (Envoy's path, e.g.
    /// `descriptors[0].entries[0].value`) is not UTF-8; it has `descriptors` descriptors.
    NotUtf8 {
        /// The first string field that is not UTF-8.
        field: String,
        /// How many descriptors the request has (one status is answered per descriptor).
        descriptors: usize,
    },
}

impl RlsRequest {
    /// Decodes a `ShouldRateLimit` body: a [`RateLimitRequest`] in one pass when it is valid.
    ///
    /// # Errors
    /// INVALID_ARGUMENT when `body` is not a `RateLimitRequest` even with its strings read as
    /// bytes.
    pub fn decode(body: &[u8]) -> Result<Self, Status> {
        match RateLimitRequest::decode(body) {
            Ok(r) => Ok(RlsRequest::Valid(r)),
            Err(e) => Self::from_undecodable(body, &e),
        }
    }

    /// Classifies `body`, which failed to decode as a [`RateLimitRequest`] with `error`.
    ///
    /// # Errors
    /// INVALID_ARGUMENT when `body` is not a `RateLimitRequest` even with its strings read as
    /// bytes (not a protobuf, or a wrong wire type).
    fn from_undecodable(body: &[u8], error: &prost::DecodeError) -> Result<Self, Status> {
        let not_a_request = || Status::invalid_argument(format!("not a RateLimitRequest: {error}"));
        let raw = RawRateLimitRequest::decode(body).map_err(|_| not_a_request())?;
        let field = raw.first_non_utf8().ok_or_else(not_a_request)?;
        Ok(RlsRequest::NotUtf8 {
            field,
            descriptors: raw.descriptors.len(),
        })
    }
}

/// The `ShouldRateLimit` codec: [`RlsEncoder`] for the answer, [`RlsDecoder`] for the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RlsCodec;

impl Codec for RlsCodec {
    type Encode = RlsAnswer;
    type Decode = RlsRequest;
    type Encoder = RlsEncoder;
    type Decoder = RlsDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        RlsEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        RlsDecoder
    }
}

/// Encodes an [`RlsAnswer`] straight into tonic's buffer (the `RateLimitResponse` bytes, with
/// no message built in between: [`RlsAnswer::encode_into`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct RlsEncoder;

impl Encoder for RlsEncoder {
    type Item = RlsAnswer;
    type Error = Status;

    fn encode(&mut self, item: RlsAnswer, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode_into(buf);
        Ok(())
    }
}

/// Decodes a `RateLimitRequest` body into an [`RlsRequest`] (see the module doc).
#[derive(Debug, Clone, Copy, Default)]
pub struct RlsDecoder;

impl Decoder for RlsDecoder {
    type Item = RlsRequest;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<RlsRequest>, Status> {
        let len = buf.remaining();
        let request = if buf.chunk().len() >= len {
            // tonic hands one message in one contiguous buffer: decode it in place, then consume.
            let request = RlsRequest::decode(&buf.chunk()[..len]);
            buf.advance(len);
            request
        } else {
            // Not with tonic's contiguous buffer today; correct (one copy) should that change.
            RlsRequest::decode(&buf.copy_to_bytes(len))
        };
        request.map(Some)
    }
}

/// The `ShouldRateLimit` method over an [`RlsService`].
struct ShouldRateLimit(Arc<RlsService>);

impl UnaryService<RlsRequest> for ShouldRateLimit {
    type Response = RlsAnswer;
    type Future = BoxFuture<tonic::Response<RlsAnswer>, Status>;

    fn call(&mut self, request: tonic::Request<RlsRequest>) -> Self::Future {
        let service = Arc::clone(&self.0);
        Box::pin(async move {
            let response = service.answer(request.into_inner()).await?;
            Ok(tonic::Response::new(response))
        })
    }
}

/// The tonic server for Envoy's `RateLimitService` over an [`RlsService`], decoding with
/// [`RlsCodec`] (in place of the generated server, whose decoder errs on non-UTF-8 strings).
#[derive(Debug, Clone)]
pub struct RlsServer {
    service: Arc<RlsService>,
}

impl RlsServer {
    /// A server answering with `service`.
    pub fn new(service: RlsService) -> Self {
        RlsServer {
            service: Arc::new(service),
        }
    }
}

impl NamedService for RlsServer {
    const NAME: &'static str = SERVICE_NAME;
}

impl<B> tower::Service<http::Request<B>> for RlsServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<TonicBody>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != SHOULD_RATE_LIMIT {
            return Box::pin(async move { Ok(Status::unimplemented("").into_http()) });
        }
        let method = ShouldRateLimit(Arc::clone(&self.service));
        Box::pin(async move { Ok(Grpc::new(RlsCodec).unary(method, req).await) })
    }
}
