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
//! Who wrote a policy decides how it runs. The global scope is the operator's (only an unscoped
//! administrator sets it): trusted, evaluated inline under instruction and time limits — the
//! release path's speed. A repository's or a resource's policy is a repository administrator's:
//! untrusted ([`Trust::Untrusted`]: the builtin allow-list and literal check at upload, an
//! allocation budget), evaluated on the policy evaluator threads with a deadline, never on a
//! serving thread. A policy that reaches a limit is that resource's refusal naming the limit
//! (`PolicyDeny`), and a stored policy the allow-list now refuses answers `PolicyInvalid` at its
//! turn, never at startup.
//!
//! A lease is a signed record of kind [`cgx_protocol::records::Lease`] (`typ`
//! `cgx-lease+jwt`, its audience the KBS) under a configured broker key: it names the tenant,
//! the resources (paths in that tenant's repository) and `node_key` (RFC 7638 thumbprint of
//! the TEE key), and lives at most `lease_max_ttl_secs`. It must name this resource and the
//! very TEE key the session attested. Broker keys and admin keys are distinct (refused at
//! start otherwise).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cgx_attestation::results::Ear;
use cgx_policies::limits::Trust;
use cgx_policies::release::{ReleaseData, ReleaseInput, ReleasePolicy, ReleaseRequest};
use cgx_protocol::kbs_types::TeePubKey;
use cgx_protocol::records::Lease;
use cgx_protocol::signed::{self, Verified, When};
use serde_json::Value;

use cgx_attestation::results::Tier;
use serde_json::json;

use super::error::KbsError;
use super::http::resource_path;
use super::{Kbs, LiveSession};

/// A compiled policy's cache key: who wrote it, and the SHA-256 of its text.
type PolicyKey = (Trust, [u8; 32]);

