//! One compiled Rego program: parsed and compiled once to a regorus RVM program for one entry
//! point, then evaluated on VMs kept in a small pool (each VM already holds the program and the
//! data). Re-using a compiled engine is ≈5× faster than re-parsing and the RVM another ≈5×
//! (`../shared/CRATES.md`). The appraisal, release and (later) placement policies all run here.

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
        Ok(RegoProgram {
            entry_point: entry_point.to_string(),
            compiled,
            program,
            data,
            vms: Mutex::new(Vec::new()),
        })
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
        if let Some(data) = data {
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
