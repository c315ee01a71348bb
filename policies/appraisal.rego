# cgx default appraisal policy: verified claims -> an AR4SI trust vector.
#
# input: the claims of one piece of verified evidence (docs/claims.md, schema cgx.claims.v1).
# data.reference: reference values (reference-values/*.json).
# Output: data.cgx.appraisal.result = {"affirming": {claim: code}, "violations": [...]}; the trust
# vector is, per claim, the highest of its affirming code and its violations' codes.
#
# Every violation names its rule, the trust-vector claim it lowers, the AR4SI code it sets, the
# offending value and what was expected, so a refusal says why. Codes (draft-ietf-rats-ar4si):
#   2 affirming; 32..95 warning (32 unsafe/unsupportable, 33 unrecognized);
#   96..127 contraindicated (96 contraindicated, 97 unrecognized hardware).
package cgx.appraisal

import rego.v1

ref := data.reference

kind_ref := object.get(ref, input.kind, {})

# Affirming value per claim for a verified piece of evidence. 0 = no claim made.
affirming := {
	"instance-identity": 2,
	"configuration": 2,
	"executables": 2,
	"file-system": 0,
	"hardware": 2,
	"runtime-opaque": 2,
	"storage-opaque": 0,
	"sourced-data": 0,
}

# ---------------------------------------------------------------- all kinds

# allow_sim: false (default) refuses simulated evidence; true lets it through as a warning;
# "affirming" (development and tests only) does not lower the vector for it at all.
allow_sim := object.get(ref, "allow_sim", false)

# CoCo's sample evidence is simulated and debuggable by nature and reaches appraisal only where
# a service was told to take it (the KBS's allow_sample, loopback only): the sample rules below
# judge it, not the sim and debug rules.
sample_kinds := {"sample", "sampledevice"}

violations contains v if {
	input.sim
	not input.kind in sample_kinds
	not allow_sim in {true, "affirming"}
	v := {
		"rule": "sim_evidence_forbidden",
		"claim": "hardware",
		"code": 97,
		"value": "sim",
		"expected": "evidence from real hardware",
	}
}

violations contains v if {
	input.sim
	not input.kind in sample_kinds
	allow_sim == true
	v := {
		"rule": "sim_evidence_allowed_by_reference_values",
		"claim": "hardware",
		"code": 32,
		"value": "sim",
		"expected": "evidence from real hardware",
	}
}

violations contains v if {
	input.debug
	not input.kind in sample_kinds
	not object.get(kind_ref, "allow_debug", false)
	v := {
		"rule": "debug_forbidden",
		"claim": "configuration",
		"code": 96,
		"value": "debug",
		"expected": "a TEE that the host cannot inspect",
	}
}

# ---------------------------------------------------------------- SEV-SNP

violations contains v if {
	input.kind == "snp"
	input.migration_agent_allowed
	not object.get(kind_ref, "allow_migration_agent", false)
	v := {
		"rule": "snp_migration_agent_forbidden",
		"claim": "configuration",
		"code": 96,
		"value": input.policy,
		"expected": "guest policy without MIGRATE_MA (bit 18)",
	}
}

violations contains v if {
	input.kind == "snp"
	input.smt_enabled
	object.get(kind_ref, "allow_smt", true) == false
	v := {
		"rule": "snp_smt_forbidden",
		"claim": "configuration",
		"code": 32,
		"value": input.platform_info,
		"expected": "SMT disabled",
	}
}

violations contains v if {
	input.kind == "snp"
	min := object.get(object.get(kind_ref, "min_tcb", {}), input.product, {})
	some field, least in min
	have := object.get(input.reported_tcb, field, -1)
	have < least
	v := {
		"rule": "snp_tcb_below_minimum",
		"claim": "hardware",
		"code": 96,
		"value": sprintf("%s=%v", [field, have]),
		"expected": sprintf("%s>=%v on %s", [field, least, input.product]),
	}
}

violations contains v if {
	input.kind == "snp"
	not input.measurement in object.get(kind_ref, "measurements", [])
	v := {
		"rule": "snp_measurement_not_allowed",
		"claim": "executables",
		"code": 33,
		"value": input.measurement,
		"expected": sprintf("a launch measurement listed in reference values snp.measurements: %v", [object.get(kind_ref, "measurements", [])]),
	}
}

