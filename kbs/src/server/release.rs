//! The release decision after an affirming appraisal: every release policy that applies to the
//! resource (global, its repository's, its own) must allow, and a job resource needs a lease.
//! With tenant isolation (the default) the resource's own tenant must also name the requester:
//! a lease for it, or an allowing policy on its repository or on it — the global policy speaks
//! for every tenant, so it names nobody.
//!
//! Policies are Rego with Trustee's entry point `data.policy.allow`, compiled once per distinct
//! text to a regorus RVM program. Scopes as stored: `resource:*`, `resource:<repo>`,
//! `resource:<repo>/<type>/<tag>`.
//!
//! A lease is an EdDSA JWT from a configured broker key: `{"lease", "resources": [paths],
//! "node_key": <RFC 7638 thumbprint of the TEE key>, "aud": "cgx-kbs", "iat", "exp"}`, living at
//! most `lease_max_ttl_secs`. It must name this resource and the very TEE key the session
//! attested. Broker keys and admin keys are distinct (refused at start otherwise).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cgx_attestation::results::Ear;
use cgx_policies::release::{ReleaseData, ReleaseInput, ReleasePolicy, ReleaseRequest};
use cgx_protocol::kbs_types::TeePubKey;
use serde_json::Value;

use super::error::KbsError;
use cgx_service::jwt;

fn invalid(e: cgx_policies::Error) -> KbsError {
    KbsError::PolicyInvalid(e.to_string())
}

/// Compiled release policies by text, and the shipped default for the global scope.
pub(crate) struct ReleasePolicies {
    default_global: Arc<ReleasePolicy>,
    tenant_isolation: bool,
    data: Value,
    /// `data`, converted once for every request's.
    request_data: ReleaseData,
    cache: Mutex<HashMap<String, Arc<ReleasePolicy>>>,
}

impl std::fmt::Debug for ReleasePolicies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReleasePolicies").finish_non_exhaustive()
    }
}

/// The three scopes that apply to a resource, most general first.
pub fn scopes(path: &str, repository: &str) -> [String; 3] {
    [
        GLOBAL_SCOPE.to_string(),
        format!("resource:{repository}"),
        format!("resource:{path}"),
    ]
}

