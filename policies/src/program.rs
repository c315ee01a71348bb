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
//!
//! Every program runs under the limits of who wrote it ([`Trust`], [`Limits`]): an instruction
//! budget and a wall-clock limit always; for an untrusted one also the builtin allow-list and the
//! literal check when compiled, its `*` rewritten into a bounded multiplication, and an
//! allocation budget per evaluation ([`crate::limits`]). A limit reached is
//! [`Error::Limit`], the evaluation's refusal, never a panic.

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

use crate::Error;
use crate::limits::{self, BudgetScope, Exceeded, Limits, Trust};

/// VMs kept for reuse; more concurrent evaluations than this make VMs that are then dropped.
const POOL: usize = 64;

/// A Rego policy compiled for one entry point with its data.
pub(crate) struct RegoProgram {
    entry_point: String,
    limits: Limits,
    /// Every builtin the program's instructions call, by name (before `*` was rewritten).
    builtins: Vec<String>,
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
    /// Compile the operator's `rego` (named `file` in messages) with `data` for `entry_point`
    /// (`data.<package>.<rule>`).
    pub(crate) fn compile(
        file: &str,
        rego: &str,
        data: serde_json::Value,
        entry_point: &str,
    ) -> Result<Self, Error> {
        Self::compile_as(file, rego, data, entry_point, Trust::Operator)
    }

    /// Compile `rego` written by `trust`: an untrusted text is checked for huge number
    /// literals before it is parsed, and its program for builtins off the allow-list.
    pub(crate) fn compile_as(
        file: &str,
        rego: &str,
        data: serde_json::Value,
        entry_point: &str,
        trust: Trust,
    ) -> Result<Self, Error> {
        let bad = |what: &str, e: &dyn std::fmt::Display| Error::Policy {
            detail: format!("{what}: {e}"),
        };
        if trust == Trust::Untrusted {
            limits::check_source(rego).map_err(|e| bad("policy", &e))?;
        }
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
        let reads = Reads::of(&program);
        let builtins = builtins_of(&program);
        let program = match trust {
            Trust::Operator => program,
            Trust::Untrusted => bounded(program, &builtins).map_err(|e| bad("policy", &e))?,
        };
        let mut p = RegoProgram {
            entry_point: entry_point.to_string(),
            limits: Limits::of(trust),
            builtins,
            reads,
            constant: None,
            compiled,
            program,
            data,
            vms: Mutex::new(Vec::new()),
        };
        // Evaluated now, on no input: a closed program cannot tell. One that fails is left to
        // fail, with its error, on every evaluation. An untrusted one only where it is flat (no
        // loop, call or collection built), so the fold, run where it is compiled, is cheap.
        if p.reads.closed() && (trust == Trust::Operator || p.reads.flat) {
            p.constant = p.run(regorus::Value::Undefined, None).ok();
        }
        Ok(p)
    }

    /// Whether every evaluation is answered from the fold, without running.
    pub(crate) fn is_constant(&self) -> bool {
        self.constant.is_some()
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

    /// The builtins the program calls, by name.
    pub(crate) fn builtins(&self) -> &[String] {
        &self.builtins
    }

    /// The limits each evaluation runs under.
    pub(crate) fn limits(&self) -> Limits {
        self.limits
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
                vm.set_max_instructions(self.limits.max_instructions);
                vm.set_execution_timer_config(Some(regorus::utils::limits::ExecutionTimerConfig {
                    limit: self.limits.time,
                    check_interval: TIMER_INTERVAL,
                }));
                vm
            }
        };
        if let Some(data) = data
            && self.reads.data
        {
            vm.set_data(data).map_err(|e| failed(&e))?;
        }
        vm.set_input(input);
        let budget = BudgetScope::arm(self.limits.allocation);
        let out = vm
            .execute_entry_point_by_name(&self.entry_point)
            .map_err(|e| {
                use regorus::rvm::vm::VmError as V;
                match (&e, budget.hit()) {
                    (V::InstructionLimitExceeded { limit, .. }, _) => {
                        Error::Limit(Exceeded::Instructions(*limit))
                    }
                    (V::TimeLimitExceeded { limit, .. }, _) => Error::Limit(Exceeded::Time(*limit)),
                    (_, Some(hit)) => Error::Limit(hit),
                    _ => failed(&e),
                }
            });
        // A guard's refusal reaches the VM as a builtin error, which Rego turns into an
        // undefined value and evaluation goes on: any limit reached refuses the whole answer.
        let out = match (out, budget.hit()) {
            (Err(Error::Limit(e)), _) => Err(Error::Limit(e)),
            (_, Some(hit)) => Err(Error::Limit(hit)),
            (out, None) => out,
        };
        drop(budget);
        if let Ok(mut pool) = self.vms.lock()
            && pool.len() < POOL
        {
            pool.push(vm);
        }
        out
    }
}

