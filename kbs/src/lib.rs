//! cgx KBS: a key broker wire-compatible with the Confidential Containers KBS protocol (RCAR:
//! `auth` → `attest` → `resource`), releasing a resource only into a TEE whose evidence appraised
//! as affirming, that the resource's release policies allow, and — for job resources — that
//! holds a lease naming its key.
//!
//! The protocol itself (messages, steps, JWE, binding) is `cgx-protocol`'s; this crate holds
//! the service (feature `server`), a client carrying the protocol over ureq (feature `client`,
//! what the guest agent links) and simulated evidence in CoCo's shapes (feature `sim`).

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "sim")]
pub mod sim;

#[cfg(feature = "server")]
pub mod server;