# ID keys: a launch whose ID block was signed carries the digests of the ID key and of the author
# key (SHA-384 of each SNP public key; `cgx measure snp --id-key --author-key` prints them). Where
# reference values name such keys, the report's must be one of them: a launch some other key
# signed, or one with no ID block, is not the image's. (Each claim is read by name: the policy's
# reads stay known, so appraisals stay memoized.)
violations contains v if {
	input.kind == "snp"
	allowed := object.get(kind_ref, "id_key_digests", [])
	count(allowed) > 0
	not input.id_key_digest in allowed
	v := {
		"rule": "snp_id_key_not_allowed",
		"claim": "executables",
		"code": 33,
		"value": input.id_key_digest,
		"expected": "a key digest listed in reference values snp.id_key_digests",
	}
}

violations contains v if {
	input.kind == "snp"
	allowed := object.get(kind_ref, "author_key_digests", [])
	count(allowed) > 0
	not input.author_key_digest in allowed
	v := {
		"rule": "snp_author_key_not_allowed",
		"claim": "executables",
		"code": 33,
		"value": input.author_key_digest,
		"expected": "a key digest listed in reference values snp.author_key_digests",
	}
}

# An image's entry (`snp.images.<name>`, what `cgx measure snp --reference-values` writes) that
# names an ID key (and an author key, where its launch enables one) holds reports of its
# measurement to those keys; images without keys, and other measurements, are not affected.
image_keys(field) := {key |
	some img in object.get(kind_ref, "images", {})
	img.measurement == input.measurement
	key := img[field]
}

violations contains v if {
	input.kind == "snp"
	keys := image_keys("id_key_digest")
	count(keys) > 0
	not input.id_key_digest in keys
	v := {
		"rule": "snp_image_id_key_mismatch",
		"claim": "executables",
		"code": 33,
		"value": input.id_key_digest,
		"expected": sprintf("the ID key the image with this measurement names: %v", [keys]),
	}
}

violations contains v if {
	input.kind == "snp"
	keys := image_keys("author_key_digest")
	count(keys) > 0
	not input.author_key_digest in keys
	v := {
		"rule": "snp_image_author_key_mismatch",
		"claim": "executables",
		"code": 33,
		"value": input.author_key_digest,
		"expected": sprintf("the author key the image with this measurement names: %v", [keys]),
	}
}

# VMPL 0 is the guest's most privileged level: a report requested from VMPL 1..3 comes from
# code below an SVSM or paravisor, which may not be the launch-measured kernel the policy
# expects to speak for the guest. Only a written max_vmpl (a number) raises the limit.
default max_vmpl := 0

max_vmpl := m if {
	m := object.get(kind_ref, "max_vmpl", 0)
	is_number(m)
}

violations contains v if {
	input.kind == "snp"
	input.vmpl > max_vmpl
	v := {
		"rule": "snp_vmpl_too_high",
		"claim": "configuration",
		"code": 32,
		"value": input.vmpl,
		"expected": sprintf("VMPL <= %v (reference values snp.max_vmpl)", [max_vmpl]),
	}
}

# ---------------------------------------------------------------- TDX

tdx_allowed_status := object.get(kind_ref, "allowed_tcb_status", ["UpToDate"])

violations contains v if {
	input.kind == "tdx"
	input.tcb_status == "Revoked"
	v := {
		"rule": "tdx_tcb_revoked",
		"claim": "hardware",
		"code": 96,
		"value": input.tcb_status,
		"expected": concat(" or ", tdx_allowed_status),
	}
}

violations contains v if {
	input.kind == "tdx"
	input.tcb_status != "Revoked"
	not input.tcb_status in tdx_allowed_status
	v := {
		"rule": "tdx_tcb_status_not_allowed",
		"claim": "hardware",
		"code": 32,
		"value": sprintf("%s %v", [input.tcb_status, input.advisory_ids]),
		"expected": concat(" or ", tdx_allowed_status),
	}
}

