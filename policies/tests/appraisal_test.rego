# Tests of the default appraisal policy: `cgx policy test` runs every test_* rule here.
package cgx.appraisal_test

import rego.v1

import data.cgx.appraisal

refs := {
	"allow_sim": false,
	"snp": {
		"measurements": ["aa"],
		"min_tcb": {"genoa": {"bootloader": 9, "tee": 0, "snp": 20, "microcode": 70}},
	},
	"tdx": {"allowed_tcb_status": ["UpToDate"], "mr_td": ["bb"], "rtmr": {"0": ["r0"]}},
	"nvidia": {
		"driver_versions": ["550.90.07"],
		"vbios_versions": ["96.00.9F.00.01"],
		"measurements": {"2": ["m2"]},
	},
}

snp := {
	"schema": "cgx.claims.v1", "kind": "snp", "sim": false, "debug": false,
	"product": "genoa", "measurement": "aa", "policy": "0x30000", "vmpl": 0,
	"reported_tcb": {"bootloader": 9, "tee": 0, "snp": 23, "microcode": 72},
	"smt_enabled": true, "migration_agent_allowed": false, "platform_info": "0x1",
}

tdx := {
	"schema": "cgx.claims.v1", "kind": "tdx", "sim": false, "debug": false,
	"tcb_status": "UpToDate", "advisory_ids": [], "mr_td": "bb", "rtmr": ["r0", "r1", "r2", "r3"],
}

gpu := {
	"schema": "cgx.claims.v1", "kind": "nvidia", "sim": false, "debug": false,
	"driver_version": "550.90.07", "vbios_version": "96.00.9F.00.01",
	"measurements": {"1": "m1", "2": "m2"}, "ocsp": "good", "cc_mode": "on",
	"measurement_mismatches": [],
}

# The trust vector as the engine folds it: per claim, the highest code.
fold(out) := {claim: code |
	some claim, affirm in out.affirming
	code := max(array.concat([affirm], [w.code | some w in out.violations; w.claim == claim]))
}

result(claims) := r if {
	out := appraisal.result with input as claims with data.reference as refs
	r := {"trust_vector": fold(out), "violations": out.violations}
}

rules(r) := {v.rule | some v in r.violations}

test_snp_affirming if {
	r := result(snp)
	r.trust_vector.executables == 2
	r.trust_vector.hardware == 2
	r.trust_vector.configuration == 2
	count(r.violations) == 0
}

test_snp_debug_is_contraindicated if {
	r := result(object.union(snp, {"debug": true}))
	r.trust_vector.configuration == 96
	"debug_forbidden" in rules(r)
}

test_snp_unknown_measurement_is_unrecognized if {
	r := result(object.union(snp, {"measurement": "cc"}))
	r.trust_vector.executables == 33
	some v in r.violations
	v.rule == "snp_measurement_not_allowed"
	v.value == "cc"
}

test_snp_old_tcb_names_the_field if {
	r := result(object.union(snp, {"reported_tcb": {"bootloader": 9, "tee": 0, "snp": 19, "microcode": 72}}))
	r.trust_vector.hardware == 96
	some v in r.violations
	v.rule == "snp_tcb_below_minimum"
	v.value == "snp=19"
}

test_snp_migration_agent_forbidden if {
	r := result(object.union(snp, {"migration_agent_allowed": true}))
	r.trust_vector.configuration == 96
}

test_sim_is_refused if {
	r := result(object.union(snp, {"sim": true}))
	r.trust_vector.hardware == 97
	"sim_evidence_forbidden" in rules(r)
}

test_sim_allowed_is_only_a_warning if {
	out := appraisal.result with input as object.union(snp, {"sim": true})
		with data.reference as object.union(refs, {"allow_sim": true})
	fold(out).hardware == 32
}

test_sim_affirming_only_by_explicit_development_opt_in if {
	out := appraisal.result with input as object.union(snp, {"sim": true})
		with data.reference as object.union(refs, {"allow_sim": "affirming"})
	count(out.violations) == 0
	bad := appraisal.result with input as object.union(snp, {"sim": true})
		with data.reference as object.union(refs, {"allow_sim": "yes"})
	fold(bad).hardware == 97
}

test_tdx_affirming if {
	r := result(tdx)
	count(r.violations) == 0
	r.trust_vector.executables == 2
}

