//! One compiled Rego program: parsed and compiled once to a regorus RVM program for one entry
//! point, then evaluated on VMs kept in a small pool (each VM already holds the program and the
//! data). Re-using a compiled engine is ≈5× faster than re-parsing and the RVM another ≈5×
//! (`../shared/CRATES.md`). The appraisal, release and (later) placement policies all run here.
//!
//! What a program can read is known from its instructions ([`Reads`]): the input only through
//! `LoadInput`, the data only through `LoadData` and data-document lookups. A caller need not
//! build an input no instruction loads (Trustee's `--allow-all` release policy reads
//! `data.plugin` only), and a program that reads nothing from outside itself (no input, no
//! data, no builtin: `default allow := true`) has one value whatever it is asked with; it is
//! evaluated once, when compiled, and that value is its answer from then on.

use std::sync::{Arc, Mutex};

use crate::Error;

/// VMs kept for reuse; more concurrent evaluations than this make VMs that are then dropped.
const POOL: usize = 64;

/// A Rego policy compiled for one entry point with its data.
pub(crate) struct RegoProgram {
    entry_point: String,
    compiled: regorus::CompiledPolicy,
    program: Arc<regorus::rvm::Program>,
    data: regorus::Value,
    vms: Mutex<Vec<regorus::rvm::RegoVM>>,
    reads: Reads,
    /// The entry point's value, for a closed program ([`Reads::closed`]) whose evaluation
    /// succeeded.
    constant: Option<regorus::Value>,
}

impl std::fmt::Debug for RegoProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegoProgram")
            .field("entry_point", &self.entry_point)
            .finish_non_exhaustive()
    }
}

impl RegoProgram {
    /// Compile `rego` (named `file` in messages) with `data` for `entry_point`
    /// (`data.<package>.<rule>`).
    pub(crate) fn compile(
        file: &str,
        rego: &str,
        data: serde_json::Value,
        entry_point: &str,
    ) -> Result<Self, Error> {
        let bad = |what: &str, e: &dyn std::fmt::Display| Error::Policy {
            detail: format!("{what}: {e}"),
        };
        let mut engine = regorus::Engine::new();
        engine
            .add_policy(file.to_string(), rego.to_string())
            .map_err(|e| bad("policy", &e))?;
        let data = regorus::Value::from(data);
        engine.add_data(data.clone()).map_err(|e| bad("data", &e))?;
        let compiled = engine
            .compile_with_entrypoint(&regorus::Rc::from(entry_point))
            .map_err(|e| bad("policy", &e))?;
        let program = regorus::languages::rego::compiler::Compiler::compile_from_policy(
            &compiled,
            &[entry_point],
        )
        .map_err(|e| bad("policy (RVM)", &e))?;
        let mut p = RegoProgram {
            entry_point: entry_point.to_string(),
            reads: Reads::of(&program),
            constant: None,
            compiled,
            program,
            data,
            vms: Mutex::new(Vec::new()),
        };
        // Evaluated now, on no input: a closed program cannot tell. One that fails is left to
        // fail, with its error, on every evaluation.
        if p.reads.closed() {
            p.constant = p.run(regorus::Value::Undefined, None).ok();
        }
        Ok(p)
    }

    /// The value every evaluation gives, where the program is closed ([`Reads::closed`]).
    #[cfg(test)]
    pub(crate) fn constant(&self) -> Option<&regorus::Value> {
        self.constant.as_ref()
    }

    /// What the program can read: an input or data it cannot read need not be built.
    pub(crate) fn reads(&self) -> Reads {
        self.reads
    }

    /// Evaluate the entry point on `input`.
    pub(crate) fn eval(&self, input: regorus::Value) -> Result<regorus::Value, Error> {
        self.run(input, None)
    }

    /// Evaluate the entry point on `input` with `data` in place of the compiled data, for
    /// policies whose data carries the request (Trustee's release policies read the plugin and
    /// the resource path there). A program is evaluated one way or the other, never both: its
    /// pooled VMs keep the last data they were given.
    pub(crate) fn eval_with_data(
        &self,
        input: regorus::Value,
        data: regorus::Value,
    ) -> Result<regorus::Value, Error> {
        self.run(input, Some(data))
    }

