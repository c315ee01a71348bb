//! The release package: may this resource go to this attested requester? Trustee's entry point
//! `data.policy.allow`, so CoCo operators' release policies run unchanged. Input: the
//! requester's attestation result (EAR claims) and the request (`resource-path`, `repository`,
//! `type`, `tag`, `query`, `lease`); data: `allow_sim` (whether the service trusts simulator
//! roots).

use crate::Error;
use crate::program::RegoProgram;

/// Trustee's release entry point.
pub(crate) const ENTRY_POINT: &str = "data.policy.allow";

/// A release policy's input, converted once and evaluated by every policy that applies.
#[derive(Debug, Clone)]
pub struct ReleaseInput(regorus::Value);

impl ReleaseInput {
    pub fn new(input: serde_json::Value) -> Self {
        ReleaseInput(regorus::Value::from(input))
    }
}

/// One compiled release policy.
#[derive(Debug)]
pub struct ReleasePolicy(RegoProgram);

impl ReleasePolicy {
    /// Compile `rego` with `data` (placed at `data`).
    pub fn compile(rego: &str, data: serde_json::Value) -> Result<Self, Error> {
        RegoProgram::compile("release.rego", rego, data, ENTRY_POINT).map(ReleasePolicy)
    }

    /// `true` only when the policy's `allow` is exactly `true` (undefined denies).
    pub fn allows(&self, input: &ReleaseInput) -> Result<bool, Error> {
        Ok(self.0.eval(input.0.clone())? == regorus::Value::Bool(true))
    }
}