test_tdx_out_of_date_is_a_warning if {
	r := result(object.union(tdx, {"tcb_status": "OutOfDate", "advisory_ids": ["INTEL-SA-00837"]}))
	r.trust_vector.hardware == 32
	some v in r.violations
	v.rule == "tdx_tcb_status_not_allowed"
	contains(v.value, "INTEL-SA-00837")
}

test_tdx_revoked_is_contraindicated if {
	r := result(object.union(tdx, {"tcb_status": "Revoked"}))
	r.trust_vector.hardware == 96
}

test_tdx_debug_and_rtmr if {
	r := result(object.union(tdx, {"debug": true, "rtmr": ["x", "r1", "r2", "r3"]}))
	r.trust_vector.configuration == 96
	"tdx_rtmr_not_allowed" in rules(r)
}

# Two images as `cgx measure tdx --reference-values` writes them: each MRTD with its RTMRs.
tdx_images_refs := object.union(refs, {"tdx": {
	"allowed_tcb_status": ["UpToDate"],
	"mr_td": ["bb", "cc"],
	"rtmr": {"1": ["r1", "s1"], "2": ["r2", "s2"]},
	"images": {
		"a": {"mr_td": "bb", "rtmr": {"1": "r1", "2": "r2"}},
		"b": {"mr_td": "cc", "rtmr": {"1": "s1", "2": "s2"}},
		"a-firmware-only": {"mr_td": "bb", "rtmr": {}},
		"a-firmware-replayed": {"mr_td": "bb", "rtmr": {"0": "r0"}},
	},
}})

tdx_images_result(claims) := r if {
	out := appraisal.result with input as claims with data.reference as tdx_images_refs
	r := {"trust_vector": fold(out), "violations": out.violations}
}

test_tdx_image_affirming if {
	r := tdx_images_result(tdx)
	count(r.violations) == 0
	r.trust_vector.executables == 2
}

test_tdx_image_rtmrs_of_another_image_are_refused if {
	# Every value is listed, but RTMR[2] is image b's while the MRTD is image a's (an entry for
	# a's firmware alone, without RTMRs, binds nothing and lets nothing through).
	r := tdx_images_result(object.union(tdx, {"rtmr": ["r0", "r1", "s2", "r3"]}))
	rules(r) == {"tdx_image_rtmr_mismatch"}
	r.trust_vector.executables == 33
}

test_gpu_affirming if {
	r := result(gpu)
	count(r.violations) == 0
}

test_gpu_measurement_mismatch_is_contraindicated if {
	mismatch := {"index": "2", "value": "evil", "expected": ["m2"]}
	r := result(object.union(gpu, {"measurement_mismatches": [mismatch]}))
	r.trust_vector.executables == 96
	some v in r.violations
	v.rule == "gpu_measurement_mismatch"
	v.value == "measurement 2=evil"
	v.expected == "m2"
}

test_gpu_unchecked_revocation_is_a_warning if {
	r := result(object.union(gpu, {"ocsp": "not_checked"}))
	r.trust_vector.hardware == 32
	some v in r.violations
	v.rule == "gpu_revocation_not_checked"
}

test_gpu_unchecked_revocation_waived_by_reference_values if {
	out := appraisal.result with input as object.union(gpu, {"ocsp": "not_checked"})
		with data.reference as object.union(refs, {"nvidia": object.union(refs.nvidia, {"require_ocsp": false})})
	count(out.violations) == 0
}

test_gpu_driver_not_allowed if {
	r := result(object.union(gpu, {"driver_version": "535.1"}))
	r.trust_vector["runtime-opaque"] == 33
}

# Reference values that forget the GPU accept no GPU: each missing or empty list is named.
test_gpu_without_reference_lists_is_refused if {
	out := appraisal.result with input as gpu
		with data.reference as object.union(object.remove(refs, ["nvidia"]), {"nvidia": {"require_ocsp": true}})
	rules(out) == {
		"gpu_driver_versions_not_set",
		"gpu_vbios_versions_not_set",
		"gpu_measurements_not_set",
	}
	fold(out).executables == 33
	fold(out)["runtime-opaque"] == 33
	some v in out.violations
	v.rule == "gpu_measurements_not_set"
	v.value == "nvidia.measurements = absent"
}