/// Instructions between two looks at the clock: a few microseconds of work.
const TIMER_INTERVAL: NonZeroU32 = NonZeroU32::MIN.saturating_add(63);

/// The builtins `program` calls, by name, each once.
fn builtins_of(program: &regorus::rvm::Program) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for i in &program.instructions {
        if let regorus::rvm::Instruction::BuiltinCall { params_index } = i
            && let Some(name) = program
                .instruction_data
                .get_builtin_call_params(*params_index)
                .and_then(|p| program.get_builtin_info(p.builtin_index))
                .map(|b| b.name.clone())
            && !names.contains(&name)
        {
            names.push(name);
        }
    }
    names
}

/// An untrusted program made bounded: every builtin it calls must be on the allow-list and is
/// called through its guard (charged to the evaluation's allocation budget), and every `*`
/// becomes the guarded multiplication ([`limits`]).
fn bounded(
    program: Arc<regorus::rvm::Program>,
    builtins: &[String],
) -> Result<Arc<regorus::rvm::Program>, String> {
    use regorus::rvm::Instruction as I;
    for name in builtins {
        limits::check_builtin(name)?;
    }
    let mut program = Arc::try_unwrap(program).unwrap_or_else(|shared| (*shared).clone());
    // The table may name builtins no instruction calls: each gets its guard, or a refusal.
    let mut resolved = Vec::with_capacity(program.builtin_info_table.len() + 1);
    for info in &program.builtin_info_table {
        limits::check_builtin(&info.name)?;
        resolved.push(
            limits::guard_for(&info.name).ok_or_else(|| format!("`{}` has no guard", info.name))?,
        );
    }
    let muls = program
        .instructions
        .iter()
        .any(|i| matches!(i, I::Mul { .. }));
    if muls {
        let index = program.add_builtin_info(regorus::rvm::program::BuiltinInfo {
            name: limits::MUL.to_string(),
            num_args: 2,
        });
        resolved.push(limits::mul_guard());
        for n in 0..program.instructions.len() {
            if let Some(&I::Mul { dest, left, right }) = program.instructions.get(n) {
                let params_index = program.add_builtin_call_params(
                    regorus::rvm::instructions::BuiltinCallParams {
                        dest,
                        builtin_index: index,
                        num_args: 2,
                        args: [left, right, 0, 0, 0, 0, 0, 0],
                    },
                );
                if let Some(slot) = program.instructions.get_mut(n) {
                    *slot = I::BuiltinCall { params_index };
                }
            }
        }
    }
    // The size guard: each value the program makes is measured ([`size_guards`]).
    let size = program.add_builtin_info(regorus::rvm::program::BuiltinInfo {
        name: limits::SIZE.to_string(),
        num_args: 1,
    });
    resolved.push(limits::size_guard());
    program.resolved_builtins = resolved;
    size_guards(&mut program, size)?;
    Ok(Arc::new(program))
}

