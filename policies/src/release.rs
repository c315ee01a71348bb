//! The release package: may this resource go to this attested requester? Trustee's entry point
//! `data.policy.allow`, so CoCo operators' release policies run unchanged. Input: the
//! requester's attestation result (EAR claims) and the request (`resource-path`, `repository`,
//! `type`, `tag`, `query`, `lease`). Data, per request: `allow_sim` (whether the service trusts
//! simulator roots) and the request as Trustee gives it to its policies — `plugin`
//! (`"resource"`), `resource-path` (`[repo, type, tag]`) and `query`.

use std::collections::{BTreeMap, HashMap};

use cgx_attestation::results::{Ear, TRUST_CLAIMS};
use regorus::Value;

use std::sync::Arc;

use crate::Error;
use crate::limits::{Limits, Trust};
use crate::program::RegoProgram;
use crate::rego_value::to_rego;
use crate::sandbox::{Pending, Sandbox};

/// Trustee's release entry point.
pub(crate) const ENTRY_POINT: &str = "data.policy.allow";

fn unconvertible(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Policy {
        detail: format!("release {what}: {e}"),
    }
}

/// What a request asks for, as release policies read it beside the EAR.
#[derive(Debug, Clone, Copy)]
pub struct ReleaseRequest<'a> {
    /// `repo/type/tag`.
    pub path: &'a str,
    pub repository: &'a str,
    pub kind: &'a str,
    pub tag: &'a str,
    /// The request's query parameters.
    pub query: &'a HashMap<String, String>,
    /// The claims of the lease the request carried, verified.
    pub lease: Option<&'a serde_json::Value>,
}

/// A release policy's input, built once per request and evaluated by every policy that
/// applies: the session's EAR (each part with Trustee's spellings too, [`trustee_spellings`])
/// and `resource-path`, `repository`, `type`, `tag`, `query` and `lease` (null without one).
#[derive(Debug, Clone)]
pub struct ReleaseInput(Value);

impl ReleaseInput {
    /// The input for policies that cannot read one ([`ReleasePolicy::reads_input`]).
    pub fn unread() -> Self {
        ReleaseInput(Value::Undefined)
    }

    pub fn new(ear: &Ear, request: &ReleaseRequest<'_>) -> Result<Self, Error> {
        let mut input = to_rego(ear).map_err(|e| unconvertible("input", e))?;
        trustee_spellings(&mut input);
        let fields = [
            ("resource-path", Value::from(request.path)),
            ("repository", Value::from(request.repository)),
            ("type", Value::from(request.kind)),
            ("tag", Value::from(request.tag)),
            (
                "query",
                to_rego(request.query).map_err(|e| unconvertible("query", e))?,
            ),
            (
                "lease",
                match request.lease {
                    Some(l) => to_rego(l).map_err(|e| unconvertible("lease", e))?,
                    None => Value::Null,
                },
            ),
        ];
        let object = input
            .as_object_mut()
            .map_err(|e| unconvertible("input", e))?;
        for (name, value) in fields {
            object.insert(Value::from(name), value);
        }
        Ok(ReleaseInput(input))
    }
}

