//! Outgoing Raft RPCs over gRPC ([`allot_proto::allot::v1::raft_service_client`]).
//!
//! Connections are lazy: creating a client never touches the network, the first RPC connects,
//! and a peer that cannot be reached answers [`openraft::error::Unreachable`] so openraft backs
//! off instead of retrying hot.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use allot_proto::allot::v1::raft_service_client::RaftServiceClient;
use allot_proto::allot::v1::RaftPayload;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Timeout, Unreachable,
};
use openraft::network::RPCOption;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, RPCTypes, RaftNetwork, RaftNetworkFactory};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};

use super::app::App;
use super::codec::{decode, encode};
use super::types::{AllotRaft, NodeId};

/// Largest Raft message accepted, bytes. Snapshot chunks and entry batches stay well below it.
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

/// Makes gRPC channels to peers. The seam that lets a simulated network replace TCP.
pub trait ChannelFactory: Send + Sync + 'static {
    /// A channel to `addr` ("host:port") that connects on first use, never here.
    ///
    /// # Errors
    /// The transport error when `addr` is not a valid endpoint.
    fn channel(&self, addr: &str) -> Result<Channel, tonic::transport::Error>;
}

/// Plain TCP (HTTP/2 without TLS), connecting lazily.
#[derive(Debug, Clone)]
pub struct LazyTcpChannels {
    /// Limit on establishing a TCP connection.
    pub connect_timeout: Duration,
}

impl Default for LazyTcpChannels {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_millis(500),
        }
    }
}

impl ChannelFactory for LazyTcpChannels {
    fn channel(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        Ok(Endpoint::from_shared(format!("http://{addr}"))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .connect_lazy())
    }
}

/// Creates one [`GrpcNetwork`] per peer for openraft.
pub struct GrpcNetworkFactory<A> {
    id: NodeId,
    channels: Arc<dyn ChannelFactory>,
    _app: PhantomData<fn() -> A>,
}

impl<A> GrpcNetworkFactory<A> {
    /// A factory for node `id` making channels with `channels`.
    pub fn new(id: NodeId, channels: Arc<dyn ChannelFactory>) -> Self {
        Self {
            id,
            channels,
            _app: PhantomData,
        }
    }
}

impl<A: App> RaftNetworkFactory<AllotRaft<A>> for GrpcNetworkFactory<A> {
    type Network = GrpcNetwork<A>;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Self::Network {
        GrpcNetwork {
            id: self.id,
            target,
            node: node.clone(),
            channels: self.channels.clone(),
            client: None,
            _app: PhantomData,
        }
    }
}

/// The RPC client to one peer.
pub struct GrpcNetwork<A> {
    id: NodeId,
    target: NodeId,
    node: BasicNode,
    channels: Arc<dyn ChannelFactory>,
    client: Option<RaftServiceClient<Channel>>,
    _app: PhantomData<fn() -> A>,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

impl<A: App> GrpcNetwork<A> {
    fn client(&mut self) -> Result<RaftServiceClient<Channel>, Unreachable> {
        if let Some(client) = &self.client {
            return Ok(client.clone());
        }
        let channel = self
            .channels
            .channel(&self.node.addr)
            .map_err(|e| Unreachable::new(&e))?;
        let client = RaftServiceClient::new(channel)
            .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
        self.client = Some(client.clone());
        Ok(client)
    }

    /// Sends one RPC: bincode-encodes `req`, calls `kind` and decodes the remote
    /// `Result<Resp, RaftError<E>>`.
    async fn call<Req, Resp, E>(
        &mut self,
        kind: RPCTypes,
        req: &Req,
        option: &RPCOption,
    ) -> RpcResult<Resp, E>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let payload = encode(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let mut client = self.client().map_err(RPCError::Unreachable)?;
        let ttl = option.hard_ttl();
        let mut request = tonic::Request::new(RaftPayload { payload });
        request.set_timeout(ttl);
        let call = async {
            match kind {
                RPCTypes::AppendEntries => client.append_entries(request).await,
                RPCTypes::Vote => client.vote(request).await,
                RPCTypes::InstallSnapshot => client.install_snapshot(request).await,
            }
        };
        let timeout = || {
            RPCError::Timeout(Timeout {
                action: kind,
                id: self.id,
                target: self.target,
                timeout: ttl,
            })
        };
        // tonic's own deadline (`set_timeout`) answers first; this guard only ends a call that
        // outlives it anyway.
        let guard = ttl.saturating_add(Duration::from_millis(50));
        let response = match tokio::time::timeout(guard, call).await {
            Err(_elapsed) => return Err(timeout()),
            Ok(Err(status)) => {
                return Err(match classify(&status) {
                    Failure::Timeout => timeout(),
                    Failure::Unreachable => RPCError::Unreachable(Unreachable::new(&status)),
                    Failure::Other => RPCError::Network(NetworkError::new(&status)),
                });
            }
            Ok(Ok(response)) => response.into_inner(),
        };
        let result: Result<Resp, RaftError<NodeId, E>> =
            decode(&response.payload).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        result.map_err(|e| {
            RPCError::RemoteError(RemoteError::new_with_node(
                self.target,
                self.node.clone(),
                e,
            ))
        })
    }
}

/// How a failed Raft RPC is reported to openraft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// The call outlived its deadline: openraft tries again at its next heartbeat.
    Timeout,
    /// The peer is down (connection refused, reset): openraft backs off (500 ms) before it
    /// sends that peer anything again.
    Unreachable,
    /// Anything else.
    Other,
}

