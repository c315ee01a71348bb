//! The placement package: a job's own constraints on a node, beyond the broker's filters. A
//! tenant submits it with the job; `data.placement.deny` is a set of readable reasons, and a node
//! fits when the set is empty (or undefined). Input: `{"node": {id, operator, region, tee, sim,
//! gpu_model, gpu_chip, gpu_count, gpu_memory_gib, price_per_gpu_hour_micros (integer, 10^-6 units), reputation, claims:
//! {cpu, gpus: [...]}}, "job": <the job spec>}` — the node's *verified* claims, and its offer.

use std::sync::Arc;
use std::time::Duration;

use crate::Error;
use crate::limits::{Limits, Trust};
use crate::program::RegoProgram;
use crate::sandbox::{Pending, Sandbox};

/// The placement entry point.
pub const ENTRY_POINT: &str = "data.placement.deny";

/// The most reasons one refusal reports (a policy that emits thousands says enough with these).
const MAX_REASONS: usize = 8;

/// The longest reason reported, in bytes (longer ones are cut at a character boundary).
const MAX_REASON_BYTES: usize = 256;

/// Builtins that were refused by name before the allow-list ([`crate::limits::ALLOWED_BUILTINS`])
/// replaced this list; kept for callers that name it. None of them is on the allow-list.
pub const FORBIDDEN_BUILTINS: &[&str] = &["numbers.range", "sprintf"];

/// Longest placement policy accepted.
pub const MAX_POLICY_BYTES: usize = 64 << 10;

/// How long one batch of evaluations ([`PlacementPolicy::refusals_many`]) may take in all,
/// from when an evaluator thread picks it up; past it the rest of the batch is refused with
/// "policy exceeded its time limit". Waiting for the thread is bounded apart
/// ([`crate::sandbox::MAX_QUEUE_WAIT`]) and answered [`Error::Busy`].
pub const BATCH_TIME: Duration = Duration::from_millis(500);

/// One compiled placement policy: a tenant's, so untrusted ([`Trust::Untrusted`]): only
/// allow-listed builtins, every evaluation under [`Limits::UNTRUSTED`].
#[derive(Debug)]
pub struct PlacementPolicy(RegoProgram);

impl PlacementPolicy {
    /// Compile `rego` (package `placement`), refusing policies over [`MAX_POLICY_BYTES`], with
    /// a number literal too large to parse safely, or calling a builtin off the allow-list
    /// (`replace`, `sprintf`, `numbers.range`, ...: each makes a value as large as its arguments
    /// ask). The error names the builtin and the rule.
    pub fn compile(rego: &str) -> Result<Self, Error> {
        if rego.len() > MAX_POLICY_BYTES {
            return Err(Error::Policy {
                detail: format!("placement: longer than {MAX_POLICY_BYTES} bytes"),
            });
        }
        RegoProgram::compile_as(
            "placement.rego",
            rego,
            serde_json::json!({}),
            ENTRY_POINT,
            Trust::Untrusted,
        )
        .map(PlacementPolicy)
        .map_err(|e| match e {
            Error::Policy { detail } => Error::Policy {
                detail: format!("placement: {detail}"),
            },
            e => e,
        })
    }

    /// The builtins the policy calls, by name (each on the allow-list).
    pub fn builtins(&self) -> &[String] {
        self.0.builtins()
    }

    /// The limits each evaluation runs under.
    pub fn limits(&self) -> Limits {
        self.0.limits()
    }

    /// The reasons the policy refuses `input` (empty: the node fits), evaluated on the calling
    /// thread under the policy's limits. A `deny` that is not a set or array is a policy error,
    /// never a pass; a limit reached is [`Error::Limit`] (the job's refusal, with its reason).
    ///
    /// One VM instruction is not interrupted (see [`crate::limits`]): services call
    /// [`PlacementPolicy::refusals_off_thread`] or [`PlacementPolicy::refusals_many`] instead,
    /// never this on an async or serving thread or under a lock.
    pub fn refusals(&self, input: &serde_json::Value) -> Result<Vec<String>, Error> {
        self.refusals_of(regorus::Value::from(input.clone()))
    }

