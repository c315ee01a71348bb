package policy_test

import rego.v1

import data.policy

ok_cpu := {"ear_status": "affirming", "ear_verifier_claims": {"cgx.sim": false}}

test_affirming_cpu_is_released if {
	policy.allow with input as {"submods": {"cpu0": ok_cpu}}
}

test_a_warning_gpu_blocks_release if {
	not policy.allow with input as {"submods": {"cpu0": ok_cpu, "gpu0": {"ear_status": "warning", "ear_verifier_claims": {}}}}
}

test_no_cpu_no_release if {
	not policy.allow with input as {"submods": {"gpu0": ok_cpu}}
}

test_sim_only_where_simulators_are_trusted if {
	sim := {"cpu0": {"ear_status": "affirming", "ear_verifier_claims": {"cgx.sim": true}}}
	not policy.allow with input as {"submods": sim}
	policy.allow with input as {"submods": sim} with data.allow_sim as true
}