    fn run(
        &self,
        input: regorus::Value,
        data: Option<regorus::Value>,
    ) -> Result<regorus::Value, Error> {
        if let Some(v) = &self.constant {
            return Ok(v.clone());
        }
        let failed = |e: &dyn std::fmt::Display| Error::Policy {
            detail: format!("evaluation: {e}"),
        };
        let pooled = self.vms.lock().ok().and_then(|mut p| p.pop());
        let mut vm = match pooled {
            Some(vm) => vm,
            None => {
                let mut vm = regorus::rvm::RegoVM::new_with_policy(self.compiled.clone());
                vm.load_program(self.program.clone());
                vm.set_data(self.data.clone()).map_err(|e| failed(&e))?;
                vm
            }
        };
        if let Some(data) = data
            && self.reads.data
        {
            vm.set_data(data).map_err(|e| failed(&e))?;
        }
        vm.set_input(input);
        let out = vm
            .execute_entry_point_by_name(&self.entry_point)
            .map_err(|e| failed(&e));
        if let Ok(mut pool) = self.vms.lock()
            && pool.len() < POOL
        {
            pool.push(vm);
        }
        out
    }
}

/// What a program's instructions can read from outside the program. Rules and functions it
/// calls are its own instructions. The match names every instruction, so a regorus upgrade
/// that adds one does not compile until it is placed here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reads {
    /// The input (`LoadInput`, the RVM's one way to it).
    pub input: bool,
    /// The data (`LoadData`, data-document lookups).
    pub data: bool,
    /// Anything else from outside: context, metadata, builtins (time, randomness, ...), the
    /// host.
    pub world: bool,
}

impl Reads {
    fn of(program: &regorus::rvm::Program) -> Self {
        use regorus::rvm::Instruction as I;
        let mut r = Reads {
            input: false,
            data: false,
            world: false,
        };
        for i in &program.instructions {
            match i {
                I::LoadInput { .. } => r.input = true,
                I::LoadData { .. } | I::VirtualDataDocumentLookup { .. } => r.data = true,
                // Azure Policy's conditions are not Rego's, and not worth proving pure here.
                I::LoadContext { .. }
                | I::LoadMetadata { .. }
                | I::BuiltinCall { .. }
                | I::HostAwait { .. }
                | I::PolicyCondition { .. } => r.world = true,
                I::Load { .. }
                | I::LoadTrue { .. }
                | I::LoadFalse { .. }
                | I::LoadNull { .. }
                | I::LoadBool { .. }
                | I::Move { .. }
                | I::Add { .. }
                | I::Sub { .. }
                | I::Mul { .. }
                | I::Div { .. }
                | I::Mod { .. }
                | I::Eq { .. }
                | I::Ne { .. }
                | I::Lt { .. }
                | I::Le { .. }
                | I::Gt { .. }
                | I::Ge { .. }
                | I::And { .. }
                | I::Or { .. }
                | I::Not { .. }
                | I::FunctionCall { .. }
                | I::Return { .. }
                | I::ObjectSet { .. }
                | I::ObjectCreate { .. }
                | I::Index { .. }
                | I::IndexLiteral { .. }
                | I::ChainedIndex { .. }
                | I::ArrayNew { .. }
                | I::ArrayPush { .. }
                | I::ArrayPushDefined { .. }
                | I::ArrayCreate { .. }
                | I::SetNew { .. }
                | I::SetAdd { .. }
                | I::SetCreate { .. }
                | I::Contains { .. }
                | I::Count { .. }
                | I::AssertEq { .. }
                | I::Guard { .. }
                | I::ReturnUndefinedIfNotTrue { .. }
                | I::CoalesceUndefinedToNull { .. }
                | I::LoopStart { .. }
                | I::LoopNext { .. }
                | I::CallRule { .. }
                | I::RuleInit { .. }
                | I::DestructuringSuccess { .. }
                | I::RuleReturn { .. }
                | I::Halt { .. }
                | I::ComprehensionBegin { .. }
                | I::ComprehensionYield { .. }
                | I::ComprehensionEnd { .. }
                | I::LogicalBlockStart { .. }
                | I::AllOfNext { .. }
                | I::AnyOfNext { .. }
                | I::LogicalBlockEnd { .. } => {}
            }
        }
        r
    }

