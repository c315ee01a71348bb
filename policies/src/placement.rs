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

/// One compiled placement policy.
#[derive(Debug)]
pub struct PlacementPolicy(RegoProgram);

impl PlacementPolicy {
    /// Compile `rego` (package `placement`).
    pub fn compile(rego: &str) -> Result<Self, Error> {
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