violations contains v if {
	input.kind == "tdx"
	not input.mr_td in object.get(kind_ref, "mr_td", [])
	v := {
		"rule": "tdx_mr_td_not_allowed",
		"claim": "executables",
		"code": 33,
		"value": input.mr_td,
		"expected": "an MRTD listed in reference values tdx.mr_td",
	}
}

violations contains v if {
	input.kind == "tdx"
	some i, allowed in object.get(kind_ref, "rtmr", {})
	not input.rtmr[to_number(i)] in allowed
	v := {
		"rule": "tdx_rtmr_not_allowed",
		"claim": "executables",
		"code": 33,
		"value": sprintf("RTMR%s=%s", [i, input.rtmr[to_number(i)]]),
		"expected": sprintf("a value listed in reference values tdx.rtmr.%s", [i]),
	}
}

# An image's entry (`tdx.images.<name>`, what `cgx measure tdx --reference-values` writes) holds
# a TD with its MRTD to that image's RTMRs, all of them together: RTMRs listed for one image do
# not pass with another image's MRTD. Only entries naming RTMR[1] and RTMR[2] (a kernel's)
# bind; images with other MRTDs, firmware-only entries, and TDs whose MRTD no image names are
# not affected (the lists above judge those).
tdx_images_of_mr_td := [img |
	some img in object.get(kind_ref, "images", {})
	img.mr_td == input.mr_td
	rtmr := object.get(img, "rtmr", {})
	rtmr["1"]
	rtmr["2"]
]

tdx_image_holds(img) if {
	every i, v in object.get(img, "rtmr", {}) {
		input.rtmr[to_number(i)] == v
	}
}

violations contains v if {
	input.kind == "tdx"
	count(tdx_images_of_mr_td) > 0
	not any_tdx_image_holds
	v := {
		"rule": "tdx_image_rtmr_mismatch",
		"claim": "executables",
		"code": 33,
		"value": sprintf("RTMRs %v", [input.rtmr]),
		"expected": sprintf("the RTMRs of an image with this MRTD: %v", [[object.get(img, "rtmr", {}) | some img in tdx_images_of_mr_td]]),
	}
}

any_tdx_image_holds if {
	some img in tdx_images_of_mr_td
	tdx_image_holds(img)
}

# ---------------------------------------------------------------- NVIDIA GPU

default gpu_driver := "none"

gpu_driver := input.driver_version

default gpu_vbios := "none"

gpu_vbios := input.vbios_version

# GPU reference values fail closed, as snp.measurements and tdx.mr_td do: driver_versions,
# vbios_versions and measurements each either list what is accepted or say, in writing, the
# string "any" to accept everything. A list that is missing, empty or of another shape is a
# violation of its own, so reference values that merely forget the GPU accept no GPU.
gpu_written_any(field) if object.get(kind_ref, field, null) == "any"

gpu_list_set(field) if {
	field != "measurements"
	allowed := object.get(kind_ref, field, [])
	is_array(allowed)
	count(allowed) > 0
}

gpu_list_set("measurements") if {
	golden := object.get(kind_ref, "measurements", {})
	is_object(golden)
	count(golden) > 0
}

gpu_unset_rules := {
	"driver_versions": {"rule": "gpu_driver_versions_not_set", "claim": "runtime-opaque"},
	"vbios_versions": {"rule": "gpu_vbios_versions_not_set", "claim": "executables"},
	"measurements": {"rule": "gpu_measurements_not_set", "claim": "executables"},
}

violations contains v if {
	input.kind == "nvidia"
	some field, r in gpu_unset_rules
	not gpu_written_any(field)
	not gpu_list_set(field)
	v := {
		"rule": r.rule,
		"claim": r.claim,
		"code": 33,
		"value": sprintf("nvidia.%s = %v", [field, object.get(kind_ref, field, "absent")]),
		"expected": sprintf("reference values nvidia.%s listing what is accepted, or \"any\" written to accept everything", [field]),
	}
}

