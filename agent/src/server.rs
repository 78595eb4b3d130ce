//! Assembling and running one agent: its settings file, the enforcer and gateway, the gRPC
//! server (Envoy's RLS and the native `allot.v1.Agent` on one port), the HTTP server, the lease
//! manager and the sweeper of expired requests. The `allot-agent` binary and the tests share it.

use crate::api::http::router;
use crate::api::native::NativeService;
use crate::api::rls::RlsService;
use crate::api::{Decider, TrackingSettings};
use crate::enforce::Enforcer;
use crate::lease::book::leased;
use crate::lease::{AllocatorLink, LeaseBook, LeaseEvent, LeaseManager, LeaseSettings, LinkError};
use crate::metrics::{Metrics, MetricsError};
use allot_common::clock::Clock;
use allot_common::config::{ConfigError, ConfigSet};
use axum::serve::ListenerExt;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Why an agent could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The settings file could not be read.
    #[error("cannot read agent settings {file}: {message}")]
    SettingsIo {
        /// The file.
        file: PathBuf,
        /// Why.
        message: String,
    },
    /// The settings file is not valid (YAML syntax, unknown field, bad value).
    #[error("invalid agent settings {file}: {message}")]
    Settings {
        /// The file.
        file: PathBuf,
        /// Why, naming the field.
        message: String,
    },
    /// A setting is missing or inconsistent.
    #[error("{0}")]
    Invalid(String),
    /// The policies could not be loaded.
    #[error(transparent)]
    Policies(#[from] ConfigError),
    /// The allocator endpoints are unusable.
    #[error(transparent)]
    Link(#[from] LinkError),
    /// Metrics could not be set up.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
}

/// `listen:` of the settings file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ListenFile {
    /// gRPC address (RLS and native), e.g. `127.0.0.1:8081`.
    pub grpc: Option<String>,
    /// HTTP address, e.g. `127.0.0.1:8080`.
    pub http: Option<String>,
}

/// `lease:` of the settings file (see [`LeaseSettings`] for meanings and defaults).
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct LeaseFile {
    pub report_interval_ms: Option<u64>,
    pub call_timeout_ms: Option<u64>,
    pub cold_wait_ms: Option<u64>,
    pub drift_margin_ms: Option<u64>,
    pub low_watermark_pct: Option<u32>,
    pub emergency_ppm: Option<u32>,
    pub retry_floor_ms: Option<u64>,
    pub error_backoff_ms: Option<u64>,
    pub idle_evict_ms: Option<u64>,
    pub idle_return_ms: Option<u64>,
    pub rate_leases: Option<bool>,
    pub settled_rates: Option<bool>,
    pub promote_tokens: Option<u64>,
    pub demote_tokens: Option<u64>,
}

/// `gateway:` of the settings file (see [`TrackingSettings`]).
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct TrackingFile {
    pub default_reserve_ttl_ms: Option<u64>,
    pub max_reserve_ttl_ms: Option<u64>,
    pub slot_ttl_ms: Option<u64>,
    pub tombstone_ms: Option<u64>,
    pub max_tracked: Option<usize>,
}

/// The agent's settings file (YAML).
///
/// ```yaml
/// agent_id: gw-1
/// region: eu-west
/// allocators: ["10.0.0.1:7000", "10.0.0.2:7000"]
/// listen: {grpc: "0.0.0.0:8081", http: "0.0.0.0:8080"}
/// policies: /etc/allot/policies     # a YAML file or a folder of them
/// policy_reload_ms: 5000             # read again when changed (and on SIGHUP); 0: SIGHUP only
/// lease: {report_interval_ms: 1000, cold_wait_ms: 250}
/// gateway: {slot_ttl_ms: 60000}
/// ```
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AgentFile {
    /// This agent's id (unique in its region).
    pub agent_id: Option<String>,
    /// Its region.
    pub region: Option<String>,
    /// Allocator nodes, `host:port`.
    #[serde(default)]
    pub allocators: Vec<String>,
    /// Listen addresses.
    #[serde(default)]
    pub listen: ListenFile,
    /// Policy file or folder; relative paths are relative to the settings file.
    pub policies: Option<PathBuf>,
    /// How often the policy files are read again and, when their contents changed and are
    /// valid, made current ([`crate::reload`]), ms (default 5 000; 0: only on SIGHUP).
    pub policy_reload_ms: Option<u64>,
    /// Lease settings.
    #[serde(default)]
    pub lease: LeaseFile,
    /// Request tracking settings (the `gateway:` section: requests tracked by id, reservations
    /// and held concurrency slots; see [`TrackingSettings`]).
    #[serde(default)]
    pub gateway: TrackingFile,
}

