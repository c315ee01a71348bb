# cgx default resource release policy (KBS), Trustee-compatible entry point data.policy.allow.
#
# input: the session's EAR claims as the ear crate writes them (eat_profile, iat, exp, ear_status,
# submods: {cpu0, gpu0, ...} each with ear_status, ear_trustworthiness_vector,
# ear_appraisal_policy_ids, ear_verifier_claims {cgx.kind, cgx.sim, cgx.claims-sha256, ...}), plus
# "resource-path" ("repo/type/tag"), "repository", "type", "tag", "query" (the request's query
# parameters) and "lease" (the verified lease claims, or null).
#
# Each part also carries Trustee's dotted names for the same claims ("ear.status",
# "ear.trustworthiness-vector", "ear.appraisal-policy-id"), so policies written for Trustee check
# what they mean to.
#
# data.allow_sim is true only when the KBS is configured to trust simulator roots (development).
# data.plugin ("resource"), data["resource-path"] ([repo, type, tag]) and data.query carry the
# request as Trustee gives it to its policies.
#
# The KBS has already required the overall status to be affirming; this default adds that every
# part (the CPU and each GPU) is itself affirming and that simulated evidence is released to only
# where simulators are trusted. Tenants add their own policies per repository or per resource;
# all that apply must allow.
package policy

import rego.v1

default allow := false

allow if {
	input.submods.cpu0
	every _, submod in input.submods {
		submod.ear_status == "affirming"
		sim_ok(submod)
	}
}

sim_ok(submod) if not submod.ear_verifier_claims["cgx.sim"]

sim_ok(_) if data.allow_sim == true
