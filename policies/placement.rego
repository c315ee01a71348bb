# An example placement policy (package `placement`): a tenant's own constraints on the node a
# job may run on, beyond the broker's filters (attested, fresh, GPU model and count, memory, TEE
# kind, region, price). Submit one with a job (`cgx job submit --placement-policy F`).
#
# input.node: id, operator, region, tee, sim, gpu_model, gpu_chip, gpu_count, gpu_memory_gib,
#             price_per_gpu_hour_micros (integer: 10^-6 units), reputation, and claims {cpu, gpus} as the verifier produced them
# input.job:  the job as submitted
#
# `deny` is a set of readable reasons; a node fits when it is empty. A placement policy is
# untrusted code: it may call only builtins whose output and time are bounded by their arguments
# (ALLOWED_BUILTINS in policies/src/limits.rs: no sprintf, replace, numbers.range, ...), and each
# evaluation runs under instruction, time and allocation limits: build messages with concat.
package placement

import rego.v1

deny contains concat(" ", ["region", input.node.region, "is outside the EU"]) if {
	not startswith(input.node.region, "eu-")
}

deny contains concat(" ", ["a GPU runs driver", gpu.driver_version, "older than 550"]) if {
	some gpu in input.node.claims.gpus
	to_number(split(gpu.driver_version, ".")[0]) < 550
}

deny contains "the CPU TEE is in debug mode" if {
	input.node.claims.cpu.debug
}
