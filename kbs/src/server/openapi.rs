//! The KBS's OpenAPI document: its frame (information, tags, security schemes), the schemas of
//! CoCo's protocol messages, and the small JSON bodies only the handlers speak. The operations
//! come from the handlers' `#[utoipa::path]` attributes (`http.rs`), added route by route with
//! the router itself.
//!
//! CoCo's messages are `kbs-types`' structures, which carry no schemas: they are described
//! here as CoCo's KBS protocol defines them ([`COCO_SCHEMAS`]), and a test holds each
//! description to the fields `kbs-types` writes.

use std::borrow::Cow;

use cgx_protocol::audit::AuditEvent;
use cgx_service::error::Problem;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{ObjectBuilder, RefOr, Schema, Type};
use utoipa::{OpenApi, PartialSchema, ToSchema};

/// The document's frame.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "cgx KBS",
        description = "Key broker service: Confidential Containers' KBS protocol (RCAR), \
            resources released to attested TEEs under release policies and broker leases, \
            the admin API. Refusals are RFC 9457 problem details with a stable code (a \
            malformed path, query or body the framework refuses is answered in plain text). Any \
            route may answer 429 or 503 with Retry-After under load."
    ),
    modifiers(&Security),
    components(schemas(AuditEvent), responses(Problem)),
    tags(
        (name = "protocol", description = "CoCo's KBS protocol: handshake and resources"),
        (name = "admin", description = "Resources, policies, reference values, the audit trail"),
        (name = "operations", description = "Health, keys, metrics, this document"),
    )
)]
pub(super) struct ApiDoc;

/// The security schemes the operations name.
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "adminJwt",
            SecurityScheme::Http(
                Http::builder()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format(
                        "EdDSA JWS, typ cgx-kbs-admin+jwt, under a configured admin key \
                         (scoped to repositories)",
                    )
                    .build(),
            ),
        );
        components.add_security_scheme(
            "session",
            SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
                super::http::SESSION_COOKIE,
                "the RCAR session (POST /kbs/v0/auth sets it; /attest attests it)",
            ))),
        );
        components.add_security_scheme(
            "ear",
            SecurityScheme::Http(
                Http::builder()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("the EAR this KBS issued at /attest")
                    .build(),
            ),
        );
    }
}

/// CoCo's KBS protocol messages, as JSON Schema (OpenAPI 3.1), by name.
pub(super) const COCO_SCHEMAS: &str = r#"{
  "Request": {
    "type": "object",
    "description": "RCAR request (kbs-types Request)",
    "required": ["version", "tee", "extra-params"],
    "properties": {
      "version": {"type": "string", "const": "0.4.0"},
      "tee": {"type": "string", "description": "snp, tdx (sample where the KBS takes it)"},
      "extra-params": {"type": ["object", "string"], "description": "unused: {} or \"\""}
    }
  },
  "Challenge": {
    "type": "object",
    "description": "RCAR challenge (kbs-types Challenge)",
    "required": ["nonce", "extra-params"],
    "properties": {
      "nonce": {"type": "string", "description": "base64 of 32 random bytes"},
      "extra-params": {"type": ["object", "string"], "description": "unused: {}"}
    }
  },
  "Attestation": {
    "type": "object",
    "description": "RCAR attestation (kbs-types Attestation)",
    "required": ["runtime-data", "tee-evidence"],
    "properties": {
      "init-data": {
        "type": ["object", "null"],
        "description": "initialization data a host injected (kbs-types InitData)",
        "required": ["format", "body"],
        "properties": {"format": {"type": "string"}, "body": {"type": "string"}}
      },
      "runtime-data": {
        "type": "object",
        "required": ["nonce", "tee-pubkey"],
        "properties": {
          "nonce": {"type": "string"},
          "tee-pubkey": {
            "type": "object",
            "description": "JWK: EC (P-256/P-384/P-521, ECDH-ES+A256KW) or RSA (RSA-OAEP-256)"
          }
        }
      },
      "tee-evidence": {
        "type": "object",
        "required": ["primary_evidence", "additional_evidence"],
        "properties": {
          "primary_evidence": {
            "type": "object",
            "description": "the CPU TEE's evidence in CoCo's attester's shape (snp: attestation_report and cert_chain; tdx: quote and cc_eventlog)"
          },
          "additional_evidence": {"type": "string"}
        }
      }
    }
  },
  "Response": {
    "type": "object",
    "description": "A resource encrypted to the session's TEE key (kbs-types Response: a JWE in flattened JSON)",
    "required": ["protected", "encrypted_key", "iv", "ciphertext", "tag"],
    "properties": {
      "protected": {"type": "string", "description": "the protected header (alg, enc, epk…), base64url of its JSON"},
      "encrypted_key": {"type": "string"},
      "aad": {"type": "string"},
      "iv": {"type": "string"},
      "ciphertext": {"type": "string"},
      "tag": {"type": "string"}
    }
  }
}"#;

/// The schema named `name` in [`COCO_SCHEMAS`] (an untyped object if the table lacks it: a
/// test holds the table to every name used).
fn coco(name: &str) -> RefOr<Schema> {
    serde_json::from_str::<serde_json::Value>(COCO_SCHEMAS)
        .ok()
        .and_then(|v| v.get(name).cloned())
        .and_then(|s| serde_json::from_value::<Schema>(s).ok())
        .map_or_else(
            || {
                RefOr::T(Schema::Object(
                    ObjectBuilder::new().schema_type(Type::Object).build(),
                ))
            },
            RefOr::T,
        )
}

