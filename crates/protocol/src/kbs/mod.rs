//! The KBS protocol as CoCo's clients speak it.

pub mod binding;
pub mod der;
pub mod jwe;
pub mod rcar;
