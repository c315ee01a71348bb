//! The records cgx signs, each a typed body of [`crate::signed`]'s envelope: what the broker,
//! the KBS, the guest and an offline auditor read, with one definition.
//!
//! Adding a field to a record is a change here (and where it is filled in); a misspelt claim
//! name does not compile.

use serde::{Deserialize, Serialize};

use crate::signed::{Kind, Record};

pub use crate::money::Micros;

/// A CPU TEE kind a node runs and a job may ask for.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TeeKind {
    Snp,
    Tdx,
}

impl TeeKind {
    pub fn parse(s: &str) -> Option<TeeKind> {
        match s {
            "snp" => Some(TeeKind::Snp),
            "tdx" => Some(TeeKind::Tdx),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TeeKind::Snp => "snp",
            TeeKind::Tdx => "tdx",
        }
    }
}

/// An appraisal's status: the AR4SI trustworthiness tier (draft-ietf-rats-ar4si), on the
/// wire and in storage its lowercase name.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    None,
    Affirming,
    Warning,
    Contraindicated,
}

impl Tier {
    /// Tier of one AR4SI claim value (draft-ietf-rats-ar4si §2.3.1, as EAR libraries read it):
    /// -1..=1 none; 2..=31 and -32..=-2 affirming; 32..=95 and -96..=-33 warning; the rest
    /// (96..=127, -128..=-97) contraindicated.
    pub fn of(code: i64) -> Tier {
        match code {
            -1..=1 => Tier::None,
            -32..=31 => Tier::Affirming,
            -96..=95 => Tier::Warning,
            _ => Tier::Contraindicated,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::None => "none",
            Tier::Affirming => "affirming",
            Tier::Warning => "warning",
            Tier::Contraindicated => "contraindicated",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl std::fmt::Display for TeeKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// The broker's lease: the KBS releases `resources` (each the tenant's own) to the VM whose
/// attested TEE key has the thumbprint `node_key`, until the envelope's `exp`; renewed in
/// heartbeat answers up to `until`, the job's end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub lease: String,
    pub job: String,
    /// Whose job: the KBS releases only resources of this tenant's repository.
    pub tenant: String,
    pub node: String,
    pub gpus: Vec<u32>,
    pub resources: Vec<String>,
    /// RFC 7638 thumbprint of the TEE key the node's evidence bound at registration.
    pub node_key: String,
    /// Who issued it (`cgx-broker`).
    pub iss: String,
    /// When the job's time ends: no renewal reaches past it.
    pub until: i64,
    /// When the lease began (Unix seconds, the placement): its metering windows count from
    /// here (`cgx_protocol::metering`). 0 in tokens signed before the field.
    #[serde(default)]
    pub start: i64,
    /// The metering window (seconds) the broker counts this lease's records in. 0 in tokens
    /// signed before the field: [`crate::metering::WINDOW_SECS`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub window_secs: u32,
    /// What the node runs under it (the job's), signed with the lease so the node runs what
    /// the tenant submitted and an auditor reads what ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<crate::broker::Workload>,
}

impl Record for Lease {
    const KIND: Kind = Kind::Lease;
}

impl Lease {
    /// The lease's metering window (seconds).
    pub fn window(&self) -> u32 {
        if self.window_secs == 0 {
            crate::metering::WINDOW_SECS
        } else {
            self.window_secs
        }
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// What a node's heartbeat says: it is alive (`sub`: its id), and the how-manyth signal this is
/// (`seq` only grows: replays are refused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub sub: String,
    pub seq: u64,
}

impl Record for Heartbeat {
    const KIND: Kind = Kind::Heartbeat;
}

/// What became of a lease's workload, as its node reports it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadState {
    /// The weights are in place and the workload's process started (or, for a job that names
    /// no workload, the node holds the lease for its tenant).
    Running,
    /// The workload exited with status 0.
    Completed,
    /// It could not start (weights refused, no such command) or it exited otherwise.
    Failed,
}

impl WorkloadState {
    pub const fn as_str(self) -> &'static str {
        match self {
            WorkloadState::Running => "running",
            WorkloadState::Completed => "completed",
            WorkloadState::Failed => "failed",
        }
    }
}

impl std::fmt::Display for WorkloadState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// A node's report of its lease's workload (`sub`: the node's id), signed under its node key:
/// the broker moves the job on it, and the record is what an auditor reads of what ran where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadReport {
    pub sub: String,
    pub lease: String,
    pub job: String,
    pub state: WorkloadState,
    /// The process's exit status, when it exited with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Why, in words (at most [`WorkloadReport::MAX_REASON`] bytes).
    pub reason: String,
}

impl WorkloadReport {
    pub const MAX_REASON: usize = 512;
}

impl Record for WorkloadReport {
    const KIND: Kind = Kind::WorkloadReport;
}

/// How long a workload report lives (seconds): it is sent at once, and retried fresh.
pub const WORKLOAD_REPORT_TTL_SECS: i64 = 60;