/// Trustee's attestation service writes EAR claims with the `ear` crate's dotted names
/// (`ear.status`, `ear.trustworthiness-vector`, `ear.appraisal-policy-id`), and CoCo's release
/// policies read those (kbs-client's `--affirming` checks `submod["ear.status"]`). cgx's EAR
/// uses draft-ietf-rats-ear's JSON names; each part carries both, so a policy written for
/// either checks what it means to — a name it does not find would make its check silently pass.
fn trustee_spellings(input: &mut Value) {
    let Some(submods) = input
        .as_object_mut()
        .ok()
        .and_then(|o| o.get_mut(&Value::from("submods")))
        .and_then(|s| s.as_object_mut().ok())
    else {
        return;
    };
    let (status, vector, ids) = (
        Value::from("ear_status"),
        Value::from("ear_trustworthiness_vector"),
        Value::from("ear_appraisal_policy_ids"),
    );
    for (_, part) in submods.iter_mut() {
        let Ok(p) = part.as_object_mut() else {
            continue;
        };
        if let Some(s) = p.get(&status).cloned() {
            p.insert(Value::from("ear.status"), s);
        }
        // Trustee writes all eight claims, 0 for those not set.
        let set = p.get(&vector).and_then(|v| v.as_object().ok());
        let full: BTreeMap<Value, Value> = TRUST_CLAIMS
            .iter()
            .map(|c| {
                let name = Value::from(*c);
                let code = set
                    .and_then(|v| v.get(&name))
                    .cloned()
                    .unwrap_or_else(|| Value::from(0u64));
                (name, code)
            })
            .collect();
        p.insert(Value::from("ear.trustworthiness-vector"), Value::from(full));
        if let Some(id) = p
            .get(&ids)
            .and_then(|i| i.as_array().ok())
            .and_then(|i| i.first())
            .cloned()
        {
            p.insert(Value::from("ear.appraisal-policy-id"), id);
        }
    }
}

/// A release policy's data: the service's (`allow_sim`), converted once, and for each request
/// the request as Trustee gives it to its policies ([`ReleaseData::for_request`]).
#[derive(Debug, Clone)]
pub struct ReleaseData(Value);

impl ReleaseData {
    /// The data for policies that cannot read any ([`ReleasePolicy::reads_data`]).
    pub fn unread() -> Self {
        ReleaseData(Value::Undefined)
    }

    /// `service`: the service's data (an object).
    pub fn service(service: &serde_json::Value) -> Result<Self, Error> {
        to_rego(service)
            .map(ReleaseData)
            .map_err(|e| unconvertible("data", e))
    }

    /// The service's data with the request's: `plugin` (`"resource"`), `resource-path`
    /// (`[repo, type, tag]`) and `query`.
    pub fn for_request(&self, path: &str, query: &HashMap<String, String>) -> Result<Self, Error> {
        let mut data = self.0.clone();
        if let Ok(m) = data.as_object_mut() {
            m.insert(Value::from("plugin"), Value::from("resource"));
            m.insert(
                Value::from("resource-path"),
                Value::from(path.split('/').map(Value::from).collect::<Vec<_>>()),
            );
            m.insert(
                Value::from("query"),
                to_rego(query).map_err(|e| unconvertible("query", e))?,
            );
        }
        Ok(ReleaseData(data))
    }
}

/// One compiled release policy.
#[derive(Debug)]
pub struct ReleasePolicy {
    program: RegoProgram,
    trust: Trust,
}

impl ReleasePolicy {
    /// Compile the operator's `rego` with `data` (placed at `data`).
    pub fn compile(rego: &str, data: serde_json::Value) -> Result<Self, Error> {
        Self::compile_as(rego, data, Trust::Operator)
    }

    /// Compile `rego` written by `trust`: a repository administrator's policy is
    /// [`Trust::Untrusted`] (the builtin allow-list, the literal check, the allocation budget;
    /// see [`crate::limits`]), refused here, at upload, where it cannot be bounded.
    pub fn compile_as(rego: &str, data: serde_json::Value, trust: Trust) -> Result<Self, Error> {
        RegoProgram::compile_as("release.rego", rego, data, ENTRY_POINT, trust)
            .map(|program| ReleasePolicy { program, trust })
    }

    /// Who wrote it.
    pub fn trust(&self) -> Trust {
        self.trust
    }

    /// The limits each evaluation runs under.
    pub fn limits(&self) -> Limits {
        self.program.limits()
    }

    /// `true` only when the policy's `allow` is exactly `true` (undefined denies). Evaluated on
    /// the calling thread: for the operator's policies; an untrusted one is evaluated with
    /// [`ReleasePolicy::allows_off_thread`].
    pub fn allows(&self, input: &ReleaseInput, data: &ReleaseData) -> Result<bool, Error> {
        Ok(self
            .program
            .eval_with_data(input.0.clone(), data.0.clone())?
            == Value::Bool(true))
    }

