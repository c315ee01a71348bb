//! Bounds on a Rego program that someone other than the operator wrote: a tenant's placement
//! policy, a repository administrator's release policy. Such a program is *untrusted*; the
//! operator's own (the appraisal policy, the KBS's global release policy) is *trusted*.
//!
//! An untrusted program is held to four things:
//! - **An allow-list of builtins**, checked when it is compiled (= when it is uploaded): every
//!   builtin its instructions call must be one whose output is no larger than a constant times
//!   its arguments and whose running time is near-linear in them ([`ALLOWED_BUILTINS`]).
//!   Builtins that make a value as large as an argument asks (`numbers.range`, `sprintf`,
//!   `replace`, `strings.replace_n`, `bits.lsh`, `product`, `json.marshal` of a shared value,
//!   `units.parse`) are refused by name, whatever whitespace or comment surrounds them.
//! - **Literals**: a number literal whose exponent is over [`MAX_LITERAL_EXPONENT`] (`1e2000000000`
//!   is a 12-byte text that regorus would turn into an 830 MB integer while parsing) is refused
//!   before the text is parsed.
//! - **Multiplication**: every `*` is rewritten into a call that refuses a product of integers
//!   over [`MAX_PRODUCT_BITS`] bits, so repeated squaring (each line doubling the digits) stops
//!   at the first product that passes it; `+` and `-` add at most one bit per instruction.
//! - **Per evaluation**: at most [`Limits::max_instructions`] executed instructions, a wall-clock
//!   limit checked between instructions, and an allocation budget that every allowed builtin
//!   charges with the size of what it is about to make before it runs ([`charge`]).
//!
//! The allocation bound. Core instructions (loads, moves, comparisons, a collection's one new
//! element, a rule's cached value) make at most one new value node each, and values are shared
//! (`Rc`), not copied: ≤ `max_instructions × C` bytes with C ≈ 200 bytes. Builtins make the rest,
//! and each is charged, before it runs, at least the size of its output: ≤ `allocation` bytes.
//! Numbers are bounded by the literal and product caps. So one evaluation allocates at most
//! `allocation + max_instructions × C` beyond its input (for [`Limits::UNTRUSTED`]:
//! 16 MiB + 50 000 × 200 B ≈ 26 MiB), and inputs are capped by the services (a job spec's body,
//! an EAR). `tests/limits.rs` builds huge values each of the ways above and sees each refused.
//!
//! - **Value size**: every value such a program makes and can then read (collection literals,
//!   finished comprehensions, rule and function values, data documents, builtin outputs) is
//!   measured as if written out, a shared part counted each time it appears, and one over
//!   [`MAX_VALUE_NODES`] fails the evaluation with [`Exceeded::Size`] (the compiled program
//!   carries a guard instruction after each such instruction: `program::size_guards`). Values
//!   are shared (`Rc`), so without this, 64 lines of `aN := [aN-1, aN-1]` and a second chain
//!   make values of 2⁶⁴ leaves in a few bytes, and one comparison, set insertion or key lookup
//!   of two of them is one VM instruction that runs for ever. Measuring stops at the limit, so
//!   one guard costs at most [`MAX_VALUE_NODES`] steps, and the chain stops at its 17th line.
//!
//! One instruction still cannot be interrupted, but each one now works on values of at most
//! [`MAX_VALUE_NODES`] nodes (or on the input and data, which the services bound). Untrusted
//! programs still run on the evaluator threads of [`crate::sandbox`], with a deadline, so no
//! caller ever waits on one beyond its time limit.

use std::cell::Cell;
use std::time::Duration;

use regorus::Value;
use regorus::unstable::{BUILTINS, BuiltinFcn, Expr, Ref, Span};

/// Who wrote a program, which decides the bounds it runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Trust {
    /// The operator's own (the appraisal policy, the global release policy, the shipped
    /// defaults): instruction and time limits only, evaluated where the caller stands.
    Operator,
    /// A tenant's or a repository administrator's: the allow-list, the literal and product
    /// caps and the allocation budget too, and evaluated on the evaluator threads.
    Untrusted,
}

/// Per-evaluation limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Executed RVM instructions.
    pub max_instructions: usize,
    /// Wall-clock time, checked by the VM every few instructions (and by the caller waiting).
    pub time: Duration,
    /// Bytes the builtins may make ([`charge`]); `None`: no builtin is charged.
    pub allocation: Option<usize>,
}