/// How long a heartbeat token lives (seconds).
pub const HEARTBEAT_TTL_SECS: i64 = 30;

/// What a registration established, from verified evidence and a checked offer. Signed by the
/// broker into the node's row ([`NodeRecordClaims`]), so a row alone never makes a node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    /// Ed25519 public key, base64url: signs heartbeats.
    pub node_key: String,
    /// RFC 7638 thumbprint of the TEE key the node presents to the KBS.
    pub tee_thumbprint: String,
    pub operator: String,
    pub region: String,
    pub tee: TeeKind,
    pub sim: bool,
    pub gpu_model: String,
    pub gpu_chip: String,
    pub gpu_count: u32,
    pub gpu_memory_gib: u32,
    pub price: Micros,
    /// `affirming`, `warning`, `contraindicated`, `none`.
    pub status: Tier,
    pub violations: Vec<String>,
    pub attested_at: i64,
    pub ear_expires_at: i64,
    /// SHA-256 (hex) of the EAR (signed JWT) the registration answered with: the record names
    /// the result it stands on without carrying it.
    pub ear_digest: String,
    /// `{"cpu": claims, "gpus": [claims…]}` as the verifier produced them.
    pub claims: serde_json::Value,
}

/// The signed form of a [`NodeRecord`] (issued at its attestation, expiring with its EAR).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRecordClaims {
    pub node: NodeRecord,
}

impl Record for NodeRecordClaims {
    const KIND: Kind = Kind::NodeRecord;
}

/// A broker's record of a setting an admin put: the body's SHA-256 at a version, by an actor.
/// A setting stands until replaced (its envelope's `exp` is `i64::MAX`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setting {
    pub name: String,
    pub version: i64,
    /// Hex SHA-256 of the body.
    pub sha256: String,
    pub actor: String,
}

impl Record for Setting {
    const KIND: Kind = Kind::Setting;
}

/// A KBS administrator's bearer token: the envelope says it all (who, by the key that signed
/// it; until when, by `exp`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KbsAdminToken {}

impl Record for KbsAdminToken {
    const KIND: Kind = Kind::KbsAdmin;
}

/// A broker API bearer token (tenants, operators, auditors): who, by the key that signed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrokerApiToken {}

impl Record for BrokerApiToken {
    const KIND: Kind = Kind::BrokerApi;
}

/// A broker API key holder's answer to the web console's sign-in challenge (`cgx console
/// login`): the key that signed it is who signs in; `challenge` binds it to the one browser
/// that was shown the challenge (the broker keeps the challenge's secret in that browser's
/// cookie), so a token lifted from a screen or a shell history signs in nobody else.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleLogin {
    pub challenge: String,
}

impl Record for ConsoleLogin {
    const KIND: Kind = Kind::ConsoleLogin;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::signed::{SignedError, Signer, When, verify};

    fn signer() -> Signer {
        use aws_lc_rs::signature::Ed25519KeyPair;
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        Signer::from_pkcs8(pkcs8.as_ref()).unwrap()
    }

    fn lease() -> Lease {
        Lease {
            lease: "l".into(),
            job: "j".into(),
            tenant: "acme".into(),
            node: "n".into(),
            gpus: vec![0],
            resources: vec!["acme/key/a".into()],
            node_key: "thumb".into(),
            iss: "cgx-broker".into(),
            until: 2_000,
            start: 1_000,
            window_secs: 0,
            workload: None,
        }
    }

    fn node_record() -> NodeRecord {
        NodeRecord {
            id: "n".into(),
            node_key: "k".into(),
            tee_thumbprint: "t".into(),
            operator: "op".into(),
            region: "eu".into(),
            tee: TeeKind::Snp,
            sim: true,
            gpu_model: "H100".into(),
            gpu_chip: "GH100".into(),
            gpu_count: 8,
            gpu_memory_gib: 80,
            price: Micros(1_000_000),
            status: Tier::Affirming,
            violations: vec![],
            attested_at: 1_000,
            ear_expires_at: 1_500,
            ear_digest: "d".into(),
            claims: serde_json::json!({}),
        }
    }

