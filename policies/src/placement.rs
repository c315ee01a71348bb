//! The placement package: a job's own constraints on a node, beyond the broker's filters. A
//! tenant submits it with the job; `data.placement.deny` is a set of readable reasons, and a node
//! fits when the set is empty (or undefined). Input: `{"node": {id, operator, region, tee, sim,
//! gpu_model, gpu_chip, gpu_count, gpu_memory_gib, price_per_gpu_hour, reputation, claims:
//! {cpu, gpus: [...]}}, "job": <the job spec>}` — the node's *verified* claims, and its offer.

use crate::Error;
use crate::program::RegoProgram;

/// The placement entry point.
pub const ENTRY_POINT: &str = "data.placement.deny";

/// The most reasons one refusal reports (a policy that emits thousands says enough with these).
const MAX_REASONS: usize = 8;

/// Builtins a tenant's placement policy may not call: each allocates as much as an argument
/// says before any limit is checked (`numbers.range(0, 1e14)`; a `sprintf` width of 10¹²), which
/// would take the broker down, and a placement policy never needs them.
pub const FORBIDDEN_BUILTINS: &[&str] = &["numbers.range", "sprintf"];

/// Longest placement policy accepted.
pub const MAX_POLICY_BYTES: usize = 64 << 10;

/// One compiled placement policy.
#[derive(Debug)]
pub struct PlacementPolicy(RegoProgram);

impl PlacementPolicy {
    /// Compile `rego` (package `placement`), refusing policies over [`MAX_POLICY_BYTES`] or
    /// naming a [`FORBIDDEN_BUILTINS`] builtin anywhere in its text (whitespace cannot hide
    /// one).
    pub fn compile(rego: &str) -> Result<Self, Error> {
        if rego.len() > MAX_POLICY_BYTES {
            return Err(Error::Policy {
                detail: format!("placement: longer than {MAX_POLICY_BYTES} bytes"),
            });
        }
        // Whitespace removed (comments kept: a `#` inside a string would otherwise hide the
        // rest of its line), so `numbers . range` is found too; a mention in a comment or a
        // string is refused as well, erring on the side of refusing.
        let squeezed: String = rego.chars().filter(|c| !c.is_whitespace()).collect();
        if let Some(b) = FORBIDDEN_BUILTINS.iter().find(|b| squeezed.contains(*b)) {
            return Err(Error::Policy {
                detail: format!(
                    "placement: `{b}` may not be used in a placement policy (it allocates as \
                     much as its argument asks)"
                ),
            });
        }
        RegoProgram::compile("placement.rego", rego, serde_json::json!({}), ENTRY_POINT)
            .map(PlacementPolicy)
    }

    /// The reasons the policy refuses `input` (empty: the node fits). A `deny` that is not a
    /// set or array of strings is a policy error, never a pass.
    pub fn refusals(&self, input: &serde_json::Value) -> Result<Vec<String>, Error> {
        let out = self.0.eval(regorus::Value::from(input.clone()))?;
        let items: Vec<regorus::Value> = match &out {
            regorus::Value::Undefined => return Ok(Vec::new()),
            regorus::Value::Set(s) => s.iter().cloned().collect(),
            regorus::Value::Array(a) => a.iter().cloned().collect(),
            _ => {
                return Err(Error::Policy {
                    detail: "placement: `deny` must be a set of strings".into(),
                });
            }
        };
        let mut reasons = Vec::with_capacity(items.len().min(MAX_REASONS));
        for v in items.iter().take(MAX_REASONS) {
            match v {
                regorus::Value::String(s) => reasons.push(s.to_string()),
                other => reasons.push(other.to_string()),
            }
        }
        Ok(reasons)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_shipped_example_reads_node_and_job() {
        let p = PlacementPolicy::compile(crate::PLACEMENT_POLICY).unwrap();
        let node = |region: &str, driver: &str| {
            serde_json::json!({
                "node": {"region": region, "sim": false, "claims": {"cpu": {"debug": false},
                  "gpus": [{"driver_version": driver}]}},
                "job": {"gpu_count": 1}
            })
        };
        assert!(
            p.refusals(&node("eu-west", "580.95.05"))
                .unwrap()
                .is_empty()
        );
        let r = p.refusals(&node("us-east", "580.95.05")).unwrap();
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(r[0].contains("us-east"), "{r:?}");
        let r = p.refusals(&node("eu-west", "535.1")).unwrap();
        assert!(r[0].contains("driver"), "{r:?}");
    }

    #[test]
    fn builtins_that_allocate_on_demand_are_refused() {
        for bomb in [
            "package placement\ndeny contains \"x\" if count(numbers.range(0, 100000000000000)) > 0",
            "package placement\ndeny contains x if x := numbers . range_step(0, 1e14, 1)",
            "package placement\ndeny contains x if x := sprintf(\"%999999999999d\", [1])",
            "package placement\ndeny contains x if x := sprintf (\"%d\", [1])",
        ] {
            let e = PlacementPolicy::compile(bomb).unwrap_err().to_string();
            assert!(e.contains("may not be used"), "{bomb}: {e}");
        }
        // A `#` in a string does not hide the rest of its line; a mere mention is refused too.
        let hidden =
            "package placement\ndeny contains x if { y := \"#\"; x := sprintf(\"%9d\", [1]) }";
        assert!(PlacementPolicy::compile(hidden).is_err());
        assert!(PlacementPolicy::compile("package placement\n# sprintf\ndeny := set()").is_err());
        assert!(PlacementPolicy::compile("package placement\ndeny := set()").is_ok());
        assert!(PlacementPolicy::compile(&"#".repeat(MAX_POLICY_BYTES + 1)).is_err());
    }

    #[test]
    fn malformed_policies_and_results_are_errors() {
        assert!(PlacementPolicy::compile("package placement\ndeny contains").is_err());
        let p = PlacementPolicy::compile("package placement\ndeny := 3").unwrap();
        assert!(p.refusals(&serde_json::json!({})).is_err());
        // Another package has no `data.placement.deny`: refused when compiled, not a pass.
        assert!(PlacementPolicy::compile("package other\ndeny := {\"x\"}").is_err());
        // `deny` undefined for this input: the node fits.
        let p =
            PlacementPolicy::compile("package placement\ndeny contains \"x\" if input.no").unwrap();
        assert!(p.refusals(&serde_json::json!({})).unwrap().is_empty());
    }
}