    /// Whether it answers without evaluating (a closed program folded when compiled): then
    /// [`ReleasePolicy::allows`] costs nothing wherever it is called.
    pub fn is_constant(&self) -> bool {
        self.program.is_constant()
    }

    /// [`ReleasePolicy::allows`] on an evaluator thread of the process-wide sandbox; the
    /// answer comes within the policy's time limit from when a thread picks it up, or is
    /// [`Error::Limit`] (the policy's own fault, e.g. "policy exceeded its time limit": the
    /// resource's refusal, never the service's failure). [`Error::Busy`]: not evaluated now
    /// (no thread free within [`crate::sandbox::MAX_QUEUE_WAIT`]): answer "overloaded, retry".
    pub fn allows_off_thread(
        self: &Arc<Self>,
        input: &ReleaseInput,
        data: &ReleaseData,
    ) -> Pending<bool> {
        let (policy, input, data) = (self.clone(), input.clone(), data.clone());
        Sandbox::global().submit(self.limits().time, move || policy.allows(&input, &data))
    }

    /// The decision, where the policy reads nothing from outside itself (`default allow :=
    /// true`): folded when compiled, it is what [`ReleasePolicy::allows`] answers.
    #[cfg(test)]
    fn constant(&self) -> Option<bool> {
        self.program.constant().map(|v| *v == Value::Bool(true))
    }

    /// Whether the policy can read its input at all: Trustee's `--allow-all` (`allow if
    /// data.plugin == "resource"`) cannot, and is given [`ReleaseInput::unread`].
    pub fn reads_input(&self) -> bool {
        self.program.reads().input
    }

