//! The host–guest channel. A confidential VM booted from the cgx image has no network address:
//! its guest agent reaches the broker and the KBS through one virtio-serial port to the host
//! agent, which connects on its behalf. Many TCP streams cross that one port, multiplexed:
//!
//! - [`frame`]: the wire format, sans-IO — frames, their limits, a decoder that refuses what
//!   breaks them. Both ends parse what the other sends; neither trusts the other.
//! - [`mux`]: the streams over a port (threads and `std::io`): the guest *opens* streams to
//!   targets by name (`broker`, `kbs`, a provisioned file), the host *serves* them from a fixed
//!   table it was configured with, so a guest can never make its host connect anywhere else.
//!
//! What crosses is what the guest would otherwise have sent over a network: TLS to the broker
//! and the KBS runs end to end through the channel (the host sees ciphertext), and the leases
//! and resources the guest acts on are signed or encrypted to its TEE key. The host is
//! untrusted for confidentiality and integrity; it can only deny service, as a network could.

pub mod frame;
pub mod mux;

pub use frame::{Decoder, Frame, FrameError, Kind};
pub use mux::{Mux, Sink};