impl AgentFile {
    /// Reads and parses a settings file; a relative `policies` path is resolved against the
    /// file's folder.
    ///
    /// # Errors
    /// [`AgentError::SettingsIo`] or [`AgentError::Settings`].
    pub fn load(path: &Path) -> Result<Self, AgentError> {
        let text = std::fs::read_to_string(path).map_err(|e| AgentError::SettingsIo {
            file: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let mut f = Self::parse(&text, path)?;
        if let (Some(p), Some(dir)) = (&f.policies, path.parent()) {
            if p.is_relative() {
                f.policies = Some(dir.join(p));
            }
        }
        Ok(f)
    }

    /// Parses settings YAML; `file` names it in errors.
    ///
    /// # Errors
    /// [`AgentError::Settings`] naming the problem.
    pub fn parse(text: &str, file: &Path) -> Result<Self, AgentError> {
        if text.trim().is_empty() {
            return Ok(AgentFile::default());
        }
        serde_saphyr::from_str(text).map_err(|e| AgentError::Settings {
            file: file.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Lease settings with this file's overrides on the defaults.
    pub fn lease_settings(&self, agent_id: &str, region: &str) -> LeaseSettings {
        let mut s = LeaseSettings::new(agent_id, region);
        let l = &self.lease;
        set(&mut s.report_interval_ms, l.report_interval_ms);
        set(&mut s.call_timeout_ms, l.call_timeout_ms);
        set(&mut s.cold_wait_ms, l.cold_wait_ms);
        set(&mut s.drift_margin_ms, l.drift_margin_ms);
        set(&mut s.retry_floor_ms, l.retry_floor_ms);
        set(&mut s.error_backoff_ms, l.error_backoff_ms);
        set(&mut s.idle_evict_ms, l.idle_evict_ms);
        set(&mut s.idle_return_ms, l.idle_return_ms);
        set(&mut s.promote_tokens, l.promote_tokens);
        set(&mut s.demote_tokens, l.demote_tokens);
        set(&mut s.rate_leases, l.rate_leases);
        set(&mut s.settled_rates, l.settled_rates);
        set(&mut s.low_watermark_pct, l.low_watermark_pct);
        set(&mut s.emergency_ppm, l.emergency_ppm);
        s
    }

    /// Request tracking settings with this file's overrides on the defaults.
    pub fn tracking_settings(&self) -> TrackingSettings {
        let mut s = TrackingSettings::default();
        let g = &self.gateway;
        set(&mut s.default_reserve_ttl_ms, g.default_reserve_ttl_ms);
        set(&mut s.max_reserve_ttl_ms, g.max_reserve_ttl_ms);
        set(&mut s.slot_ttl_ms, g.slot_ttl_ms);
        set(&mut s.tombstone_ms, g.tombstone_ms);
        set(&mut s.max_tracked, g.max_tracked);
        s
    }
}

/// A setting the file gives overrides the default.
fn set<T>(dst: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *dst = v;
    }
}

/// A built agent, not yet running its background tasks.
pub struct Agent {
    /// What the adapters call.
    pub decider: Arc<Decider>,
    events: Option<mpsc::UnboundedReceiver<LeaseEvent>>,
    link: Option<Arc<AllocatorLink>>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("link", &self.link).finish()
    }
}

impl Agent {
    /// Builds an agent deciding with `policies`, leasing from `allocators` (connected lazily).
    ///
    /// # Errors
    /// [`AgentError::Invalid`] when a policy is leased (`scope: global`) but no allocator is
    /// configured; [`AgentError::Link`] for a bad endpoint; [`AgentError::Metrics`].
    pub fn build(
        policies: ConfigSet,
        lease: LeaseSettings,
        tracking: TrackingSettings,
        allocators: &[String],
        clock: Arc<dyn Clock>,
    ) -> Result<Self, AgentError> {
        if allocators.is_empty() {
            if let Some(name) = first_leased(&policies) {
                return Err(AgentError::Invalid(format!(
                    "policy {name:?} has scope: global (leased from the allocator) but no \
                     allocator endpoint is configured; add `allocators` or set `scope: local`"
                )));
            }
        }
        let link = if allocators.is_empty() {
            None
        } else {
            Some(Arc::new(AllocatorLink::new(
                allocators,
                Duration::from_millis(lease.call_timeout_ms),
            )?))
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let book = Arc::new(LeaseBook::new(clock, lease, tx));
        let enforcer = Arc::new(Enforcer::new(policies, book.clone()));
        let metrics = Arc::new(Metrics::new(book)?);
        Ok(Agent {
            decider: Arc::new(Decider::new(enforcer, metrics, tracking)),
            // Without an allocator nothing is leased, so no lease event is ever sent.
            events: link.is_some().then_some(rx),
            link,
        })
    }

    /// Starts the lease manager (when an allocator is configured) and the sweeper; both stop
    /// when `shutdown` turns true, the manager after releasing every allocation. Await the
    /// handle for a clean exit.
    pub fn spawn_background(&mut self, shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
        let manager = match (self.link.clone(), self.events.take()) {
            (Some(link), Some(events)) => {
                let m = LeaseManager::new(self.decider.enforcer().book().clone(), link);
                Some(tokio::spawn(m.run(events, shutdown.clone())))
            }
            _ => None,
        };
        let sweeper = spawn_sweeper(self.decider.clone(), shutdown);
        tokio::spawn(async move {
            if let Some(m) = manager {
                let _ = m.await;
            }
            let _ = sweeper.await;
        })
    }
}

/// The name of the first `scope: global` (leased) rule of `policies`, if any: such a rule needs
/// an allocator, at start ([`Agent::build`]) and at a reload ([`crate::reload`]).
pub(crate) fn first_leased(policies: &ConfigSet) -> Option<String> {
    policies
        .domains()
        .flat_map(|d| d.rules.iter())
        .find(|r| leased(r))
        .map(|r| r.name.clone())
}

/// Expires abandoned reservations and forgotten slots once a second until `shutdown`.
pub fn spawn_sweeper(decider: Arc<Decider>, mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => decider.sweep(),
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { break },
            }
        }
    })
}