macro_rules! coco_schema {
    ($($(#[$doc:meta])* $t:ident = $name:literal;)*) => {$(
        $(#[$doc])*
        pub(super) struct $t;

        impl PartialSchema for $t {
            fn schema() -> RefOr<Schema> {
                coco($name)
            }
        }

        impl ToSchema for $t {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
        }
    )*};
}

coco_schema! {
    /// `POST /kbs/v0/auth` body.
    RcarRequest = "Request";
    /// `POST /kbs/v0/auth` answer.
    RcarChallenge = "Challenge";
    /// `POST /kbs/v0/attest` body.
    RcarAttestation = "Attestation";
    /// A released resource.
    Jwe = "Response";
}

/// `POST /kbs/v0/attest` answer: the EAR, signed.
#[derive(serde::Serialize, ToSchema)]
pub(super) struct AttestResponse {
    /// The EAR (draft-ietf-rats-ear), a JWT signed with the KBS's result key.
    pub token: String,
}

/// A release policy as Trustee's admin API carries it.
#[derive(serde::Serialize, ToSchema)]
pub(super) struct PolicyMessage {
    /// The Rego text, base64 (standard or URL-safe alphabet; URL-safe without padding in
    /// answers).
    pub policy: String,
}

/// The appraisal (attestation) policy as Trustee's admin API carries it.
#[derive(serde::Serialize, ToSchema)]
pub(super) struct AttestationPolicyMessage {
    /// `rego` (the only kind taken).
    #[serde(rename = "type")]
    pub kind: String,
    /// The Rego text, base64.
    pub policy: String,
}

/// Trustee's RVPS message, as kbs-client's `set-sample-reference-value` sends it.
#[derive(serde::Serialize, ToSchema)]
pub(super) struct RvpsMessage {
    /// `0.1.0`.
    pub version: String,
    /// The extractor: `sample` (the one cgx takes).
    #[serde(rename = "type")]
    pub kind: String,
    /// base64 of a JSON object `{name: value}`, merged into the sample reference values.
    pub payload: String,
}

/// `GET /healthz` answer.
#[derive(serde::Serialize, ToSchema)]
pub(super) struct Health {
    /// `ok`.
    pub status: &'static str,
    /// The database's schema version.
    pub schema_version: i64,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cgx_protocol::kbs_types::{Attestation, Challenge, Request, Tee};
    use std::collections::BTreeSet;

    fn keys(v: &serde_json::Value) -> BTreeSet<String> {
        v.as_object().unwrap().keys().cloned().collect()
    }

    fn described(name: &str) -> (BTreeSet<String>, BTreeSet<String>) {
        let all: serde_json::Value = serde_json::from_str(COCO_SCHEMAS).unwrap();
        let s = &all[name];
        assert!(
            serde_json::from_value::<Schema>(s.clone()).is_ok(),
            "{name}"
        );
        let required = s["required"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        (keys(&s["properties"]), required)
    }

    /// Each CoCo schema lists the fields kbs-types writes, and requires those it always
    /// writes: the description cannot drift from the structures the handlers parse.
    #[test]
    fn coco_schemas_match_the_messages_kbs_types_writes() {
        let request: Request =
            serde_json::from_slice(&cgx_protocol::kbs::rcar::auth_body(Tee::Snp).unwrap()).unwrap();
        let challenge = Challenge {
            nonce: "n".into(),
            extra_params: serde_json::json!({}),
        };
        let key = cgx_protocol::kbs::jwe::TeeKey::generate_ec(cgx_protocol::kbs::jwe::Curve::P256)
            .unwrap();
        let source = crate::sim::SimNode::generate(0, [0; 48], 1_700_000_000).unwrap();
        let attestation: Attestation =
            cgx_protocol::kbs::rcar::attestation(&key, &source, "bm9uY2U").unwrap();
        let jwe = cgx_protocol::kbs::jwe::encrypt(&key.public().unwrap(), b"secret").unwrap();
        for (name, v) in [
            ("Request", serde_json::to_value(&request).unwrap()),
            ("Challenge", serde_json::to_value(&challenge).unwrap()),
            ("Attestation", serde_json::to_value(&attestation).unwrap()),
            ("Response", serde_json::to_value(&jwe).unwrap()),
        ] {
            let (props, required) = described(name);
            let written = keys(&v);
            assert!(written.is_subset(&props), "{name}: {written:?} ⊄ {props:?}");
            assert!(
                required.is_subset(&written),
                "{name}: {required:?} ⊄ {written:?}"
            );
            // And each written value is of a type its description allows.
            let all: serde_json::Value = serde_json::from_str(COCO_SCHEMAS).unwrap();
            for (field, value) in v.as_object().unwrap() {
                let allowed = &all[name]["properties"][field]["type"];
                let kind = match value {
                    serde_json::Value::Null => "null",
                    serde_json::Value::Bool(_) => "boolean",
                    serde_json::Value::Number(_) => "number",
                    serde_json::Value::String(_) => "string",
                    serde_json::Value::Array(_) => "array",
                    serde_json::Value::Object(_) => "object",
                };
                let ok = match allowed {
                    serde_json::Value::String(t) => t == kind,
                    serde_json::Value::Array(ts) => ts.iter().any(|t| t == kind),
                    _ => false,
                };
                assert!(ok, "{name}.{field}: {kind}, described as {allowed}");
            }
        }
        for t in [
            RcarRequest::schema(),
            RcarChallenge::schema(),
            RcarAttestation::schema(),
            Jwe::schema(),
        ] {
            let RefOr::T(Schema::Object(o)) = t else {
                panic!("not an object schema");
            };
            assert!(!o.properties.is_empty());
        }
    }
}