violations contains v if {
	input.kind == "nvidia"
	allowed := object.get(kind_ref, "driver_versions", [])
	is_array(allowed)
	count(allowed) > 0
	not input.driver_version in allowed
	v := {
		"rule": "gpu_driver_not_allowed",
		"claim": "runtime-opaque",
		"code": 33,
		"value": gpu_driver,
		"expected": concat(" or ", allowed),
	}
}

violations contains v if {
	input.kind == "nvidia"
	allowed := object.get(kind_ref, "vbios_versions", [])
	is_array(allowed)
	count(allowed) > 0
	not input.vbios_version in allowed
	v := {
		"rule": "gpu_vbios_not_allowed",
		"claim": "executables",
		"code": 33,
		"value": gpu_vbios,
		"expected": concat(" or ", allowed),
	}
}

# CC mode, as the GPU signed it (docs/claims.md `cc_mode`): by default only `on`, one GPU
# passed through to one confidential VM. Protected PCIe and multi-GPU modes trust the NVLink
# fabric and switches; `unknown` is firmware this policy has not reviewed. DevTools mode has no
# signed field: it shows as measurements that differ from the golden ones (above and below).
gpu_cc_modes := object.get(kind_ref, "allowed_cc_modes", ["on"])

default gpu_cc_mode := "absent"

gpu_cc_mode := input.cc_mode

violations contains v if {
	input.kind == "nvidia"
	not gpu_cc_mode in gpu_cc_modes
	v := {
		"rule": "gpu_cc_mode_not_allowed",
		"claim": "configuration",
		"code": 96,
		"value": sprintf("cc_mode %v", [gpu_cc_mode]),
		"expected": sprintf("a CC mode listed in reference values nvidia.allowed_cc_modes: %v", [gpu_cc_modes]),
	}
}

# Device-chain revocation: the verifier checks OCSP responses when they come with the evidence
# (the collateral source fetches them from NVIDIA); unchecked revocation is not affirming unless
# the reference values waive it.
violations contains v if {
	input.kind == "nvidia"
	input.ocsp != "good"
	object.get(kind_ref, "require_ocsp", true)
	v := {
		"rule": "gpu_revocation_not_checked",
		"claim": "hardware",
		"code": 32,
		"value": sprintf("ocsp %s", [input.ocsp]),
		"expected": "OCSP status good for every certificate between the GPU leaf and the NVIDIA root",
	}
}

# Golden measurements (from verified RIMs; reference values nvidia.measurements: index -> allowed
# digests, or "any") are compared by the engine before evaluation, as NVIDIA's verifier reports
# `measres` (and, from a match alone, `dbgstat: disabled`: a GPU in DevTools mode, or running
# other firmware, measures differently):
# input.measurement_mismatches lists {index, value, expected} per index whose digest is not
# allowed (value "absent" when the evidence lacks the index). A set lookup over 64 measurements
# decides nothing, and walking it here cost more than verifying the evidence.
violations contains v if {
	input.kind == "nvidia"
	some m in input.measurement_mismatches
	v := {
		"rule": "gpu_measurement_mismatch",
		"claim": "executables",
		"code": 96,
		"value": sprintf("measurement %s=%s", [m.index, m.value]),
		"expected": concat(" or ", m.expected),
	}
}

# ---------------------------------------------------------------- sample, sampledevice

# As Trustee's default policy: sample evidence is affirming only when its svn is one the
# reference values list (sample.svn — kbs-client's `set-sample-reference-value svn 1` — or
# sampledevice.svn), contraindicated otherwise. Nothing signs it: this is for development.
violations contains v if {
	input.kind in sample_kinds
	not input.svn in object.get(kind_ref, "svn", [])
	v := {
		"rule": "sample_svn_not_listed",
		"claim": "hardware",
		"code": 97,
		"value": input.svn,
		"expected": sprintf("an svn listed in reference values %s.svn", [input.kind]),
	}
}

# ---------------------------------------------------------------- result

# The engine folds violations into the trust vector: each claim takes the highest code among its
# affirming value and the codes of the violations that name it (a fold in the engine costs a
# fraction of the same comprehension in Rego, and the outcome is the same).
result := {
	"affirming": affirming,
	"violations": [w | some w in violations],
}
