//! cgx KBS: a key broker wire-compatible with the Confidential Containers KBS protocol (RCAR:
//! `auth` → `attest` → `resource`), releasing a resource only into a TEE whose evidence appraised
//! as affirming, that the resource's release policies allow, and — for job resources — that
//! holds a lease naming its key.
//!
//! Without the `server` feature this crate is what the guest needs: the protocol messages
//! ([`kbs_types`]), the binding CoCo uses ([`binding`]), JWE ([`jwe`]) and canonical JSON
//! ([`jcs`]). The age file format of the weights is its own crate, `cgx-age`.

pub mod binding;
pub mod der;
pub mod jcs;
pub mod jwe;

pub use kbs_types;

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "sim")]
pub mod sim;

#[cfg(feature = "server")]
pub mod server;