/// Place a size guard ([`limits::MAX_VALUE_NODES`]) after every instruction of `program` that
/// makes a value it can then read, so that no such value is larger, written out, than the
/// limit: the shared-structure bomb (`a1 := [a0, a0]`, ... `a64`) stops at the 17th doubling
/// instead of making one comparison, set insertion or key lookup that runs for ever.
///
/// Guarded: array, set and object literals (`ArrayCreate`, `SetCreate`, `ObjectCreate`), a
/// finished comprehension (`ComprehensionEnd`, its result), a rule's or a function's value as
/// it is read (`CallRule` — a partial rule's set or object, accumulated by `SetAdd` and
/// `ObjectSet`, is read only so —, `FunctionCall`) and a data document assembled from rules
/// (`VirtualDataDocumentLookup`); builtins measure their own output ([`limits`]). Everything
/// else only hands on values already measured or parts of them (loads, moves, indexing, loop
/// variables), or the input and data, which the services bound, or scalars. So each value a
/// yield, `SetAdd` or `ObjectSet` adds to a collection being accumulated is within the limit,
/// and its insertion compares values no larger; the collection is measured once, when it is
/// finished and can be read, so building one of n elements costs O(n), not O(n²).
///
/// A guard is an instruction placed right after the one it watches, reached by falling
/// through from it; every jump target, rule body, entry point and loop bound is moved with
/// the instruction it named. A comprehension's end address (which the VM jumps to as
/// `end - 1`, then steps) is moved onto its guard, so every way out of a comprehension passes
/// it. A guard measures its register and writes it back unchanged: a VM that lands on one it
/// was not meant to changes nothing.
fn size_guards(program: &mut regorus::rvm::Program, size: u16) -> Result<(), String> {
    use regorus::rvm::Instruction as I;
    let data = &program.instruction_data;
    let mut guards: Vec<Option<u8>> = Vec::with_capacity(program.instructions.len());
    for (pc, i) in program.instructions.iter().enumerate() {
        let missing = || format!("instruction {pc} without its parameters");
        guards.push(match *i {
            I::ArrayCreate { params_index } => Some(
                data.array_create_params
                    .get(usize::from(params_index))
                    .ok_or_else(missing)?
                    .dest,
            ),
            I::SetCreate { params_index } => Some(
                data.set_create_params
                    .get(usize::from(params_index))
                    .ok_or_else(missing)?
                    .dest,
            ),
            I::ObjectCreate { params_index } => Some(
                data.object_create_params
                    .get(usize::from(params_index))
                    .ok_or_else(missing)?
                    .dest,
            ),
            I::VirtualDataDocumentLookup { params_index } => Some(
                data.virtual_data_document_lookup_params
                    .get(usize::from(params_index))
                    .ok_or_else(missing)?
                    .dest,
            ),
            I::FunctionCall { params_index } => Some(
                data.function_call_params
                    .get(usize::from(params_index))
                    .ok_or_else(missing)?
                    .dest,
            ),
            I::CallRule { dest, .. } => Some(dest),
            I::ComprehensionEnd {} => {
                // The comprehension it ends: the one whose end address follows it.
                let result = data
                    .comprehension_begin_params
                    .iter()
                    .filter(|p| usize::from(p.comprehension_end) == pc + 1)
                    .map(|p| p.result_reg)
                    .collect::<Vec<_>>();
                match result[..] {
                    [result] => Some(result),
                    _ => return Err(format!("a comprehension end at {pc} without its start")),
                }
            }
            _ => None,
        });
    }
    // Every comprehension ends with its own `ComprehensionEnd` just before its end address.
    for p in &data.comprehension_begin_params {
        let end = usize::from(p.comprehension_end);
        if !matches!(
            end.checked_sub(1).and_then(|e| program.instructions.get(e)),
            Some(I::ComprehensionEnd {})
        ) {
            return Err(format!("a comprehension ending at {end} without its end"));
        }
    }
    let old_len = program.instructions.len();
    let new_len = old_len + guards.iter().filter(|g| g.is_some()).count();
    if new_len > regorus::rvm::Program::MAX_INSTRUCTIONS {
        return Err("the policy is too large once bounded".into());
    }
    let old: Vec<I> = std::mem::take(&mut program.instructions);
    let old_spans = std::mem::take(&mut program.instruction_spans);
    // The new address of each old one (and of one past the end).
    let mut moved = Vec::with_capacity(old_len + 1);
    let mut instructions = Vec::with_capacity(new_len);
    let mut spans = Vec::with_capacity(new_len);
    for (pc, (i, guard)) in old.into_iter().zip(guards).enumerate() {
        let span = old_spans.get(pc).cloned().flatten();
        moved.push(instructions.len());
        instructions.push(i);
        spans.push(span.clone());
        if let Some(register) = guard {
            let params_index =
                program.add_builtin_call_params(regorus::rvm::instructions::BuiltinCallParams {
                    dest: register,
                    builtin_index: size,
                    num_args: 1,
                    args: [register, 0, 0, 0, 0, 0, 0, 0],
                });
            instructions.push(I::BuiltinCall { params_index });
            spans.push(span);
        }
    }
    moved.push(instructions.len());
    let to = |pc: usize| -> Result<usize, String> {
        moved
            .get(pc)
            .copied()
            .ok_or_else(|| format!("a jump to {pc}, past the program's end"))
    };
    let to16 = |pc: u16| -> Result<u16, String> {
        u16::try_from(to(usize::from(pc))?)
            .map_err(|_| "the policy is too large once bounded".into())
    };
    let to32 = |pc: u32| -> Result<u32, String> {
        let pc = usize::try_from(pc).map_err(|_| "a jump out of range".to_string())?;
        u32::try_from(to(pc)?).map_err(|_| "the policy is too large once bounded".into())
    };
    for i in &mut instructions {
        match i {
            I::LoopNext {
                body_start,
                loop_end,
            } => {
                *body_start = to16(*body_start)?;
                *loop_end = to16(*loop_end)?;
            }
            I::LogicalBlockStart { end_pc, .. }
            | I::AllOfNext { end_pc, .. }
            | I::AnyOfNext { end_pc, .. } => *end_pc = to16(*end_pc)?,
            _ => {}
        }
    }
    program.instructions = instructions;
    program.instruction_spans = spans;
    for p in &mut program.instruction_data.loop_params {
        p.body_start = to16(p.body_start)?;
        p.loop_end = to16(p.loop_end)?;
    }
    for p in &mut program.instruction_data.comprehension_begin_params {
        p.body_start = to16(p.body_start)?;
        // Onto the guard after the `ComprehensionEnd` (checked above to be just before).
        let end = usize::from(p.comprehension_end).saturating_sub(1);
        p.comprehension_end = u16::try_from(to(end)? + 1)
            .map_err(|_| "the policy is too large once bounded".to_string())?;
    }
    for rule in &mut program.rule_infos {
        let definitions = rule
            .definitions
            .iter()
            .map(|bodies| bodies.iter().map(|pc| to32(*pc)).collect())
            .collect::<Result<Vec<Vec<u32>>, String>>()?;
        rule.definitions = regorus::Rc::new(definitions);
        for block in rule.destructuring_blocks.iter_mut().flatten() {
            *block = to32(*block)?;
        }
    }
    for pc in program.entry_points.values_mut() {
        *pc = to(*pc)?;
    }
    program.main_entry_point = to32(program.main_entry_point)?;
    Ok(())
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
    /// No collection built (no comprehension, no array, set or object made): no value with
    /// shared structure, whose comparison would be one slow instruction; with the instruction
    /// budget its evaluation is cheap wherever it runs.
    pub flat: bool,
}