/// How long a repository's release policy may take to compile.
const POLICY_COMPILE_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// The largest release policy a repository administrator may store (the operator's global
/// policy is bounded by the request body only): as a tenant's placement policy.
pub const MAX_TENANT_POLICY: usize = 64 << 10;

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
    /// By (trust, SHA-256 of the text): the key costs 32 bytes whatever the text's size.
    cache: Mutex<HashMap<PolicyKey, Arc<ReleasePolicy>>>,
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

    /// Compile (or find) the program for `rego` stored at `scope`: the operator's at the global
    /// scope, untrusted anywhere else ([`trust_of`]). Also how the admin API validates a policy
    /// before storing it.
    ///
    /// On the calling thread: the admin API and the release path call
    /// [`ReleasePolicies::program_off_thread`], which compiles a tenant's text on a blocking
    /// thread (a serving thread never spends a compile on it).
    pub fn program(&self, scope: &str, rego: &str) -> Result<Arc<ReleasePolicy>, KbsError> {
        let (trust, key) = self.key(scope, rego)?;
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        let p =
            Arc::new(ReleasePolicy::compile_as(rego, self.data.clone(), trust).map_err(invalid)?);
        self.remember(key, p.clone());
        Ok(p)
    }

    /// [`ReleasePolicies::program`], compiling an untrusted text (a cache miss) on the policy
    /// sandbox's threads: compiling is a tenant's cost (tens of ms for 64 KiB), and the KBS's
    /// serving threads each run a single-threaded runtime.
    pub async fn program_off_thread(
        &self,
        scope: &str,
        rego: &str,
    ) -> Result<Arc<ReleasePolicy>, KbsError> {
        let (trust, key) = self.key(scope, rego)?;
        if let Some(p) = self.cached(&key) {
            return Ok(p);
        }
        if trust == Trust::Operator {
            return self.program(scope, rego);
        }
        let (text, data) = (rego.to_string(), self.data.clone());
        // On the policy sandbox's threads: their deep stacks take a chain of rules (a closed
        // program is folded, that is evaluated, while compiling), and a compile is bounded in
        // time like an evaluation.
        let p = cgx_policies::sandbox::Sandbox::global()
            .submit(POLICY_COMPILE_TIME, move || {
                ReleasePolicy::compile_as(&text, data, trust)
            })
            .await
            .map_err(|e| match e {
                cgx_policies::Error::Busy => KbsError::Overloaded {
                    retry_after: 1,
                    detail: "the release policy evaluators are busy".into(),
                },
                e => invalid(e),
            })?;
        let p = Arc::new(p);
        self.remember(key, p.clone());
        Ok(p)
    }

    /// The cache key of `rego` at `scope`, after the size limit a tenant's text has.
    fn key(&self, scope: &str, rego: &str) -> Result<(Trust, PolicyKey), KbsError> {
        let trust = trust_of(scope, rego);
        if trust != Trust::Operator && rego.len() > MAX_TENANT_POLICY {
            return Err(KbsError::PolicyInvalid(format!(
                "a repository's or resource's release policy is at most {} KiB",
                MAX_TENANT_POLICY >> 10
            )));
        }
        let mut digest = [0u8; 32];
        digest.copy_from_slice(
            aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, rego.as_bytes()).as_ref(),
        );
        Ok((trust, (trust, digest)))
    }

    fn cached(&self, key: &PolicyKey) -> Option<Arc<ReleasePolicy>> {
        self.cache.lock().ok().and_then(|c| c.get(key).cloned())
    }

    fn remember(&self, key: PolicyKey, p: Arc<ReleasePolicy>) {
        if let Ok(mut c) = self.cache.lock() {
            if c.len() > 1024 {
                c.clear();
            }
            c.insert(key, p);
        }
    }

    /// Every applicable policy must allow. `stored`: (scope, text) rows for the three scopes;
    /// the global scope falls back to the shipped default. Untrusted policies are awaited from
    /// the evaluator threads; a limit reached is the resource's refusal naming it.
    pub async fn check(
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
            applicable.push((Some(scope), self.program_off_thread(scope, text).await));
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
            let policy = policy?;
            // The operator's run here (the release path's speed); a repository administrator's
            // on the evaluator threads, unless its answer is folded (it then runs nothing).
            let allowed = if policy.trust() == Trust::Untrusted && !policy.is_constant() {
                policy.allows_off_thread(&input, &data).await
            } else {
                policy.allows(&input, &data)
            };
            let allowed = allowed.map_err(|e| match e {
                cgx_policies::Error::Limit(limit) => KbsError::PolicyDeny(format!(
                    "{path}: policy {}: {limit}",
                    scope.map_or(GLOBAL_SCOPE, String::as_str)
                )),
                cgx_policies::Error::Busy => KbsError::Overloaded {
                    retry_after: 1,
                    detail: "the release policy evaluators are busy".into(),
                },
                e => invalid(e),
            })?;
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

/// Who wrote a policy stored at `scope`: only an unscoped administrator sets the global scope;
/// a repository's and a resource's are a repository administrator's — unless its text is the
/// shipped default ([`cgx_policies::RELEASE_POLICY`], what `cgx-devnet` installs per resource):
/// that program is the operator's whoever stores it, and runs as the global default does.
pub fn trust_of(scope: &str, rego: &str) -> Trust {
    if scope == GLOBAL_SCOPE || rego == cgx_policies::RELEASE_POLICY {
        Trust::Operator
    } else {
        Trust::Untrusted
    }
}

/// The audience a lease names: leases are made for this KBS's release, nothing else.
pub const LEASE_AUDIENCE: &str = cgx_protocol::broker::LEASE_AUDIENCE;

/// Verify a lease token for `path` and the session's TEE key at `now`: a
/// [`cgx_protocol::records::Lease`] record signed by a configured broker, living at most
/// `max_ttl` seconds, naming this resource, the tenant whose repository it is, and the TEE key
/// the session attested.
pub fn check_lease(
    token: &str,
    broker_keys: &[[u8; 32]],
    path: &str,
    tee: &TeePubKey,
    now: i64,
    max_ttl: i64,
) -> Result<Verified<Lease>, KbsError> {
    if broker_keys.is_empty() {
        return Err(KbsError::LeaseInvalid(
            "no broker keys are configured, so no lease can be honoured".into(),
        ));
    }
    let verified = signed::verify::<Lease>(
        token,
        broker_keys,
        When::At {
            now,
            max_lifetime: max_ttl,
        },
    )
    .map_err(|e| KbsError::LeaseInvalid(e.to_string()))?;
    let l = &verified.body;
    let lease = &l.lease;
    if !l.resources.iter().any(|p| p == path) {
        return Err(KbsError::LeaseInvalid(format!(
            "lease {lease} does not cover {path}"
        )));
    }
    // A broker's lease names the tenant it was made for: it covers that tenant's resources only
    // (the broker checks it too; this holds a broker bug or a forged job to it).
    let repository = path.split('/').next().unwrap_or("");
    if l.tenant != repository {
        return Err(KbsError::LeaseInvalid(format!(
            "lease {lease} is tenant {}'s, {path} is not",
            l.tenant
        )));
    }
    let attested = cgx_protocol::kbs::jwe::thumbprint(tee);
    if l.node_key != attested {
        return Err(KbsError::LeaseInvalid(format!(
            "lease {lease} is for node key {}, this session attested {attested}",
            l.node_key
        )));
    }
    Ok(verified)
}

/// A verified lease as release policies read it (`input.lease`): its claims, the envelope's
/// `aud`, `iat` and `exp` with the body's.
pub fn lease_input(lease: &Verified<Lease>) -> Value {
    let mut v = serde_json::to_value(&lease.body).unwrap_or(Value::Null);
    if let Some(m) = v.as_object_mut() {
        m.insert("aud".into(), LEASE_AUDIENCE.into());
        m.insert("iat".into(), lease.iat.into());
        m.insert("exp".into(), lease.exp.into());
    }
    v
}

/// Who asks for a resource (read by the handler from the request). Both are bearer
/// credentials: `Debug` names the kind only.
pub(crate) enum Credential {
    /// The RCAR session cookie's value.
    Session(String),
    /// A bearer EAR this KBS (or a replica sharing its result key) issued.
    Ear(String),
    None,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Credential::Session(_) => "Credential::Session(..)",
            Credential::Ear(_) => "Credential::Ear(..)",
            Credential::None => "Credential::None",
        })
    }
}