test_gpu_empty_reference_lists_are_refused if {
	out := appraisal.result with input as gpu
		with data.reference as {"nvidia": {"driver_versions": [], "vbios_versions": [], "measurements": {}}}
	rules(out) == {
		"gpu_driver_versions_not_set",
		"gpu_vbios_versions_not_set",
		"gpu_measurements_not_set",
	}
	# No reference values at all: the same.
	none := appraisal.result with input as gpu with data.reference as {}
	count({v | some v in none.violations; endswith(v.rule, "_not_set")}) == 3
}

# "any", written, waives a list; nothing else does (a misspelt waiver is not one).
test_gpu_any_written_accepts_every_value if {
	out := appraisal.result with input as object.union(gpu, {"driver_version": "1.2.3", "vbios_version": "x"})
		with data.reference as {"nvidia": {"driver_versions": "any", "vbios_versions": "any", "measurements": "any"}}
	count(out.violations) == 0
	bad := appraisal.result with input as gpu
		with data.reference as {"nvidia": {"driver_versions": "ANY", "vbios_versions": "all", "measurements": "any"}}
	rules(bad) == {"gpu_driver_versions_not_set", "gpu_vbios_versions_not_set"}
}

test_gpu_not_in_cc_mode_on_is_contraindicated if {
	every mode in ["ppcie", "mpt", "unknown"] {
		r := result(object.union(gpu, {"cc_mode": mode}))
		r.trust_vector.configuration == 96
		some v in r.violations
		v.rule == "gpu_cc_mode_not_allowed"
		v.value == sprintf("cc_mode %s", [mode])
	}
	# Claims without the field (written before it existed) are not taken as `on`.
	r := result(object.remove(gpu, ["cc_mode"]))
	some v in r.violations
	v.rule == "gpu_cc_mode_not_allowed"
	v.value == "cc_mode absent"
}

test_gpu_cc_mode_allowed_only_by_a_written_list if {
	ok := appraisal.result with input as object.union(gpu, {"cc_mode": "ppcie"})
		with data.reference as object.union(refs, {"nvidia": object.union(refs.nvidia, {"allowed_cc_modes": ["on", "ppcie"]})})
	count(ok.violations) == 0
}

# DevTools mode signs no field of its own: its measured configuration differs from the golden
# measurements NVIDIA's RIMs give for CC on, and that mismatch refuses it.
test_gpu_devtools_measurements_are_contraindicated if {
	devtools := {"index": "2", "value": "devtools", "expected": ["m2"]}
	r := result(object.union(gpu, {"measurement_mismatches": [devtools]}))
	r.trust_vector.executables == 96
	"gpu_measurement_mismatch" in rules(r)
}

test_snp_vmpl_above_zero_is_refused_by_default if {
	r := result(object.union(snp, {"vmpl": 1}))
	r.trust_vector.configuration == 32
	some v in r.violations
	v.rule == "snp_vmpl_too_high"
	v.value == 1
	v.expected == "VMPL <= 0 (reference values snp.max_vmpl)"
	ok := appraisal.result with input as object.union(snp, {"vmpl": 1})
		with data.reference as object.union(refs, {"snp": object.union(refs.snp, {"max_vmpl": 1})})
	count(ok.violations) == 0
	# A limit that is not a number raises nothing.
	text := appraisal.result with input as object.union(snp, {"vmpl": 1})
		with data.reference as object.union(refs, {"snp": object.union(refs.snp, {"max_vmpl": "3"})})
	"snp_vmpl_too_high" in rules(text)
}

sample := {"schema": "cgx.claims.v1", "kind": "sample", "sim": true, "debug": true, "svn": "1"}

test_sample_without_reference_values_is_contraindicated if {
	r := result(sample)
	r.trust_vector.hardware == 97
	rules(r) == {"sample_svn_not_listed"}
}

test_sample_with_its_svn_listed_is_affirming if {
	r := appraisal.result with input as sample with data.reference as {"sample": {"svn": ["1"]}}
	r.affirming.hardware == 2
	count(r.violations) == 0
}

test_sample_device_reads_its_own_reference_values if {
	device := object.union(sample, {"kind": "sampledevice", "svn": "2"})
	r := appraisal.result with input as device with data.reference as {"sample": {"svn": ["1", "2"]}}
	some v in r.violations
	v.rule == "sample_svn_not_listed"
	v.expected == "an svn listed in reference values sampledevice.svn"
	ok := appraisal.result with input as device with data.reference as {"sampledevice": {"svn": ["2"]}}
	count(ok.violations) == 0
}