impl ReleasePolicies {
    /// `allow_sim`: the KBS trusts simulator roots (exposed to policies as `data.allow_sim`).
    /// `tenant_isolation`: see [`super::config::KbsConfig::tenant_isolation`].
    pub fn new(allow_sim: bool, tenant_isolation: bool) -> Result<Self, KbsError> {
        let data = serde_json::json!({"allow_sim": allow_sim});
        Ok(ReleasePolicies {
            default_global: Arc::new(
                ReleasePolicy::compile(cgx_policies::RELEASE_POLICY, data.clone())
                    .map_err(invalid)?,
            ),
            tenant_isolation,
            request_data: ReleaseData::service(&data).map_err(invalid)?,
            data,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Compile (or find) the program for `rego`. Also how the admin API validates a policy
    /// before storing it.
    pub fn program(&self, rego: &str) -> Result<Arc<ReleasePolicy>, KbsError> {
        if let Some(p) = self.cache.lock().ok().and_then(|c| c.get(rego).cloned()) {
            return Ok(p);
        }
        let p = Arc::new(ReleasePolicy::compile(rego, self.data.clone()).map_err(invalid)?);
        if let Ok(mut c) = self.cache.lock() {
            if c.len() > 1024 {
                c.clear();
            }
            c.insert(rego.to_string(), p.clone());
        }
        Ok(p)
    }

    /// Every applicable policy must allow. `stored`: (scope, text) rows for the three scopes;
    /// the global scope falls back to the shipped default.
    pub fn check(
        &self,
        ear: &Ear,
        request: &ReleaseRequest<'_>,
        stored: &[(String, String)],
    ) -> Result<(), KbsError> {
        let internal = |e: cgx_policies::Error| KbsError::Internal(e.to_string());
        let path = request.path;
        let has_global = stored.iter().any(|(s, _)| s == GLOBAL_SCOPE);
        let mut ordered: Vec<&(String, String)> = stored.iter().collect();
        ordered.sort_by_key(|(s, _)| s.len());
        // Each policy as compiled, or the error it fails with: an error is answered only at
        // its policy's turn, so a requester an earlier policy denies learns nothing of a later
        // one (regorus's compile errors quote the policy's text).
        let mut applicable = Vec::with_capacity(ordered.len() + 1);
        if !has_global {
            applicable.push((None, Ok(self.default_global.clone())));
        }
        for (scope, text) in ordered {
            applicable.push((Some(scope), self.program(text)));
        }
        // The input (the whole EAR) and the request's data are built only where a policy can
        // read them: Trustee's `--allow-all` reads `data.plugin` alone, and a constant policy
        // (answered from its fold) nothing.
        let compiled = || applicable.iter().filter_map(|(_, p)| p.as_ref().ok());
        let input = if compiled().any(|p| p.reads_input()) {
            ReleaseInput::new(ear, request).map_err(internal)?
        } else {
            ReleaseInput::unread()
        };
        let data = if compiled().any(|p| p.reads_data()) {
            self.request_data
                .for_request(path, request.query)
                .map_err(internal)?
        } else {
            ReleaseData::unread()
        };
        for (scope, policy) in applicable {
            let allowed = policy?.allows(&input, &data).map_err(invalid)?;
            if !allowed {
                return Err(KbsError::PolicyDeny(match scope {
                    None => format!(
                        "{path}: the default release policy \
                         (every part affirming, no simulated evidence)"
                    ),
                    Some(scope) => format!("{path}: policy {scope}"),
                }));
            }
        }
        // Every stored policy allowed: one of the tenant's own, or a lease, names the requester.
        let tenant_named =
            request.lease.is_some() || stored.iter().any(|(scope, _)| scope != GLOBAL_SCOPE);
        if self.tenant_isolation && !tenant_named {
            return Err(KbsError::PolicyDeny(format!(
                "{path}: tenant {repository} names no requester for it (tenant isolation): \
                 release needs a lease, or a release policy on {repository} or on {path}",
                repository = request.repository
            )));
        }
        Ok(())
    }
}

/// The release-policy scope that applies to every resource (an unscoped administrator's).
pub const GLOBAL_SCOPE: &str = "resource:*";

/// The audience a lease names: leases are made for this KBS's release, nothing else.
pub const LEASE_AUDIENCE: &str = cgx_protocol::broker::LEASE_AUDIENCE;

/// Verify a lease token for `path` and the session's TEE key at `now` (lifetime at most
/// `max_ttl` seconds, audience [`LEASE_AUDIENCE`]); returns its claims.
pub fn check_lease(
    token: &str,
    broker_keys: &[[u8; 32]],
    path: &str,
    tee: &TeePubKey,
    now: i64,
    max_ttl: i64,
) -> Result<Value, KbsError> {
    if broker_keys.is_empty() {
        return Err(KbsError::LeaseInvalid(
            "no broker keys are configured, so no lease can be honoured".into(),
        ));
    }
    let (_, claims) = jwt::verify_eddsa(token, broker_keys, now, max_ttl)
        .map_err(|e| KbsError::LeaseInvalid(e.to_string()))?;
    let audience = match claims.get("aud") {
        Some(Value::String(a)) => a == LEASE_AUDIENCE,
        Some(Value::Array(a)) => a.iter().any(|v| v.as_str() == Some(LEASE_AUDIENCE)),
        _ => false,
    };
    if !audience {
        return Err(KbsError::LeaseInvalid(format!(
            "the token's audience is not {LEASE_AUDIENCE}"
        )));
    }
    let lease = claims
        .get("lease")
        .and_then(Value::as_str)
        .ok_or_else(|| KbsError::LeaseInvalid("no lease id".into()))?;
    let names_path = claims
        .get("resources")
        .and_then(Value::as_array)
        .is_some_and(|r| r.iter().any(|p| p.as_str() == Some(path)));
    if !names_path {
        return Err(KbsError::LeaseInvalid(format!(
            "lease {lease} does not cover {path}"
        )));
    }
    // A broker's lease names the tenant it was made for: it covers that tenant's resources only
    // (the broker checks it too; this holds a broker bug or a forged job to it).
    if let Some(tenant) = claims.get("tenant") {
        let repository = path.split('/').next().unwrap_or("");
        if tenant.as_str() != Some(repository) {
            return Err(KbsError::LeaseInvalid(format!(
                "lease {lease} is tenant {tenant}'s, {path} is not"
            )));
        }
    }
    let node_key = claims.get("node_key").and_then(Value::as_str).unwrap_or("");
    let attested = cgx_protocol::kbs::jwe::thumbprint(tee);
    if node_key != attested {
        return Err(KbsError::LeaseInvalid(format!(
            "lease {lease} is for node key {node_key}, this session attested {attested}"
        )));
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::collections::HashMap;

    use super::*;

    fn ear() -> Ear {
        serde_json::from_value(serde_json::json!({
            "eat_profile": "tag:ietf.org,2026:rats/ear#04",
            "iat": 1_790_000_000,
            "ear_verifier_id": {"developer": "cgx", "build": "test"},
            "ear_status": "affirming",
            "submods": {"cpu0": {"ear_status": "affirming"}}
        }))
        .unwrap()
    }

    fn check(stored: &[(&str, &str)]) -> Result<(), KbsError> {
        let policies = ReleasePolicies::new(false, false).unwrap();
        let query = HashMap::new();
        let request = ReleaseRequest {
            path: "a/key/x",
            repository: "a",
            kind: "key",
            tag: "x",
            query: &query,
            lease: None,
        };
        let stored: Vec<(String, String)> = stored
            .iter()
            .map(|(s, t)| (s.to_string(), t.to_string()))
            .collect();
        policies.check(&ear(), &request, &stored)
    }

    /// A policy that no longer compiles (stored by older code) answers only at its turn: a
    /// requester an earlier policy denies learns nothing of its text.
    #[test]
    fn a_broken_policy_speaks_only_at_its_turn() {
        let deny = "package policy\ndefault allow := false\n";
        let allow = "package policy\ndefault allow := true\n";
        let broken = "package policy\nallow if { input.x == \"secret-text\" \n";
        let e = check(&[("resource:a", deny), ("resource:a/key/x", broken)]).unwrap_err();
        assert!(
            matches!(&e, KbsError::PolicyDeny(d) if d == "a/key/x: policy resource:a"),
            "{e:?}"
        );
        let e = check(&[("resource:a", allow), ("resource:a/key/x", broken)]).unwrap_err();
        assert!(matches!(e, KbsError::PolicyInvalid(_)), "{e:?}");
        // No global policy stored: the shipped default decides, and this EAR passes it.
        check(&[("resource:a", allow)]).unwrap();
    }

    /// Trustee's `--allow-all` reads `data.plugin` only: it is given the request's data and
    /// no input, and decides as before; a policy that reads the input gets it.
    #[test]
    fn policies_get_what_they_read() {
        let allow_all = "package policy\ndefault allow = false\nplugin = data.plugin\nallow if plugin == \"resource\"\n";
        let by_path = "package policy\ndefault allow = false\n\
                       allow if data[\"resource-path\"][2] == \"x\"\n";
        let by_input = "package policy\ndefault allow = false\n\
                        allow if input.submods.cpu0[\"ear.status\"] == \"affirming\"\n";
        let by_tag = "package policy\ndefault allow = false\nallow if input.tag == \"y\"\n";
        check(&[("resource:*", allow_all)]).unwrap();
        check(&[("resource:*", allow_all), ("resource:a", by_path)]).unwrap();
        check(&[("resource:*", allow_all), ("resource:a", by_input)]).unwrap();
        let e = check(&[("resource:*", allow_all), ("resource:a", by_tag)]).unwrap_err();
        assert!(
            matches!(&e, KbsError::PolicyDeny(d) if d == "a/key/x: policy resource:a"),
            "{e:?}"
        );
    }
}