impl Kbs {
    /// The attested session of the requester: its session cookie, or a bearer EAR this KBS issued.
    async fn requester(&self, who: &Credential) -> Result<Arc<LiveSession>, KbsError> {
        let kbs = self;
        if let Credential::Session(id) = who {
            kbs.session_keys
                .authentic(id)
                .map_err(|e| KbsError::UnAuthenticated(e.into()))?;
            return kbs
                .attested_session(id)
                .await?
                .filter(|s| s.expires_at > kbs.clock.unix())
                .ok_or_else(|| {
                    KbsError::UnAuthenticated(
                        "no attested, unexpired session for this cookie".into(),
                    )
                });
        }
        if let Credential::Ear(token) = who {
            return kbs.verified_ear(token).map(Arc::new);
        }
        Err(KbsError::UnAuthenticated(
            "no session cookie and no bearer token".into(),
        ))
    }

    /// Release `repo/kind/tag` to `who`: an attested, affirming session (every part), the lease
    /// when one is given (or the resource needs one), every release policy that applies, one
    /// tenant per TEE key; the resource encrypted to the session's TEE key (a JWE), audited.
    pub(crate) async fn release(
        &self,
        who: &Credential,
        repo: &str,
        kind: &str,
        tag: &str,
        query: &HashMap<String, String>,
    ) -> Result<Value, KbsError> {
        let path = resource_path(repo, kind, tag)?;
        // Authentication first: an unauthenticated caller learns nothing about what exists,
        // and leaves no trace in the log.
        let session = self.requester(who).await?;
        let out = self
            .release_to(&session, &path, repo, kind, tag, query)
            .await;
        if let Err(e) = &out
            && !matches!(e, KbsError::Storage(_) | KbsError::Internal(_))
        {
            // An attested session refused: a leaf of the KBS's log (issue 33), durable before
            // the refusal is answered. Bounded by the session's own rate limits.
            let lease = query.get("lease").map(|t| {
                hex::encode(aws_lc_rs::digest::digest(
                    &aws_lc_rs::digest::SHA256,
                    t.as_bytes(),
                ))
            });
            // The lease the token names, where a configured broker signed it (expired or
            // not): the broker's record of its lease's refusals reads it. An unsigned claim
            // is not recorded (anyone could name any lease).
            let lease_id = query.get("lease").and_then(|t| {
                signed::verify::<Lease>(t, &self.broker_keys, When::Any)
                    .ok()
                    .map(|v| v.body.lease)
            });
            self.store
                .audit(
                    "tee",
                    "release.refused",
                    &path,
                    &json!({
                        "tee_key": cgx_protocol::kbs::jwe::thumbprint(&session.tee_pubkey),
                        "lease_token_sha256": lease,
                        "lease": lease_id,
                        "reason": cgx_service::audit::cap(&e.to_string(), 1024),
                    }),
                )
                .await?;
        }
        out
    }