/// Resolves when `shutdown` turns true (or its sender is gone).
pub async fn shutdown_signal(mut shutdown: watch::Receiver<bool>) {
    while !*shutdown.borrow() {
        if shutdown.changed().await.is_err() {
            return;
        }
    }
}

/// Rewrites tonic's answer to an undecodable request message (INTERNAL, "failed to decode
/// Protobuf message") as INVALID_ARGUMENT: a malformed protobuf is the caller's error, and the
/// agent answers every bad input alike. tonic sends it as a trailers-only response, so the
/// status is in the headers.
fn decode_errors_are_invalid_argument<B>(
    mut resp: axum::http::Response<B>,
) -> axum::http::Response<B> {
    let h = resp.headers_mut();
    let internal = h.get("grpc-status").is_some_and(|v| v == "13");
    // The message is percent-encoded (tonic encodes spaces as %20).
    let decode = h.get("grpc-message").is_some_and(|m| {
        let m = m.as_bytes();
        m.starts_with(b"failed%20to%20decode%20Protobuf%20message")
            || m.starts_with(b"failed to decode Protobuf message")
    });
    if internal && decode {
        h.insert("grpc-status", axum::http::HeaderValue::from_static("3"));
    }
    resp
}

/// The connections accepted on `listener`, with `TCP_NODELAY` set.
///
/// tonic applies its builder's `tcp_nodelay` only to listeners it binds itself and ignores it
/// for `serve_with_incoming`; without it, Nagle's algorithm may hold a small answer written
/// apart from the one before it (answers of several streams on one connection, as Envoy sends
/// them) until the client acknowledges that one. With h2load at one stream per connection the
/// difference was within this machine's noise (docs/benchmarks.md, "TCP_NODELAY").
pub fn no_delay(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// The HTTP connections accepted on `listener`, with `TCP_NODELAY` set (see [`no_delay`]).
pub fn http_no_delay(
    listener: TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on an HTTP connection");
        }
    })
}

