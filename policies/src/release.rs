//! The release package: may this resource go to this attested requester? Trustee's entry point
//! `data.policy.allow`, so CoCo operators' release policies run unchanged. Input: the
//! requester's attestation result (EAR claims) and the request (`resource-path`, `repository`,
//! `type`, `tag`, `query`, `lease`). Data, per request: `allow_sim` (whether the service trusts
//! simulator roots) and the request as Trustee gives it to its policies — `plugin`
//! (`"resource"`), `resource-path` (`[repo, type, tag]`) and `query`.

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

/// A release policy's data for one request: the service's (`allow_sim`) and the request's.
#[derive(Debug, Clone)]
pub struct ReleaseData(regorus::Value);

impl ReleaseData {
    /// `service`: the service's data (an object); `path`: `repo/type/tag`; `query`: the
    /// request's query parameters.
    pub fn new(
        service: &serde_json::Value,
        path: &str,
        query: &std::collections::HashMap<String, String>,
    ) -> Self {
        let mut data = service.clone();
        if let serde_json::Value::Object(m) = &mut data {
            m.insert("plugin".into(), "resource".into());
            m.insert(
                "resource-path".into(),
                path.split('/').map(serde_json::Value::from).collect(),
            );
            m.insert("query".into(), serde_json::json!(query));
        }
        ReleaseData(regorus::Value::from(data))
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
    pub fn allows(&self, input: &ReleaseInput, data: &ReleaseData) -> Result<bool, Error> {
        Ok(self.0.eval_with_data(input.0.clone(), data.0.clone())? == regorus::Value::Bool(true))
    }
}
