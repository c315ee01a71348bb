# An example placement policy (package `placement`): a tenant's own constraints on the node a
# job may run on, beyond the broker's filters (attested, fresh, GPU model and count, memory, TEE
# kind, region, price). Submit one with a job (`cgx job submit --placement-policy F`).
#
# input.node: id, operator, region, tee, sim, gpu_model, gpu_chip, gpu_count, gpu_memory_gib,
#             price_per_gpu_hour, reputation, and claims {cpu, gpus} as the verifier produced them
# input.job:  the job as submitted
#
# `deny` is a set of readable reasons; a node fits when it is empty.
package placement

import rego.v1

deny contains sprintf("region %s is outside the EU", [input.node.region]) if {
	not startswith(input.node.region, "eu-")
}

deny contains sprintf("GPU %d runs driver %s, older than 550", [i, gpu.driver_version]) if {
	some i, gpu in input.node.claims.gpus
	to_number(split(gpu.driver_version, ".")[0]) < 550
}

deny contains "the CPU TEE is in debug mode" if {
	input.node.claims.cpu.debug
}