    /// Nothing from outside: every evaluation gives the same value.
    pub(crate) fn closed(self) -> bool {
        !(self.input || self.data || self.world)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compile(rego: &str) -> RegoProgram {
        RegoProgram::compile(
            "t.rego",
            rego,
            serde_json::json!({"allow_sim": false}),
            "data.policy.allow",
        )
        .unwrap()
    }

    /// The same program evaluated on its VM, the fold bypassed.
    fn on_vm(p: &RegoProgram, input: regorus::Value) -> regorus::Value {
        let mut vm = regorus::rvm::RegoVM::new_with_policy(p.compiled.clone());
        vm.load_program(p.program.clone());
        vm.set_data(p.data.clone()).unwrap();
        vm.set_input(input);
        vm.execute_entry_point_by_name(&p.entry_point).unwrap()
    }

    #[test]
    fn constant_policies_are_folded() {
        for (rego, allowed) in [
            // Both assignment spellings; `default allow = false` alone denies everything.
            ("package policy\ndefault allow := true\n", true),
            ("package policy\ndefault allow := false\n", false),
            ("package policy\ndefault allow = true\n", true),
            ("package policy\ndefault allow = false\n", false),
        ] {
            let p = compile(rego);
            assert_eq!(p.constant(), Some(&regorus::Value::Bool(allowed)), "{rego}");
            assert_eq!(
                on_vm(&p, regorus::Value::Undefined),
                regorus::Value::Bool(allowed)
            );
        }
    }

    #[test]
    fn a_closed_program_with_rules_and_functions_folds_to_what_the_vm_gives() {
        // Its own rules, by name or through `data.policy`, are its own instructions.
        let p = compile(
            "package policy\ndefault allow := false\nallow if data.policy.other\nother := true\n",
        );
        assert_eq!(p.constant(), Some(&regorus::Value::Bool(true)));
        let rego = "package policy\nimport rego.v1\ndefault allow := false\n\
                    f(x) := x + 1\nlimit := 3\n\
                    allow if { f(1) == 2; other; every x in [1, 2] { x < limit } }\nother := true\n";
        let p = compile(rego);
        assert_eq!(p.constant(), Some(&regorus::Value::Bool(true)));
        let input = regorus::Value::from(serde_json::json!({"anything": 1}));
        assert_eq!(p.eval(input.clone()).unwrap(), on_vm(&p, input));
    }

    /// Anything that reads the world stays evaluated each time, and answers as before.
    #[test]
    fn input_data_and_builtins_are_not_folded() {
        let input = regorus::Value::from(serde_json::json!({"ok": true, "n": 2}));
        for rego in [
            "package policy\ndefault allow := false\nallow if input.ok\n",
            "package policy\nimport rego.v1\nallow if { some k, _ in input; k == \"ok\" }\n",
            "package policy\ndefault allow := false\nallow if not data.allow_sim\n",
            "package policy\ndefault allow := false\nallow if sprintf(\"%d\", [1]) == \"1\"\n",
            "package policy\ndefault allow := false\nallow if count(\"abc\") == 3\n",
            "package policy\ndefault allow := false\nallow if upper(\"a\") == \"A\"\n",
        ] {
            let p = compile(rego);
            assert_eq!(p.constant(), None, "{rego}");
            assert_eq!(
                p.eval(input.clone()).unwrap(),
                regorus::Value::Bool(true),
                "{rego}"
            );
        }
        let p = compile("package policy\ndefault allow := false\nallow if input.ok\n");
        let refused = regorus::Value::from(serde_json::json!({"ok": false}));
        assert_eq!(p.eval(refused).unwrap(), regorus::Value::Bool(false));
    }

    /// Every way a Rego policy reaches its input or data shows in what it reads.
    #[test]
    fn every_way_to_the_input_or_data_is_seen() {
        let input_forms = [
            "allow if { some p in input.submods; p.ok }",
            "allow if { count([x | some x in input.items]) > 0 }",
            "allow if { every x in input.items { x > 0 } }",
            "f(v) := v.ok\nallow if f(input)",
            "x := input\nallow if x.ok",
            "allow if { input[k]; k == \"ok\" }",
        ];
        for form in input_forms {
            let p = compile(&format!("package policy\nimport rego.v1\n{form}\n"));
            assert!(p.reads().input, "{form}");
        }
        let p =
            compile("package policy\nimport rego.v1\nimport input.submods as s\nallow if s.cpu0\n");
        assert!(p.reads().input);
        let data_forms = [
            "allow if data.allow_sim == false",
            "allow if { some k; data.cfg[k] == 1 }",
            "allow if { x := \"n\"; data.cfg[x] == 1 }",
        ];
        for form in data_forms {
            let p = compile(&format!("package policy\nimport rego.v1\n{form}\n"));
            assert!(p.reads().data, "{form}");
            assert!(!p.reads().input, "{form}");
            assert_eq!(p.constant(), None, "{form}");
        }
    }
}