impl Limits {
    /// A tenant's or repository administrator's program. Our shipped placement example takes
    /// about 150 instructions per node, Trustee's stock release policies under 100.
    pub const UNTRUSTED: Limits = Limits {
        max_instructions: 50_000,
        time: Duration::from_millis(250),
        allocation: Some(16 << 20),
    };
    /// The operator's: regorus's own instruction default, which every shipped policy has always
    /// run under, and a time limit far beyond any of them.
    pub const OPERATOR: Limits = Limits {
        max_instructions: 25_000,
        time: Duration::from_secs(2),
        allocation: None,
    };

    /// The limits for programs of `trust`.
    pub fn of(trust: Trust) -> Limits {
        match trust {
            Trust::Operator => Limits::OPERATOR,
            Trust::Untrusted => Limits::UNTRUSTED,
        }
    }
}

/// The largest exponent a number literal of an untrusted program may have (`1e400`).
pub const MAX_LITERAL_EXPONENT: u32 = 400;

/// The most bits a product of integers may have in an untrusted program (≈ 10³⁰⁸).
pub const MAX_PRODUCT_BITS: u64 = 1024;

/// The longest string `to_number` takes in an untrusted program.
pub const MAX_NUMBER_TEXT: usize = 400;

/// The most nodes a value an untrusted program builds may have, counted as if written out:
/// a part held twice (shared, `Rc`) counts twice. Every collection such a program builds
/// (array, set and object literals, comprehensions, partial rules, a builtin's output, a data
/// document) is measured when it is made, and one over this fails the evaluation with
/// [`Exceeded::Size`]. Measuring stops at the limit, so one measurement costs at most this many
/// steps however much sharing the value hides.
pub const MAX_VALUE_NODES: usize = 100_000;

/// The name the rewritten multiplication is called by in a program's builtin table.
pub(crate) const MUL: &str = "cgx.mul";

/// The size guard placed after each instruction that makes a value the program can read: one
/// argument, given back unchanged.
pub(crate) const SIZE: &str = "cgx.size";

/// How an allowed builtin is charged, from its arguments, before it runs.
#[derive(Debug, Clone, Copy)]
enum Cost {
    /// At most `k` times the arguments' shallow size (string bytes, 32 bytes per element).
    Linear(usize),
    /// `concat(delimiter, strings)`: the joined length.
    Concat,
    /// `split(s, delimiter)`: up to one 64-byte string value per byte of `s`.
    Split,
    /// `to_number(s)`: refused over [`MAX_NUMBER_TEXT`] bytes or with an exponent over
    /// [`MAX_LITERAL_EXPONENT`].
    ToNumber,
}

/// Builtins an untrusted program may call: each makes at most a constant times its arguments'
/// size and runs in near-linear time in them (sorting: n log n comparisons). What our shipped
/// policies and Trustee's stock release policies call is here; `count` and membership are VM
/// instructions, not builtins.
pub const ALLOWED_BUILTINS: &[&str] = &[
    "abs",
    "array.concat",
    "array.reverse",
    "array.slice",
    "ceil",
    "concat",
    "contains",
    "count",
    "endswith",
    "floor",
    "format_int",
    "indexof",
    "indexof_n",
    "intersection",
    "is_array",
    "is_boolean",
    "is_null",
    "is_number",
    "is_object",
    "is_set",
    "is_string",
    "lower",
    "max",
    "min",
    "object.filter",
    "object.get",
    "object.keys",
    "object.remove",
    "object.subset",
    "object.union",
    "round",
    "sort",
    "split",
    "startswith",
    "strings.count",
    "strings.reverse",
    "substring",
    "sum",
    "to_number",
    "trim",
    "trim_left",
    "trim_prefix",
    "trim_right",
    "trim_space",
    "trim_suffix",
    "type_name",
    "union",
    "upper",
    "__builtin_sets.intersection",
    "__builtin_sets.union",
];

fn cost_of(name: &str) -> Option<Cost> {
    Some(match name {
        "concat" => Cost::Concat,
        "split" => Cost::Split,
        "to_number" => Cost::ToNumber,
        "lower" | "upper" => Cost::Linear(4),
        n if ALLOWED_BUILTINS.contains(&n) => Cost::Linear(2),
        _ => return None,
    })
}

