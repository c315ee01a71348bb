//! cgx's wire protocols as types and plain functions: no sockets, no files, no clock. A
//! transport (a ureq client, a load generator, a test) carries the bytes these build and read.
//!
//! - [`archive`]: the pieces a leaf names by digest (evidence, collateral, EARs).
//! - [`audit`]: the audit event both services record, and its canonical log leaf.
//! - [`kbs`]: the Confidential Containers KBS handshake (RCAR) with the messages of
//!   [`kbs_types`], CoCo's runtime-data binding and resource JWEs.
//! - [`jcs`]: canonical JSON (RFC 8785), for bindings and digests.
//! - [`binding`]: the values composite evidence binds (REPORT_DATA, each GPU's nonce).
//! - [`broker`]: node registration, heartbeats, jobs, nodes and leases.
//! - [`records`]: the typed bodies of every signed record (lease, node record, heartbeat,
//!   setting, admin and API tokens).
//! - [`signed`]: the envelope every signed record shares (a `typ` per kind, verified as one
//!   kind only).
//! - [`weights`]: the KBS resource that releases model weights: an age identity bound to the
//!   digest of the one encrypted file it may open.
//!
//! The guest agent links this crate; keep it small.

pub mod archive;
pub mod audit;
pub mod binding;
pub mod broker;
pub mod jcs;
pub mod kbs;
pub mod ledger;
pub mod merkle;
pub mod metering;
pub mod money;
pub mod records;
pub mod signed;
pub mod weights;

pub use kbs_types;