    /// Each kind signed, then presented as every kind: only its own verifies, each other is
    /// refused as the wrong kind — under the same key, within every time rule.
    #[test]
    fn each_kind_is_refused_as_every_other_kind() {
        let s = signer();
        let tokens: Vec<(Kind, String)> = vec![
            (Kind::Lease, s.sign(&lease(), 1_000, 1_060).unwrap()),
            (
                Kind::NodeRecord,
                s.sign(
                    &NodeRecordClaims {
                        node: node_record(),
                    },
                    1_000,
                    1_060,
                )
                .unwrap(),
            ),
            (
                Kind::Heartbeat,
                s.sign(
                    &Heartbeat {
                        sub: "n".into(),
                        seq: 1,
                    },
                    1_000,
                    1_030,
                )
                .unwrap(),
            ),
            (
                Kind::Setting,
                s.sign(
                    &Setting {
                        name: "reference-values".into(),
                        version: 1,
                        sha256: "00".into(),
                        actor: "admin".into(),
                    },
                    1_000,
                    1_060,
                )
                .unwrap(),
            ),
            (
                Kind::KbsAdmin,
                s.sign(&KbsAdminToken {}, 1_000, 1_060).unwrap(),
            ),
            (
                Kind::BrokerApi,
                s.sign(&BrokerApiToken {}, 1_000, 1_060).unwrap(),
            ),
            (
                Kind::WorkloadReport,
                s.sign(
                    &WorkloadReport {
                        sub: "n".into(),
                        lease: "l".into(),
                        job: "j".into(),
                        state: WorkloadState::Failed,
                        exit_code: Some(3),
                        reason: "exited with status 3".into(),
                    },
                    1_000,
                    1_060,
                )
                .unwrap(),
            ),
            (
                Kind::Metering,
                s.sign(
                    &crate::metering::MeteringRecord {
                        sub: "n".into(),
                        lease: "l".into(),
                        seq: 0,
                        window_start: 940,
                        window_secs: 60,
                        gpus: vec![],
                        pow: None,
                        workload: WorkloadState::Running,
                        prev: crate::metering::genesis("l"),
                    },
                    1_000,
                    1_060,
                )
                .unwrap(),
            ),
            (
                Kind::PowReceipt,
                s.sign(
                    &crate::broker::PowReceipt {
                        sub: "n".into(),
                        challenge: "p1".into(),
                        root: "00".into(),
                        proof_sha256: "00".into(),
                        gpu_us: 1,
                        backend: "cpu".into(),
                    },
                    1_000,
                    1_060,
                )
                .unwrap(),
            ),
            (
                Kind::ConsoleLogin,
                s.sign(
                    &ConsoleLogin {
                        challenge: "c".into(),
                    },
                    1_000,
                    1_060,
                )
                .unwrap(),
            ),
        ];
        assert_eq!(tokens.len(), Kind::ALL.len());
        let keys = [s.public_key()];
        let when = When::At {
            now: 1_010,
            max_lifetime: 3_600,
        };
        fn check<T: Record>(token: &str, keys: &[[u8; 32]], when: When) -> Result<(), SignedError> {
            verify::<T>(token, keys, when).map(|_| ())
        }
        let mut refused = 0;
        for (made, token) in &tokens {
            for asked in Kind::ALL {
                let r = match asked {
                    Kind::Lease => check::<Lease>(token, &keys, when),
                    Kind::NodeRecord => check::<NodeRecordClaims>(token, &keys, when),
                    Kind::Heartbeat => check::<Heartbeat>(token, &keys, when),
                    Kind::Setting => check::<Setting>(token, &keys, when),
                    Kind::KbsAdmin => check::<KbsAdminToken>(token, &keys, when),
                    Kind::BrokerApi => check::<BrokerApiToken>(token, &keys, when),
                    Kind::WorkloadReport => check::<WorkloadReport>(token, &keys, when),
                    Kind::Metering => check::<crate::metering::MeteringRecord>(token, &keys, when),
                    Kind::PowReceipt => check::<crate::broker::PowReceipt>(token, &keys, when),
                    Kind::ConsoleLogin => check::<ConsoleLogin>(token, &keys, when),
                };
                if asked == *made {
                    assert_eq!(r, Ok(()), "{made:?}");
                } else {
                    assert_eq!(
                        r,
                        Err(SignedError::WrongKind {
                            expected: asked.typ(),
                            found: made.typ().into()
                        }),
                        "{made:?} presented as {asked:?}"
                    );
                    refused += 1;
                }
            }
        }
        assert_eq!(refused, 90);
    }

    /// The kinds' typs and audiences are distinct, so neither a header nor an `aud` is ever
    /// shared by two kinds.
    #[test]
    fn kinds_have_distinct_types_and_audiences() {
        let typs: std::collections::HashSet<_> = Kind::ALL.iter().map(|k| k.typ()).collect();
        let auds: std::collections::HashSet<_> = Kind::ALL.iter().map(|k| k.audience()).collect();
        assert_eq!((typs.len(), auds.len()), (10, 10));
    }

    /// A lease without a tenant is no lease.
    #[test]
    fn a_lease_always_names_its_tenant() {
        let s = signer();
        let mut v = serde_json::to_value(lease()).unwrap();
        v.as_object_mut().unwrap().remove("tenant");
        #[derive(Serialize, Deserialize)]
        struct Loose(serde_json::Value);
        impl Record for Loose {
            const KIND: Kind = Kind::Lease;
        }
        let t = s.sign(&Loose(v), 1_000, 1_060).unwrap();
        let r = verify::<Lease>(&t, &[s.public_key()], When::Any);
        assert!(
            matches!(&r, Err(SignedError::Claims { reason, .. }) if reason.contains("tenant")),
            "{r:?}"
        );
    }
}
