//! Incoming Raft RPCs: the gRPC `allot.v1.RaftService` server, forwarding to the local Raft.

use allot_proto::allot::v1::raft_service_server::{RaftService, RaftServiceServer};
use allot_proto::allot::v1::RaftPayload;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use super::app::App;
use super::codec::{decode, encode};
use super::network_out::MAX_RAFT_MESSAGE_BYTES;
use super::types::typ::Raft;

/// Serves `allot.v1.RaftService` for one local Raft node.
///
/// Replies carry `Result<openraft response, openraft RaftError>` so the caller sees the remote
/// Raft's own error. A payload that does not decode is `INVALID_ARGUMENT`.
pub struct RaftServiceHandler<A: App> {
    raft: Raft<A>,
}

impl<A: App> RaftServiceHandler<A> {
    /// A handler forwarding to `raft`.
    pub fn new(raft: Raft<A>) -> Self {
        Self { raft }
    }

    /// The handler wrapped as a tonic service, accepting messages up to
    /// [`MAX_RAFT_MESSAGE_BYTES`].
    pub fn into_service(self) -> RaftServiceServer<Self> {
        RaftServiceServer::new(self)
            .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES)
    }
}

fn decode_request<T: DeserializeOwned>(request: Request<RaftPayload>) -> Result<T, Status> {
    decode(&request.into_inner().payload)
        .map_err(|e| Status::invalid_argument(format!("raft payload does not decode: {e}")))
}

fn reply<T: Serialize>(result: &T) -> Result<Response<RaftPayload>, Status> {
    let payload = encode(result)
        .map_err(|e| Status::internal(format!("raft response does not encode: {e}")))?;
    Ok(Response::new(RaftPayload { payload }))
}

#[tonic::async_trait]
impl<A: App> RaftService for RaftServiceHandler<A> {
    async fn append_entries(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode_request(request)?;
        reply(&self.raft.append_entries(rpc).await)
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode_request(request)?;
        reply(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: Request<RaftPayload>,
    ) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode_request(request)?;
        reply(&self.raft.install_snapshot(rpc).await)
    }
}