    fn refusals_of(&self, input: regorus::Value) -> Result<Vec<String>, Error> {
        let out = self.0.eval(input)?;
        let items: Vec<regorus::Value> = match &out {
            regorus::Value::Undefined => return Ok(Vec::new()),
            regorus::Value::Set(s) => s.iter().take(MAX_REASONS).cloned().collect(),
            regorus::Value::Array(a) => a.iter().take(MAX_REASONS).cloned().collect(),
            _ => {
                return Err(Error::Policy {
                    detail: "placement: `deny` must be a set of strings".into(),
                });
            }
        };
        let mut reasons = Vec::with_capacity(items.len());
        for v in &items {
            match v {
                regorus::Value::String(s) => reasons.push(cut(s)),
                // Never printed: a value built with shared structure prints exponentially large.
                other => reasons.push(format!(
                    "(a reason that is not a string: {})",
                    type_name(other)
                )),
            }
        }
        Ok(reasons)
    }

    /// [`PlacementPolicy::refusals`] on an evaluator thread of the process-wide sandbox: the
    /// answer comes (as a `Future`, or by [`Pending::wait`]) within the policy's time limit
    /// ([`Limits::UNTRUSTED`]) counted from when a thread picks it up, or is [`Error::Limit`]
    /// (the policy's own fault: the job's refusal, with its reason). [`Error::Busy`]: not
    /// evaluated now (no thread free within [`crate::sandbox::MAX_QUEUE_WAIT`]); retry the
    /// job later, never fail it for that.
    pub fn refusals_off_thread(self: &Arc<Self>, input: serde_json::Value) -> Pending<Vec<String>> {
        let policy = self.clone();
        Sandbox::global().submit(self.limits().time, move || policy.refusals(&input))
    }

    /// The policy on many nodes in one hop to an evaluator thread: one answer per input, in
    /// order, each evaluation under the policy's own limits; the whole batch within
    /// [`BATCH_TIME`] from when a thread picks it up, or [`Error::Limit`] for all of it (and
    /// for each input past it). [`Error::Busy`] for the whole batch: not evaluated now, retry
    /// later. How placement should call it: build the inputs under the index lock, release the
    /// lock, await this, then decide.
    pub fn refusals_many(
        self: &Arc<Self>,
        inputs: Vec<serde_json::Value>,
    ) -> Pending<Vec<Result<Vec<String>, Error>>> {
        let policy = self.clone();
        Sandbox::global().submit(BATCH_TIME, move || {
            let started = std::time::Instant::now();
            Ok(inputs
                .iter()
                .map(|input| {
                    // Past the batch's time, the rest are refused without running.
                    if started.elapsed() >= BATCH_TIME {
                        return Err(Error::Limit(crate::limits::Exceeded::Time(BATCH_TIME)));
                    }
                    policy.refusals(input)
                })
                .collect())
        })
    }
}

fn cut(s: &str) -> String {
    if s.len() <= MAX_REASON_BYTES {
        return s.to_string();
    }
    let mut end = MAX_REASON_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn type_name(v: &regorus::Value) -> &'static str {
    match v {
        regorus::Value::Null => "null",
        regorus::Value::Bool(_) => "boolean",
        regorus::Value::Number(_) => "number",
        regorus::Value::String(_) => "string",
        regorus::Value::Array(_) => "array",
        regorus::Value::Set(_) => "set",
        regorus::Value::Object(_) => "object",
        _ => "undefined",
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
        for (bomb, builtin) in [
            (
                "package placement\ndeny contains \"x\" if count(numbers.range(0, 100000000000000)) > 0",
                "numbers.range",
            ),
            (
                "package placement\ndeny contains x if x := numbers.range_step(0, 1e14, 1)",
                "numbers.range_step",
            ),
            (
                "package placement\ndeny contains x if x := sprintf(\"%999999999999d\", [1])",
                "sprintf",
            ),
            (
                "package placement\ndeny contains x if x := sprintf (\"%d\", [1])",
                "sprintf",
            ),
            (
                "package placement\ndeny contains x if { y := \"#\"; x := sprintf(\"%9d\", [1]) }",
                "sprintf",
            ),
        ] {
            let e = PlacementPolicy::compile(bomb).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`{builtin}` may not be used")),
                "{bomb}: {e}"
            );
        }
        // Whitespace cannot hide a builtin: regorus refuses it there.
        assert!(
            PlacementPolicy::compile(
                "package placement\ndeny contains x if x := numbers . range_step(0, 1e14, 1)"
            )
            .is_err()
        );
        // The allow-list reads the program, not the text: a mention in a comment is harmless.
        assert!(PlacementPolicy::compile("package placement\n# sprintf\ndeny := set()").is_ok());
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