impl Reads {
    fn of(program: &regorus::rvm::Program) -> Self {
        use regorus::rvm::Instruction as I;
        let mut r = Reads {
            input: false,
            data: false,
            world: false,
            flat: true,
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
                I::ComprehensionBegin { .. }
                | I::ArrayNew { .. }
                | I::ArrayPush { .. }
                | I::ArrayPushDefined { .. }
                | I::ArrayCreate { .. }
                | I::SetNew { .. }
                | I::SetAdd { .. }
                | I::SetCreate { .. }
                | I::ObjectSet { .. }
                | I::ObjectCreate { .. } => r.flat = false,
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
                | I::Index { .. }
                | I::IndexLiteral { .. }
                | I::ChainedIndex { .. }
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

    /// The size guards move every instruction: the bounded program decides as the operator's
    /// on comprehensions (array, set, object, nested, empty, failing), partial rules,
    /// functions, `every`, `else`, data documents and loops over empty collections.
    #[test]
    fn the_size_guards_change_no_decision() {
        let rules = [
            "allow if count([x | some x in input.xs; x > 1]) == input.n",
            "allow if count({x | some x in input.xs}) == input.n",
            "allow if count({k: v | some k, v in input.o; v > 0}) == input.n",
            "allow if count([y | some x in input.xs; y := [z | some z in input.xs; z < x]]) == input.n",
            "allow if { count([x | some x in input.empty]) == 0; input.n > 1 }",
            "allow if count([1 | some x in input.xs; some y in input.empty]) == input.n",
            "allow if { every x in input.xs { x > 1 } }",
            "allow if { every x in input.empty { x > 100 } ; input.n > 0 }",
            "s contains x if { some x in input.xs; x > 1 }\ns contains \"k\" if input.n > 0\nallow if count(s) == input.n",
            "o[k] := v if { some k, v in input.o; v > 0 }\nallow if count(o) == input.n",
            "f(x) := [x, x]\nallow if f(input.n) == [2, 2]",
            "f(x) := y if { x > 1; y := {x} } else := 0\nallow if f(input.n) == {input.n}",
            "r := {\"a\": input.n, \"b\": [input.n]}\nallow if data.policy.r.b[0] == 3",
            "allow if { x := [a | some a in input.xs]; y := {b | some b in x}; count(y) == input.n }",
            "allow if { some x in input.xs; x == input.n }",
            "allow if { not input.no; [input.n, {\"k\": input.xs}][1].k[0] == 1 }",
        ];
        let inputs = [
            serde_json::json!({"xs": [1, 2, 3], "n": 2, "o": {"a": 1, "b": 0}, "empty": []}),
            serde_json::json!({"xs": [1, 2, 3], "n": 3, "o": {"a": 1, "b": 2, "c": 3}, "empty": []}),
            serde_json::json!({"xs": [], "n": 0, "o": {}, "empty": []}),
            serde_json::json!({"xs": [5], "n": 1, "o": {"a": 0}, "empty": {}}),
        ];
        for rule in rules {
            let rego = format!("package policy\nimport rego.v1\ndefault allow := false\n{rule}\n");
            let trusted = compile(&rego);
            let untrusted = RegoProgram::compile_as(
                "t.rego",
                &rego,
                serde_json::json!({"allow_sim": false}),
                "data.policy.allow",
                Trust::Untrusted,
            )
            .unwrap();
            let mut seen = std::collections::HashSet::new();
            for input in &inputs {
                let input = regorus::Value::from(input.clone());
                let expected = trusted.eval(input.clone()).unwrap();
                assert_eq!(
                    untrusted.eval(input.clone()).unwrap(),
                    expected,
                    "{rule}: {input}"
                );
                seen.insert(expected.to_string());
            }
            // Each rule decides both ways on these inputs, or the comparison proves little.
            assert_eq!(seen.len(), 2, "{rule}");
        }
    }

    /// An untrusted program's `*` is the guarded multiplication: the same answers as the VM's
    /// own on numbers, undefined operands and floats; a product past the cap is a limit.
    #[test]
    fn the_rewritten_multiplication_answers_as_the_vms() {
        let rego = "package policy\nimport rego.v1\ndefault allow := false\n\
                    allow if input.a * input.b == input.c\n";
        let trusted = compile(rego);
        let untrusted = RegoProgram::compile_as(
            "t.rego",
            rego,
            serde_json::json!({}),
            "data.policy.allow",
            Trust::Untrusted,
        )
        .unwrap();
        assert!(
            untrusted.builtins().is_empty(),
            "{:?}",
            untrusted.builtins()
        );
        for input in [
            serde_json::json!({"a": 2, "b": 3, "c": 6}),
            serde_json::json!({"a": 2, "b": 3, "c": 7}),
            serde_json::json!({"a": 1.5, "b": 2, "c": 3}),
            serde_json::json!({"a": -4, "b": 3, "c": -12}),
            serde_json::json!({"b": 3, "c": 6}),
            serde_json::json!({"a": 4294967296u64, "b": 4294967296u64, "c": 18446744073709551616.0}),
        ] {
            let input = regorus::Value::from(input);
            assert_eq!(
                untrusted.eval(input.clone()).unwrap(),
                trusted.eval(input.clone()).unwrap(),
                "{input}"
            );
        }
        let e = untrusted
            .eval(regorus::Value::from(
                serde_json::json!({"a": "x", "b": 2, "c": 1}),
            ))
            .is_err();
        assert_eq!(
            e,
            trusted
                .eval(regorus::Value::from(
                    serde_json::json!({"a": "x", "b": 2, "c": 1})
                ))
                .is_err()
        );
    }
}