    /// [`Self::release`] once the session is known.
    async fn release_to(
        &self,
        session: &super::LiveSession,
        path: &str,
        repo: &str,
        kind: &str,
        tag: &str,
        query: &HashMap<String, String>,
    ) -> Result<Value, KbsError> {
        let kbs = self;
        let path = path.to_string();
        let key = &session.tee_pubkey;
        // Every part must be affirming: a part the policy left at `none` is not a pass, whatever
        // release policy an administrator installs.
        let status = session.ear.tier();
        if status != Tier::Affirming {
            return Err(KbsError::PolicyDeny(format!(
                "{path}: the session's appraisal is {}, not affirming",
                status.as_str()
            )));
        }
        if let Some((part, a)) = session
            .ear
            .submods
            .iter()
            .find(|(_, a)| a.status != Tier::Affirming)
        {
            return Err(KbsError::PolicyDeny(format!(
                "{path}: part {part} of the session's appraisal is {}, not affirming",
                a.status.as_str()
            )));
        }
        // Sample evidence is released only by a KBS that takes it: a session another replica (or a
        // development KBS sharing the result key) appraised from it is not this one's to honour.
        if !kbs.allow_sample
            && let Some((part, _)) = session.ear.submods.iter().find(|(_, a)| {
                matches!(
                    a.verifier_claims.get("cgx.kind").and_then(Value::as_str),
                    Some("sample" | "sampledevice")
                )
            })
        {
            return Err(KbsError::PolicyDeny(format!(
                "{path}: part {part} is sample evidence, which this KBS does not take"
            )));
        }
        let lease = match query.get("lease") {
            Some(token) => Some(check_lease(
                token,
                &kbs.broker_keys,
                &path,
                key,
                kbs.clock.unix(),
                kbs.lease_max_ttl,
            )?),
            None => None,
        };
        let lease_claims = lease.as_ref().map(lease_input);
        let stored = kbs.release_policies(&path, repo).await?;
        // Policies, tenant isolation included, before the lookup: a denied requester learns
        // nothing about what exists. They read the EAR as Trustee's do (`input.submods.cpu0…`),
        // plus the request.
        let request = ReleaseRequest {
            path: &path,
            repository: repo,
            kind,
            tag,
            query,
            lease: lease_claims.as_ref(),
        };
        kbs.release.check(&session.ear, &request, &stored).await?;
        let resource = kbs
            .store
            .resource(&path)
            .await?
            .ok_or_else(|| KbsError::ResourceNotFound(path.clone()))?;
        if resource.requires_lease && lease.is_none() {
            return Err(KbsError::LeaseInvalid(format!(
                "{path} is a job resource and needs a lease token (query parameter lease)"
            )));
        }
        // A TEE key serves one tenant at a time: another tenant's lease for this key must have
        // expired (`tenancy.rs`). The lease names its tenant (checked against the repository).
        if let Some(l) = &lease {
            kbs.tee_tenants.claim(
                &cgx_protocol::kbs::jwe::thumbprint(key),
                &l.body.tenant,
                kbs.clock.unix(),
                l.exp,
            )?;
        }
        let jwe = cgx_protocol::kbs::jwe::encrypt(key, &resource.value).map_err(|e| match e {
            cgx_protocol::kbs::jwe::JweError::UnsupportedKey(_)
            | cgx_protocol::kbs::jwe::JweError::InvalidKey(_) => {
                KbsError::InvalidRequest(format!("TEE key: {e}"))
            }
            e => KbsError::Jwe(e.to_string()),
        })?;
        kbs.store
            .audit(
                "tee",
                "release",
                &path,
                &json!({
                    "tee_key": cgx_protocol::kbs::jwe::thumbprint(key),
                    "lease": lease.as_ref().map(|l| l.body.lease.as_str()),
                    "tenant": lease.as_ref().map(|l| l.body.tenant.as_str()),
                    "node": lease.as_ref().map(|l| l.body.node.as_str()),
                    "lease_exp": lease.as_ref().map(|l| l.exp),
                    "ear_status": status.as_str(),
                }),
            )
            .await?;
        serde_json::to_value(&jwe).map_err(|e| KbsError::Internal(e.to_string()))
    }
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
        // The evaluator threads answer through a future: any executor will do in a test.
        block_on(check_async(stored))
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    async fn check_async(stored: &[(&str, &str)]) -> Result<(), KbsError> {
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
        policies.check(&ear(), &request, &stored).await
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

    /// The review's release policy: 22 lines, each squaring the last (5.8 s of a serving
    /// thread before, each further line ×2.6).
    fn squarings(lines: usize) -> String {
        let mut rego = String::from(
            "package policy\nimport rego.v1\ndefault allow := false\n\
             x0 := count(input.submods) + 98765432109876543210\n",
        );
        for i in 1..=lines {
            rego.push_str(&format!("x{i} := x{p} * x{p}\n", p = i - 1));
        }
        rego.push_str(&format!("allow if x{lines} > 0\n"));
        rego
    }

    /// Two chains of shared arrays compared at their ends: one VM instruction that runs for
    /// seconds, which only the evaluator threads' deadline answers for.
    fn stuck(depth: usize) -> String {
        let mut rego = String::from(
            "package policy\nimport rego.v1\ndefault allow := false\n\
             a0 := [input.tag]\nb0 := [input.tag]\n",
        );
        for i in 1..=depth {
            rego.push_str(&format!(
                "a{i} := [a{p}, a{p}]\nb{i} := [b{p}, b{p}]\n",
                p = i - 1
            ));
        }
        rego.push_str(&format!("allow if a{depth} == b{depth}\n"));
        rego
    }

    /// A repository administrator's squarings: a refusal of that resource naming the limit,
    /// at once; the operator's global scope is not held to the product cap.
    #[test]
    fn a_repository_admins_squarings_are_refused_naming_the_limit() {
        let allow = "package policy\ndefault allow := true\n";
        let started = std::time::Instant::now();
        let e = check(&[("resource:*", allow), ("resource:a", &squarings(22))]).unwrap_err();
        assert!(
            matches!(&e, KbsError::PolicyDeny(d)
                if d.starts_with("a/key/x: policy resource:a: policy exceeded its number limit")),
            "{e:?}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        // On a resource of its own too.
        let e = check(&[("resource:a/key/x", &squarings(22))]).unwrap_err();
        assert!(
            matches!(&e, KbsError::PolicyDeny(d) if d.contains("number limit")),
            "{e:?}"
        );
        assert_eq!(trust_of("resource:*", "x"), Trust::Operator);
        assert_eq!(trust_of("resource:a", "x"), Trust::Untrusted);
        assert_eq!(trust_of("resource:a/key/x", "x"), Trust::Untrusted);
    }

    /// A repository administrator's policy built to hold an evaluator thread (a comparison of
    /// two shared-structure chains): refused within its limits, naming the value size limit
    /// that stops it, and an honest request on another resource, with an untrusted policy of
    /// its own, is served meanwhile. (The watchdog's deadline is `cgx-policies`' own test.)
    #[test]
    fn a_stuck_policy_is_refused_on_time_and_others_are_served() {
        let bomb = stuck(27);
        let honest = "package policy\nimport rego.v1\ndefault allow := false\n\
                      allow if { some _, p in input.submods; p.ear_status == \"affirming\" }\n";
        let stored = [("resource:a", bomb.as_str())];
        block_on(async {
            let started = std::time::Instant::now();
            let (refused, served) = tokio::join!(check_async(&stored), async {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                check_async(&[("resource:a/key/x", honest)]).await
            });
            let e = refused.unwrap_err();
            assert!(
                matches!(&e, KbsError::PolicyDeny(d) if d.contains("policy resource:a: policy exceeded its value size limit")),
                "{e:?}"
            );
            assert!(
                started.elapsed() < std::time::Duration::from_millis(900),
                "{:?}",
                started.elapsed()
            );
            served.unwrap();
        });
    }

    /// Refused at upload where the allow-list refuses it; stored anyway (by older code), it
    /// answers `PolicyInvalid` at its turn, and nothing at startup.
    #[test]
    fn builtins_off_the_allow_list_are_refused_at_upload_and_at_their_turn() {
        let policies = ReleasePolicies::new(false, false).unwrap();
        let bomb = "package policy\nimport rego.v1\ndefault allow := false\n\
                    allow if { a := input.tag; b := replace(a, \"x\", a); count(b) > 0 }\n";
        let e = policies.program("resource:a", bomb).unwrap_err();
        assert!(
            matches!(&e, KbsError::PolicyInvalid(d) if d.contains("`replace` may not be used")),
            "{e:?}"
        );
        // The operator's global scope is trusted.
        policies.program(GLOBAL_SCOPE, bomb).unwrap();
        let e = check(&[("resource:a/key/x", bomb)]).unwrap_err();
        assert!(matches!(e, KbsError::PolicyInvalid(_)), "{e:?}");
        // The shipped default, stored per resource as cgx-devnet does, runs as the operator's.
        assert_eq!(
            trust_of("resource:a/key/x", cgx_policies::RELEASE_POLICY),
            Trust::Operator
        );
        check(&[("resource:a/key/x", cgx_policies::RELEASE_POLICY)]).unwrap();
    }
}