/// Classifies a failed call's status, once. The deadline comes first: tonic reports its own
/// request timeout ("Timeout expired") as CANCELLED with a transport error as its source, and
/// reading that as "unreachable" put a slow but live follower into openraft's 500 ms backoff;
/// with both followers slow at once (AppendEntries' deadline is one heartbeat, 150 ms, and two
/// cores under load) the leader committed nothing for half a second (issue 9: the tenants-100k
/// part lost ~1,700 decisions to one such stall).
fn classify(status: &tonic::Status) -> Failure {
    match status.code() {
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => Failure::Timeout,
        tonic::Code::Unavailable => Failure::Unreachable,
        _ if is_transport(status) => Failure::Unreachable,
        _ => Failure::Other,
    }
}

/// tonic reports client-side connection failures as a status whose source is a transport error.
fn is_transport(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    status
        .source()
        .is_some_and(|s| s.is::<tonic::transport::Error>())
}

impl<A: App> RaftNetwork<AllotRaft<A>> for GrpcNetwork<A> {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<AllotRaft<A>>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, openraft::error::Infallible> {
        self.call(RPCTypes::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<AllotRaft<A>>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        self.call(RPCTypes::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, openraft::error::Infallible> {
        self.call(RPCTypes::Vote, &rpc, &option).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use openraft::Vote;

    use super::*;
    use crate::raft::test_app::CounterApp;

    /// One Vote from a fresh client of `factory` to node `target` at `addr`, with deadline `ttl`.
    async fn vote_to(
        factory: &mut GrpcNetworkFactory<CounterApp>,
        target: u64,
        addr: &str,
        ttl: Duration,
    ) -> RpcResult<VoteResponse<NodeId>, openraft::error::Infallible> {
        let mut client = factory.new_client(target, &BasicNode::new(addr)).await;
        client
            .vote(VoteRequest::new(Vote::new(1, 1), None), RPCOption::new(ttl))
            .await
    }

    #[tokio::test]
    async fn a_peer_that_does_not_answer_in_time_is_a_timeout_not_unreachable() {
        // A listener that never accepts: the kernel completes the TCP handshake, nothing
        // answers HTTP/2, so the call reaches its deadline (a slow follower, not a dead one).
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let mut factory =
            GrpcNetworkFactory::<CounterApp>::new(1, Arc::new(LazyTcpChannels::default()));
        let result = vote_to(&mut factory, 2, &addr, Duration::from_millis(200)).await;
        assert!(
            matches!(result, Err(RPCError::Timeout(_))),
            "got {result:?}"
        );
        drop(listener);
    }

    #[test]
    fn statuses_are_classified_deadline_first() {
        let c = |s: tonic::Status| classify(&s);
        assert_eq!(
            c(tonic::Status::cancelled("Timeout expired")),
            Failure::Timeout
        );
        assert_eq!(
            c(tonic::Status::deadline_exceeded("late")),
            Failure::Timeout
        );
        assert_eq!(
            c(tonic::Status::unavailable("refused")),
            Failure::Unreachable
        );
        assert_eq!(c(tonic::Status::internal("bug")), Failure::Other);
    }

    #[tokio::test]
    async fn dead_peer_is_unreachable_and_creating_a_client_does_not_connect() {
        // A port that was just free: nothing listens there.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        drop(listener);

        let mut factory =
            GrpcNetworkFactory::<CounterApp>::new(1, Arc::new(LazyTcpChannels::default()));
        let result = vote_to(&mut factory, 2, &addr, Duration::from_secs(2)).await;
        assert!(
            matches!(result, Err(RPCError::Unreachable(_))),
            "got {result:?}"
        );

        let result = vote_to(&mut factory, 3, "not a uri", Duration::from_secs(2)).await;
        assert!(
            matches!(result, Err(RPCError::Unreachable(_))),
            "got {result:?}"
        );
    }
}
