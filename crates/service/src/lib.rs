//! The service layer every cgx server stands on (the KBS now, the broker next): only this crate
//! and the services' own `http` modules know HTTP.
//!
//! - [`server`]: bind, TLS or loopback-only plain HTTP, a connection cap, a timeout on the TLS
//!   handshake and the request head, background tasks, graceful drain, signals;
//! - [`limits`]: body limits per route before parsing and authentication, load shedding (503),
//!   caps on connections and requests in flight per client (429);
//! - [`clock`]: the injected clock (tests move time instead of sleeping);
//! - [`error`]: errors as RFC 9457 problem details with stable codes, no internals on the wire;
//! - [`metrics`]: Prometheus metrics with a layer keyed by matched route;
//! - [`ops`]: the OpenAPI document and metrics routes every service mounts;
//! - [`audit`]: the audit trail's table, writer and reader (both services');
//! - [`auth`] and [`jwt`]: the admin-auth extractor over EdDSA bearer tokens;
//! - [`config`]: TOML or JSON files plus environment overrides;
//! - [`db`]: the sqlx database (SQLite or PostgreSQL), locked versioned migrations, kept writer
//!   connections and group commit;
//! - [`tls`]: rustls server configuration and development certificates.

pub mod audit;
pub mod auth;
pub mod clock;
pub mod config;
pub mod db;
pub mod durable;
pub mod error;
pub mod jwt;
pub mod limits;
pub mod logwriter;
pub mod metrics;
pub mod ops;
pub mod server;
pub mod tlog;
pub mod tls;
pub mod witness;

pub use clock::SharedClock;
pub use server::{Background, ListenerConfig, Running};

/// Errors starting or configuring a service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServiceError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("listen {addr}: {detail}")]
    Bind { addr: String, detail: String },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("signals: {0}")]
    Signal(String),
}