/// Serves Envoy's RLS and the native Agent service on `listener` until `shutdown`.
///
/// # Errors
/// The transport error that stopped the server.
pub async fn serve_grpc(
    listener: TcpListener,
    decider: Arc<Decider>,
    shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(
            decode_errors_are_invalid_argument::<tonic::body::Body>,
        ))
        .add_service(RlsService::new(decider.clone()).into_server())
        .add_service(NativeService::new(decider).into_server())
        .serve_with_incoming_shutdown(no_delay(listener), shutdown_signal(shutdown))
        .await
}

/// Serves the HTTP API on `listener` until `shutdown`.
///
/// # Errors
/// The I/O error that stopped the server.
pub async fn serve_http(
    listener: TcpListener,
    decider: Arc<Decider>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    axum::serve(http_no_delay(listener), router(decider))
        .with_graceful_shutdown(shutdown_signal(shutdown))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn accepted_connections_have_tcp_nodelay() {
        use tokio_stream::StreamExt;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut grpc = no_delay(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = grpc.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap(), "gRPC");

        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut http = http_no_delay(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = axum::serve::Listener::accept(&mut http).await;
        assert!(accepted.nodelay().unwrap(), "HTTP");
    }

    #[test]
    fn the_lease_block_sets_settled_rates_and_defaults_it_on() {
        let path = std::path::Path::new("agent.yaml");
        let off = AgentFile::parse("lease:\n  settled_rates: false\n", path).expect("valid");
        assert!(!off.lease_settings("gw", "eu").settled_rates);
        let default = AgentFile::parse("lease:\n  rate_leases: false\n", path).expect("valid");
        assert!(default.lease_settings("gw", "eu").settled_rates);
        assert!(AgentFile::parse("lease:\n  settled_rate: false\n", path).is_err());
    }

    #[test]
    fn undecodable_requests_become_invalid_argument() {
        let resp = |status: &'static str, msg: &'static str| {
            let mut r = axum::http::Response::new(());
            r.headers_mut()
                .insert("grpc-status", axum::http::HeaderValue::from_static(status));
            r.headers_mut()
                .insert("grpc-message", axum::http::HeaderValue::from_static(msg));
            decode_errors_are_invalid_argument(r)
        };
        let r = resp(
            "13",
            "failed%20to%20decode%20Protobuf%20message:%20buffer%20underflow",
        );
        assert_eq!(r.headers()["grpc-status"], "3");
        let r = resp("13", "something%20else");
        assert_eq!(r.headers()["grpc-status"], "13");
        let r = resp("0", "failed%20to%20decode%20Protobuf%20message");
        assert_eq!(r.headers()["grpc-status"], "0");
    }

    #[test]
    fn settings_file_overrides_defaults_and_refuses_unknown_fields() {
        let f = AgentFile::parse(
            "agent_id: gw-7\nregion: eu\nallocators: [\"a:1\", \"b:2\"]\nlisten: {grpc: \"127.0.0.1:9\"}\npolicies: p\nlease: {cold_wait_ms: 50, emergency_ppm: 0}\ngateway: {slot_ttl_ms: 7}\n",
            Path::new("agent.yaml"),
        )
        .unwrap();
        assert_eq!(f.agent_id.as_deref(), Some("gw-7"));
        assert_eq!(f.allocators, vec!["a:1".to_string(), "b:2".to_string()]);
        assert_eq!(f.listen.grpc.as_deref(), Some("127.0.0.1:9"));
        let l = f.lease_settings("gw-7", "eu");
        assert_eq!(
            (l.cold_wait_ms, l.emergency_ppm, l.report_interval_ms),
            (50, 0, 1_000)
        );
        assert_eq!(f.tracking_settings().slot_ttl_ms, 7);
        let e = AgentFile::parse("agent_idd: x\n", Path::new("agent.yaml")).unwrap_err();
        assert!(e.to_string().contains("agent_idd"), "{e}");
        assert_eq!(
            AgentFile::parse("", Path::new("a")).unwrap(),
            AgentFile::default()
        );
    }

    #[test]
    fn relative_policy_paths_follow_the_settings_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.yaml");
        std::fs::write(&p, "policies: limits\n").unwrap();
        let f = AgentFile::load(&p).unwrap();
        assert_eq!(f.policies, Some(dir.path().join("limits")));
        let e = AgentFile::load(&dir.path().join("missing.yaml")).unwrap_err();
        assert!(matches!(e, AgentError::SettingsIo { .. }));
    }
}