/// Which limit an evaluation ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exceeded {
    Instructions(usize),
    Time(Duration),
    Allocation(usize),
    /// A product of integers over [`MAX_PRODUCT_BITS`].
    Number,
    /// `to_number` of a text over [`MAX_NUMBER_TEXT`] or with a huge exponent.
    NumberText,
    /// A value built over [`MAX_VALUE_NODES`] nodes, counted as written out (a part held
    /// twice counts twice).
    Size(usize),
}

impl std::fmt::Display for Exceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exceeded::Instructions(n) => {
                write!(
                    f,
                    "policy exceeded its instruction limit ({n} instructions)"
                )
            }
            Exceeded::Time(t) => write!(f, "policy exceeded its time limit ({} ms)", t.as_millis()),
            Exceeded::Allocation(b) => {
                write!(f, "policy exceeded its allocation budget ({} KiB)", b >> 10)
            }
            Exceeded::Number => write!(
                f,
                "policy exceeded its number limit (a product over {MAX_PRODUCT_BITS} bits)"
            ),
            Exceeded::Size(n) => write!(
                f,
                "policy exceeded its value size limit (a value of over {n} nodes)"
            ),
            Exceeded::NumberText => write!(
                f,
                "policy exceeded its number limit (to_number of a text over {MAX_NUMBER_TEXT} \
                 bytes or with an exponent over {MAX_LITERAL_EXPONENT})"
            ),
        }
    }
}

impl std::error::Error for Exceeded {}

thread_local! {
    /// Bytes the builtins of the evaluation running on this thread may still make (`None`: not
    /// charged), and the limit it ran into, if any.
    static BUDGET: Cell<Option<usize>> = const { Cell::new(None) };
    static BUDGET_LIMIT: Cell<usize> = const { Cell::new(0) };
    static HIT: Cell<Option<Exceeded>> = const { Cell::new(None) };
}

/// Arms the thread's budget for one evaluation; disarmed when dropped, so a pooled thread
/// never carries one evaluation's budget into the next.
pub(crate) struct BudgetScope(());

impl BudgetScope {
    pub(crate) fn arm(allocation: Option<usize>) -> Self {
        BUDGET.with(|b| b.set(allocation));
        BUDGET_LIMIT.with(|l| l.set(allocation.unwrap_or(0)));
        HIT.with(|h| h.set(None));
        BudgetScope(())
    }

    /// The limit a guard ran into during this evaluation.
    pub(crate) fn hit(&self) -> Option<Exceeded> {
        HIT.with(Cell::get)
    }
}

impl Drop for BudgetScope {
    fn drop(&mut self) {
        BUDGET.with(|b| b.set(None));
        HIT.with(|h| h.set(None));
    }
}

fn exceeded(e: Exceeded) -> Exceeded {
    HIT.with(|h| h.set(Some(e)));
    e
}

/// Take `bytes` from the running evaluation's budget; past it, the evaluation fails with
/// [`Exceeded::Allocation`].
pub(crate) fn charge(bytes: usize) -> Result<(), Exceeded> {
    BUDGET.with(|b| match b.get() {
        None => Ok(()),
        Some(left) if left >= bytes => {
            b.set(Some(left - bytes));
            Ok(())
        }
        Some(_) => {
            b.set(Some(0));
            Err(exceeded(Exceeded::Allocation(BUDGET_LIMIT.with(Cell::get))))
        }
    })
}

/// A value's own size: a string's bytes, 32 per element of a collection (its elements are
/// shared, not copied, by what a builtin makes of it).
fn shallow(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len() + 16,
        Value::Array(a) => a.len().saturating_mul(32) + 16,
        Value::Set(s) => s.len().saturating_mul(32) + 16,
        Value::Object(o) => o.len().saturating_mul(64) + 16,
        Value::Number(_) => {
            number_bits(v).map_or(16, |b| usize::try_from(b / 8).unwrap_or(usize::MAX)) + 16
        }
        _ => 16,
    }
}

/// An integer's size in bits; `None` for a float (whose products stay floats) or a non-number.
fn number_bits(v: &Value) -> Option<u64> {
    let Value::Number(n) = v else {
        return None;
    };
    if let Some(u) = n.as_u128() {
        return Some(u64::from(128 - u.leading_zeros()));
    }
    if let Some(i) = n.as_i128() {
        return Some(u64::from(128 - i.unsigned_abs().leading_zeros()));
    }
    if !n.is_integer() {
        return None;
    }
    // Beyond 128 bits: hex digits, linear in the (capped) size.
    Some(4 * n.format_big_hex().len() as u64)
}