    /// Whether the policy can read its data at all; one that cannot is given
    /// [`ReleaseData::unread`].
    pub fn reads_data(&self) -> bool {
        self.program.reads().data
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// How the KBS built the input before [`ReleaseInput::new`]: the EAR through a
    /// `serde_json` tree, Trustee's spellings added there, then converted.
    fn through_json(ear: &Ear, r: &ReleaseRequest<'_>) -> Value {
        let mut input = serde_json::to_value(ear).unwrap();
        for part in input["submods"].as_object_mut().unwrap().values_mut() {
            let p = part.as_object_mut().unwrap();
            if let Some(status) = p.get("ear_status").cloned() {
                p.insert("ear.status".into(), status);
            }
            let vector = p.get("ear_trustworthiness_vector");
            let full: serde_json::Map<String, serde_json::Value> = TRUST_CLAIMS
                .iter()
                .map(|c| {
                    let code = vector.and_then(|v| v.get(c)).cloned().unwrap_or(json!(0));
                    (c.to_string(), code)
                })
                .collect();
            p.insert("ear.trustworthiness-vector".into(), full.into());
            if let Some(id) = p
                .get("ear_appraisal_policy_ids")
                .and_then(|ids| ids.get(0))
                .cloned()
            {
                p.insert("ear.appraisal-policy-id".into(), id);
            }
        }
        input["resource-path"] = json!(r.path);
        input["repository"] = json!(r.repository);
        input["type"] = json!(r.kind);
        input["tag"] = json!(r.tag);
        input["query"] = json!(r.query);
        input["lease"] = r.lease.cloned().unwrap_or(serde_json::Value::Null);
        Value::from(input)
    }

    fn ear() -> Ear {
        serde_json::from_value(json!({
            "eat_profile": "tag:ietf.org,2026:rats/ear#04",
            "iat": 1_790_000_000,
            "ear_verifier_id": {"developer": "cgx", "build": "test"},
            "ear_status": "affirming",
            "submods": {
                "cpu0": {
                    "ear_status": "affirming",
                    "ear_trustworthiness_vector": {"instance-identity": 2, "executables": 2},
                    "ear_appraisal_policy_ids": ["policy:cgx-default", "policy:second"],
                    "ear_verifier_claims": {"cgx.kind": "sample", "sample": {"svn": 1}}
                },
                "gpu0": {"ear_status": "warning"}
            }
        }))
        .unwrap()
    }

    #[test]
    fn the_input_is_the_one_the_json_tree_made() {
        let ear = ear();
        let query: HashMap<String, String> = [("lease".to_string(), "t".to_string())].into();
        let lease = json!({"lease": "l-1", "resources": ["a/key/x"], "exp": 5});
        for lease in [None, Some(&lease)] {
            let r = ReleaseRequest {
                path: "a/key/x",
                repository: "a",
                kind: "key",
                tag: "x",
                query: &query,
                lease,
            };
            let input = ReleaseInput::new(&ear, &r).unwrap();
            assert_eq!(input.0, through_json(&ear, &r));
            // What Trustee's policies read is there.
            let cpu = &input.0["submods"]["cpu0"];
            assert_eq!(cpu["ear.status"], Value::from("affirming"));
            assert_eq!(
                cpu["ear.trustworthiness-vector"]["hardware"],
                Value::from(0u64)
            );
            assert_eq!(
                cpu["ear.trustworthiness-vector"]["executables"],
                Value::from(2u64)
            );
            assert_eq!(
                cpu["ear.appraisal-policy-id"],
                Value::from("policy:cgx-default")
            );
        }
    }

    #[test]
    fn request_data_is_the_service_data_and_the_request() {
        let service = ReleaseData::service(&json!({"allow_sim": false})).unwrap();
        let query: HashMap<String, String> = [("k".to_string(), "v".to_string())].into();
        let data = service.for_request("a/key/x", &query).unwrap();
        let expected = Value::from(json!({
            "allow_sim": false,
            "plugin": "resource",
            "resource-path": ["a", "key", "x"],
            "query": {"k": "v"}
        }));
        assert_eq!(data.0, expected);
        // The service's own stays as it was for the next request.
        assert_eq!(service.0, Value::from(json!({"allow_sim": false})));
    }

    /// Trustee's stock release policies, as its kbs-client installs them, and what each can
    /// read: the KBS builds the EAR input only for those that read it, and gives the others
    /// [`ReleaseInput::unread`] with the same decision.
    #[test]
    fn what_trustees_policies_read_decides_what_is_built() {
        let allow_all = "package policy\ndefault allow = false\nplugin = data.plugin\nallow if {\n\tplugin == \"resource\"\n}\n";
        let affirming = "package policy\nimport rego.v1\ndefault allow = false\n\
            allow if {\n    not any_not_affirming\n    count(input.submods) > 0\n}\n\
            any_not_affirming if {\n    some _, submod in input.submods\n    \
            submod[\"ear.status\"] != \"affirming\"\n}\n";
        let deny_all = "package policy\ndefault allow = false\n";
        let mut ear = ear();
        ear.submods.retain(|name, _| name == "cpu0");
        let query = HashMap::new();
        let r = ReleaseRequest {
            path: "a/key/x",
            repository: "a",
            kind: "key",
            tag: "x",
            query: &query,
            lease: None,
        };
        let input = ReleaseInput::new(&ear, &r).unwrap();
        let data = ReleaseData::service(&json!({"allow_sim": false}))
            .unwrap()
            .for_request(r.path, &query)
            .unwrap();
        let compile = |rego| ReleasePolicy::compile(rego, json!({"allow_sim": false})).unwrap();

        let p = compile(allow_all);
        assert!(!p.reads_input());
        assert_eq!(p.constant(), None);
        assert!(p.allows(&ReleaseInput::unread(), &data).unwrap());
        assert!(p.allows(&input, &data).unwrap());
        // It still reads the data: another plugin's request is denied.
        let mut other = data.clone();
        other
            .0
            .as_object_mut()
            .unwrap()
            .insert(Value::from("plugin"), Value::from("x"));
        assert!(!p.allows(&ReleaseInput::unread(), &other).unwrap());

        let p = compile(affirming);
        assert!(p.reads_input());
        assert!(p.allows(&input, &data).unwrap());
        assert!(!p.allows(&ReleaseInput::unread(), &data).unwrap());

        let p = compile(deny_all);
        assert_eq!(p.constant(), Some(false));
        assert!(!p.allows(&input, &data).unwrap());
    }
}
