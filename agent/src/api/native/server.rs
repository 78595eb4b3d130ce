//! The tonic server for `allot.v1.Agent`: `Check` through a codec whose encoder writes the
//! [`NativeAnswer`] straight into tonic's buffer (no `CheckResponse` built per request, issue 13
//! item 5); every other method through the generated server.

use super::{NativeAnswer, NativeService};
use allot_proto::allot::v1 as pb;
use allot_proto::allot::v1::agent_server::{AgentServer, SERVICE_NAME};
use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::body::Body as TonicBody;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic::codegen::{http, Body, BoxFuture, StdError};
use tonic::server::{Grpc, NamedService, UnaryService};
use tonic::Status;
use tonic_prost::ProstDecoder;

/// The gRPC path of `Check`.
const CHECK: &str = "/allot.v1.Agent/Check";

/// The `allot.v1.Agent` server over a [`NativeService`].
#[derive(Debug, Clone)]
pub struct NativeServer {
    generated: AgentServer<NativeService>,
    service: Arc<NativeService>,
}

impl NativeServer {
    /// A server answering with `service`.
    pub fn new(service: NativeService) -> Self {
        NativeServer {
            generated: AgentServer::new(service.clone()),
            service: Arc::new(service),
        }
    }
}

impl NamedService for NativeServer {
    const NAME: &'static str = SERVICE_NAME;
}

impl<B> tower::Service<http::Request<B>> for NativeServer
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
        if req.uri().path() != CHECK {
            return self.generated.call(req);
        }
        let method = CheckMethod(Arc::clone(&self.service));
        Box::pin(async move { Ok(Grpc::new(CheckCodec).unary(method, req).await) })
    }
}

/// `Check`'s codec: prost's decoder for the request, [`CheckEncoder`] for the answer.
#[derive(Debug, Clone, Copy, Default)]
struct CheckCodec;

impl Codec for CheckCodec {
    type Encode = NativeAnswer;
    type Decode = pb::CheckRequest;
    type Encoder = CheckEncoder;
    type Decoder = ProstDecoder<pb::CheckRequest>;

    fn encoder(&mut self) -> Self::Encoder {
        CheckEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

/// Writes a [`NativeAnswer`] as `CheckResponse` bytes ([`NativeAnswer::encode_into`]).
#[derive(Debug, Clone, Copy, Default)]
struct CheckEncoder;

impl Encoder for CheckEncoder {
    type Item = NativeAnswer;
    type Error = Status;

    fn encode(&mut self, item: NativeAnswer, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode_into(buf);
        Ok(())
    }
}

/// The `Check` method over a [`NativeService`].
struct CheckMethod(Arc<NativeService>);

impl UnaryService<pb::CheckRequest> for CheckMethod {
    type Response = NativeAnswer;
    type Future = BoxFuture<tonic::Response<NativeAnswer>, Status>;

    fn call(&mut self, request: tonic::Request<pb::CheckRequest>) -> Self::Future {
        let service = Arc::clone(&self.0);
        Box::pin(async move {
            let answer = service.check_answer(request.get_ref()).await?;
            Ok(tonic::Response::new(answer))
        })
    }
}