fn cost(c: Cost, args: &[Value]) -> Result<usize, Exceeded> {
    Ok(match c {
        Cost::Linear(k) => args.iter().map(shallow).sum::<usize>().saturating_mul(k) + 64,
        Cost::Concat => {
            let delimiter = args.first().map_or(0, shallow);
            let parts: Vec<&Value> = match args.get(1) {
                Some(Value::Array(a)) => a.iter().collect(),
                Some(Value::Set(s)) => s.iter().collect(),
                _ => Vec::new(),
            };
            parts
                .iter()
                .map(|p| shallow(p).saturating_add(delimiter))
                .sum::<usize>()
                + 64
        }
        Cost::Split => args.first().map_or(0, shallow).saturating_mul(64) + 64,
        Cost::ToNumber => {
            if let Some(Value::String(s)) = args.first()
                && (s.len() > MAX_NUMBER_TEXT || huge_exponent(s))
            {
                return Err(exceeded(Exceeded::NumberText));
            }
            MAX_NUMBER_TEXT * 2
        }
    })
}

/// Whether `s` holds a number with an exponent over [`MAX_LITERAL_EXPONENT`] (`1e999`,
/// `2.5E+1000`), as a JSON or Rego number would be read.
fn huge_exponent(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if (b[i] == b'e' || b[i] == b'E')
            && i > 0
            && (b[i - 1].is_ascii_digit() || b[i - 1] == b'.')
        {
            // The mantissa must start a token: `x1e999` is a name, not a number.
            let mut start = i;
            while start > 0
                && (b[start - 1].is_ascii_digit() || matches!(b[start - 1], b'.' | b'_'))
            {
                start -= 1;
            }
            let named = start > 0 && (b[start - 1].is_ascii_alphabetic() || b[start - 1] == b'_');
            let mut j = i + 1;
            if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
                j += 1;
            }
            let digits_from = j;
            while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'_') {
                j += 1;
            }
            let exponent: String = s[digits_from..j].chars().filter(|c| *c != '_').collect();
            let exponent = exponent.trim_start_matches('0');
            if !named
                && !exponent.is_empty()
                && (exponent.len() > 6
                    || exponent
                        .parse::<u32>()
                        .is_ok_and(|e| e > MAX_LITERAL_EXPONENT))
            {
                return true;
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    false
}

/// Refuse, before parsing, an untrusted program's text whose number literals regorus would
/// expand into huge integers while parsing it.
pub(crate) fn check_source(rego: &str) -> Result<(), String> {
    if huge_exponent(rego) {
        return Err(format!(
            "a number literal with an exponent over {MAX_LITERAL_EXPONENT} is not allowed in \
             this policy"
        ));
    }
    Ok(())
}

