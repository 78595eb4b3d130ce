//! A do-nothing Envoy RLS server (always OK): the baseline a rate-limit service is measured
//! against in the same run, so a latency figure shows the limiter's own cost over the transport.

use allot_proto::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use allot_proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use allot_proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

/// Answers OK to everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopRls;

#[tonic::async_trait]
impl RateLimitService for NoopRls {
    async fn should_rate_limit(
        &self,
        req: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let n = req.get_ref().descriptors.len();
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses: (0..n)
                .map(|_| DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }))
    }
}

/// Serves [`NoopRls`] on an ephemeral loopback port in this process; returns its address.
///
/// # Errors
/// When no port can be bound.
pub async fn spawn() -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    tokio::spawn(serve_on(listener));
    Ok(addr)
}

/// Serves [`NoopRls`] on `listen` ("host:port"; port 0 picks a free one) until the process
/// ends: a baseline in a process of its own, like the server it is compared with. With
/// `ready_file`, writes "grpc HOST:PORT" (the bound address) there once it listens.
///
/// # Errors
/// When the address cannot be bound, the ready file cannot be written or the server fails.
pub async fn serve(listen: &str, ready_file: Option<&std::path::Path>) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    if let Some(path) = ready_file {
        let text = format!("grpc {}\n", listener.local_addr()?);
        allot_common::process::write_ready_file(path, &text)?;
    }
    serve_on(listener).await
}

async fn serve_on(listener: tokio::net::TcpListener) -> anyhow::Result<()> {
    // tonic ignores the builder's `tcp_nodelay` for a caller's incoming stream: set it on the
    // accepted sockets, as the agent does, or Nagle's algorithm holds back small responses.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(NoopRls))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}
