//! cgx's broker: the exchange. Nodes register on composite evidence (one CPU report binding a
//! broker nonce, the node's identity and every GPU's SPDM report), stay placeable only while
//! their result is affirming, fresh and their signed heartbeats arrive; tenants' jobs are placed
//! on the best fitting node with capacity reserved atomically in the database; a lease token
//! the KBS honours is issued for the very TEE key the node's evidence bound; a node that stops
//! proving itself has its leases ended and its jobs moved.
//!
//! Feature `server`: the service ([`server`]). Feature `client`: [`client`], what tenants,
//! operators, nodes, `cgx` and the tests speak it with.

#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "server")]
pub mod server;