/// Refuse a builtin not on [`ALLOWED_BUILTINS`].
pub(crate) fn check_builtin(name: &str) -> Result<(), String> {
    if cost_of(name).is_some() {
        Ok(())
    } else {
        Err(format!(
            "`{name}` may not be used in this policy: only builtins whose output and time are \
             bounded by their arguments are allowed ({})",
            ALLOWED_BUILTINS
                .iter()
                .filter(|b| !b.starts_with("__"))
                .copied()
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }
}

/// The function pointer regorus calls a builtin through, named from its `BuiltinFcn` pair so
/// that neither its error type nor its crate is named here.
type BuiltinPtr = <BuiltinFcn as First>::T;
type BuiltinResult = <BuiltinPtr as Returns>::R;

trait First {
    type T;
}
impl<A, B> First for (A, B) {
    type T = A;
}
trait Returns {
    type R;
}
impl<R> Returns for fn(&Span, &[Ref<Expr>], &[Value], bool) -> R {
    type R = R;
}

/// The guarded form of allowed builtin number `I` of [`ALLOWED_BUILTINS`]: charged, then the
/// original called.
fn guarded<const I: usize>(
    span: &Span,
    params: &[Ref<Expr>],
    args: &[Value],
    strict: bool,
) -> BuiltinResult {
    let name = ALLOWED_BUILTINS.get(I).copied().unwrap_or("");
    let Some((original, _)) = BUILTINS.get(name) else {
        return Err(Exceeded::Allocation(0).into());
    };
    if let Some(c) = cost_of(name) {
        charge(cost(c, args)?)?;
    }
    let out = original(span, params, args, strict)?;
    // What a builtin makes may share its arguments' parts (`array.concat([a], [a])`).
    check_size(std::slice::from_ref(&out))?;
    Ok(out)
}

/// Whether `values` together have at most `budget` nodes, counted as written out. Stops as
/// soon as the count passes `budget`: at most `budget + 1` steps, whatever the sharing.
fn within_nodes(values: &[Value], budget: usize) -> bool {
    let mut left = budget;
    let mut stack: Vec<&Value> = values.iter().collect();
    while let Some(v) = stack.pop() {
        if left == 0 {
            return false;
        }
        left -= 1;
        match v {
            Value::Array(a) => stack.extend(a.iter()),
            Value::Set(s) => stack.extend(s.iter()),
            Value::Object(o) => {
                for (k, v) in o.iter() {
                    stack.push(k);
                    stack.push(v);
                }
            }
            _ => {}
        }
        // The stack holds at most what the budget still allows to be visited, plus one
        // collection's elements: refuse early rather than grow it past that.
        if stack.len() > left.saturating_add(1) {
            return false;
        }
    }
    true
}

/// Refuse values over [`MAX_VALUE_NODES`] together: the evaluation fails with
/// [`Exceeded::Size`]. The error is regorus's own resource-limit error, which the VM never
/// turns into an undefined value (`not f(x)` cannot flip), so the evaluation stops here.
fn check_size(values: &[Value]) -> Result<(), regorus::LimitError> {
    if within_nodes(values, MAX_VALUE_NODES) {
        Ok(())
    } else {
        exceeded(Exceeded::Size(MAX_VALUE_NODES));
        Err(regorus::LimitError::MemoryLimitExceeded { usage: 0, limit: 0 })
    }
}

/// The size guard: its argument measured and given back unchanged (its register is its
/// destination), or the limit.
fn guarded_size(_: &Span, _: &[Ref<Expr>], args: &[Value], _: bool) -> BuiltinResult {
    check_size(args)?;
    Ok(args.first().cloned().unwrap_or(Value::Undefined))
}

/// The size guard, as a builtin of one argument.
pub(crate) fn size_guard() -> BuiltinFcn {
    (guarded_size, 1)
}

/// The rewritten `*`: the VM's own multiplication, refused where a product of integers would
/// pass [`MAX_PRODUCT_BITS`].
fn guarded_mul(_: &Span, _: &[Ref<Expr>], args: &[Value], _: bool) -> BuiltinResult {
    let (Some(va @ Value::Number(a)), Some(vb @ Value::Number(b))) = (args.first(), args.get(1))
    else {
        return Err(NotNumbers.into());
    };
    if let (Some(x), Some(y)) = (number_bits(va), number_bits(vb))
        && x.saturating_add(y) > MAX_PRODUCT_BITS
    {
        return Err(exceeded(Exceeded::Number).into());
    }
    charge(64)?;
    Ok(Value::from(a.mul(b)?))
}

#[derive(Debug, thiserror::Error)]
#[error("`*` takes two numbers")]
struct NotNumbers;

macro_rules! guards {
    ($($i:literal)*) => {
        /// One guard per entry of [`ALLOWED_BUILTINS`], in its order.
        const GUARDS: &[BuiltinPtr] = &[$(guarded::<$i>),*];
    };
}
guards!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32
    33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49);

/// The guard for an allowed builtin.
pub(crate) fn guard_for(name: &str) -> Option<BuiltinFcn> {
    let i = ALLOWED_BUILTINS.iter().position(|b| *b == name)?;
    let arity = BUILTINS.get(name).map_or(0, |(_, n)| *n);
    GUARDS.get(i).map(|g| (*g, arity))
}

/// The guarded multiplication, as a builtin of two arguments.
pub(crate) fn mul_guard() -> BuiltinFcn {
    (guarded_mul, 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_allowed_builtin_has_its_guard() {
        assert_eq!(GUARDS.len(), ALLOWED_BUILTINS.len());
        for b in ALLOWED_BUILTINS {
            assert!(
                BUILTINS.contains_key(b),
                "{b} is not a regorus builtin here"
            );
            assert!(guard_for(b).is_some(), "{b}");
        }
    }

    #[test]
    fn huge_exponents_are_seen() {
        for s in [
            "1e2000000000",
            "x := 1E401",
            "2.5e+1000",
            "[1e9_999]",
            "1.e999",
        ] {
            assert!(huge_exponent(s), "{s}");
        }
        for s in [
            "1e400",
            "x1e5000",
            "version_1e999",
            "1e-5",
            "hello e999",
            "3.14",
        ] {
            assert!(!huge_exponent(s), "{s}");
        }
    }
}
