//! RFC 8785 JSON Canonicalization Scheme (JCS): object members sorted by the UTF-16 code units
//! of their names, no whitespace, strings escaped as ECMAScript's `JSON.stringify` escapes them,
//! numbers written as ECMAScript's `Number.prototype.toString` writes them.
//!
//! Written out rather than left to `serde_json`: its map order is insertion order or sorted
//! depending on a feature (`preserve_order`) that any crate in the build graph can switch on,
//! and it writes numbers its own way. Two entry points share one writer:
//! - [`canonical`] for a [`serde_json::Value`] (CoCo's runtime-data binding, JWE headers);
//! - [`to_canonical`] for any `Serialize` value, written straight from the value without a
//!   `Value` in between (claims digests: about twice as fast), keeping where each top-level
//!   member's value lies so a caller can read members without parsing ([`Canonical::member`]).
//!
//! Numbers are IEEE doubles to JCS, so an integer beyond ±(2^53 − 1) has no exact form:
//! [`canonical`] writes the double it rounds to, as RFC 8785 does, while [`to_canonical`]
//! refuses it — two different claims must never canonicalize (and digest) alike. Non-finite
//! numbers cannot be written in JSON and are refused.

use std::fmt::Write as _;
use std::ops::Range;

use serde::ser::{self, Serialize};
use serde_json::Value;

/// Why a value has no canonical JSON form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("JSON has no form for a non-finite number")]
    NonFinite,
    #[error("an object member name must be a string, not {0}")]
    KeyNotString(&'static str),
    #[error("member {0:?} appears twice in one object")]
    DuplicateMember(String),
    #[error("integer {0} is beyond ±(2^53 − 1), where JSON numbers stop being exact")]
    InexactInteger(String),
    #[error("{0}")]
    Custom(String),
}

impl ser::Error for Error {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Error::Custom(msg.to_string())
    }
}

/// A value in canonical form, with the place of each top-level member when it is an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Canonical {
    text: String,
    /// Top-level members in canonical order: (name as written between its quotes, value).
    members: Vec<(Range<usize>, Range<usize>)>,
}

impl Canonical {
    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub fn into_string(self) -> String {
        self.text
    }

    /// The canonical text of top-level member `name`'s value, for names JSON writes without
    /// escapes (every identifier); `None` when absent, when `name` would need an escape, or
    /// when the value is not an object.
    pub fn member(&self, name: &str) -> Option<&str> {
        // Names are compared as written; one JSON would escape is never looked up, so it cannot
        // match another member's escaped spelling.
        if name.bytes().any(escaped) {
            return None;
        }
        self.members
            .iter()
            .find(|(k, _)| k.len() == name.len() && self.text.get(k.clone()) == Some(name))
            .and_then(|(_, v)| self.text.get(v.clone()))
    }
}

/// The largest integer a double holds exactly, and every smaller one too.
const MAX_EXACT: u64 = (1 << 53) - 1;

/// The canonical form of `v`.
pub fn canonical(v: &Value) -> String {
    let mut w = Writer::with_capacity(256);
    w.value(v);
    w.out
}

/// The canonical form of any serializable value, as [`canonical`] writes
/// `serde_json::to_value(value)`.
pub fn to_canonical<T: Serialize + ?Sized>(value: &T) -> Result<Canonical, Error> {
    let mut w = Writer::with_capacity(2048);
    value.serialize(&mut w)?;
    Ok(Canonical {
        text: w.out,
        members: w.root_members,
    })
}

/// An object or array being written.
#[derive(Debug, Default)]
struct Frame {
    /// Where its first member or element starts in the output.
    start: usize,
    /// Members or elements written so far.
    count: usize,
    /// Member names as given (not escaped), one after another; sorting compares these.
    names: String,
    /// Whether every name is ASCII, where byte order is UTF-16 order.
    ascii: bool,
    entries: Vec<Entry>,
}

/// Writes canonical JSON. Members are written in the order given, then reordered when their
/// object closes (rarely needed for maps, which arrive sorted by byte order already).
#[derive(Debug, Default)]
struct Writer {
    out: String,
    /// Open containers, innermost last; `frames[..depth]` are live, the rest kept for reuse.
    frames: Vec<Frame>,
    depth: usize,
    scratch: String,
    sorted: Vec<usize>,
    root_members: Vec<(Range<usize>, Range<usize>)>,
}

impl Writer {
    fn with_capacity(bytes: usize) -> Self {
        Writer {
            out: String::with_capacity(bytes),
            ..Writer::default()
        }
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::Null => self.out.push_str("null"),
            Value::Bool(b) => self.out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => {
                // Exact integers as such; anything else (a `Value` holds only finite numbers)
                // as the double it is or rounds to.
                let exact = n
                    .as_i64()
                    .map(|i| self.sint(i))
                    .or_else(|| n.as_u64().map(|u| self.uint(u)));
                if !matches!(exact, Some(Ok(()))) {
                    number(n.as_f64().unwrap_or_default(), &mut self.out);
                }
            }
            Value::String(s) => string(s, &mut self.out),
            Value::Array(a) => {
                self.open('[');
                for x in a {
                    self.element();
                    self.value(x);
                }
                self.close_array();
            }
            Value::Object(m) => {
                self.open('{');
                for (k, x) in m {
                    self.member(k);
                    self.value(x);
                }
                // A map's names are unique, so this cannot refuse.
                let _ = self.close_object();
            }
        }
    }

    /// An integer within ±(2^53 − 1), exactly.
    fn uint(&mut self, mut v: u64) -> Result<(), Error> {
        if v > MAX_EXACT {
            return Err(Error::InexactInteger(v.to_string()));
        }
        let mut buf = [0u8; 20];
        let mut at = buf.len();
        loop {
            at -= 1;
            buf[at] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        // ASCII digits only.
        self.out
            .push_str(std::str::from_utf8(&buf[at..]).unwrap_or_default());
        Ok(())
    }

    fn sint(&mut self, v: i64) -> Result<(), Error> {
        if v.unsigned_abs() > MAX_EXACT {
            return Err(Error::InexactInteger(v.to_string()));
        }
        if v < 0 {
            self.out.push('-');
        }
        self.uint(v.unsigned_abs())
    }

    fn open(&mut self, bracket: char) {
        self.out.push(bracket);
        if self.frames.len() == self.depth {
            // Room for a typical claims object, so members are added without reallocating.
            self.frames.push(Frame {
                names: String::with_capacity(512),
                entries: Vec::with_capacity(48),
                ..Frame::default()
            });
        }
        let start = self.out.len();
        if let Some(f) = self.frames.get_mut(self.depth) {
            f.start = start;
            f.count = 0;
            f.names.clear();
            f.ascii = true;
            f.entries.clear();
        }
        self.depth += 1;
    }

    fn element(&mut self) {
        let Some(f) = self
            .depth
            .checked_sub(1)
            .and_then(|d| self.frames.get_mut(d))
        else {
            return;
        };
        if f.count > 0 {
            self.out.push(',');
        }
        f.count += 1;
    }

    fn close_array(&mut self) {
        self.depth = self.depth.saturating_sub(1);
        self.out.push(']');
    }

    /// Start member `name`; its value is written next.
    fn member(&mut self, name: &str) {
        let end = self.out.len();
        let Some(f) = self
            .depth
            .checked_sub(1)
            .and_then(|d| self.frames.get_mut(d))
        else {
            return;
        };
        if let Some(last) = f.entries.last_mut() {
            last.end = end;
            self.out.push(',');
        }
        f.count += 1;
        let at = f.names.len();
        f.names.push_str(name);
        f.ascii &= name.is_ascii();
        let mut prefix = [0u8; 8];
        let n = name.len().min(8);
        prefix[..n].copy_from_slice(&name.as_bytes()[..n]);
        let start = self.out.len();
        string(name, &mut self.out);
        self.out.push(':');
        f.entries.push(Entry {
            name: at..f.names.len(),
            prefix: u64::from_be_bytes(prefix),
            start,
            value: self.out.len(),
            end: self.out.len(),
        });
    }

    /// Close the innermost object, putting its members in canonical order. Two members of one
    /// name are refused: JSON readers disagree on which one counts.
    fn close_object(&mut self) -> Result<(), Error> {
        let end = self.out.len();
        self.depth = self.depth.saturating_sub(1);
        let root = self.depth == 0;
        let Some(f) = self.frames.get_mut(self.depth) else {
            return Ok(());
        };
        if let Some(last) = f.entries.last_mut() {
            last.end = end;
        }
        let names = f.names.as_str();
        let entries = &mut f.entries;
        let ascii = f.ascii;
        let order = |a: &Entry, b: &Entry| {
            let name = |e: &Entry| names.get(e.name.clone()).unwrap_or_default();
            if ascii {
                match a.prefix.cmp(&b.prefix) {
                    std::cmp::Ordering::Equal => name(a).cmp(name(b)),
                    decided => decided,
                }
            } else {
                name(a).encode_utf16().cmp(name(b).encode_utf16())
            }
        };
        // Positions in `entries`, in canonical order.
        let sorted = &mut self.sorted;
        sorted.clear();
        sorted.extend(0..entries.len());
        if !entries.windows(2).all(|w| order(&w[0], &w[1]).is_lt()) {
            // Sorting small indices moves less than sorting the entries.
            sorted.sort_unstable_by(|&a, &b| order(&entries[a], &entries[b]));
            if let Some(w) = sorted
                .windows(2)
                .find(|w| order(&entries[w[0]], &entries[w[1]]).is_eq())
            {
                return Err(Error::DuplicateMember(
                    names[entries[w[0]].name.clone()].to_string(),
                ));
            }
            // Rewrite the members in order: copy them out, then back with commas between.
            self.scratch.clear();
            self.scratch.push_str(&self.out[f.start..]);
            self.out.truncate(f.start);
            for (i, &at) in sorted.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let e = &mut entries[at];
                let to = self.out.len();
                self.out
                    .push_str(&self.scratch[e.start - f.start..e.end - f.start]);
                // Now where the member lies in the output.
                e.value = to + (e.value - e.start);
                e.end = to + (e.end - e.start);
                e.start = to;
            }
        }
        if root {
            // Name between its quotes, and value.
            self.root_members = sorted
                .iter()
                .map(|&at| &entries[at])
                .map(|e| (e.start + 1..e.value - 2, e.value..e.end))
                .collect();
        }
        self.out.push('}');
        Ok(())
    }
}

/// A member of an object being written.
#[derive(Debug, Clone)]
struct Entry {
    /// Its name in [`Frame::names`].
    name: Range<usize>,
    /// The name's first 8 bytes, big-endian, zero-padded: byte order of ASCII names is decided
    /// here for all but shared prefixes.
    prefix: u64,
    /// Where it starts, where its value starts and where it ends in the output.
    start: usize,
    value: usize,
    end: usize,
}

/// A string as `JSON.stringify` writes it: `"` and `\` escaped, the short escapes for
/// backspace, form feed, newline, carriage return and tab, `\u00xx` (lowercase) for the other
/// control characters, everything else as is.
fn string(s: &str, out: &mut String) {
    out.reserve(s.len() + 2);
    out.push('"');
    let bytes = s.as_bytes();
    // Most strings (hex digests, names) need no escape: one branch-free pass (it vectorizes)
    // says so, and they are copied whole.
    let plain = bytes.iter().fold(true, |ok, &b| ok & !escaped(b));
    if plain {
        out.push_str(s);
        out.push('"');
        return;
    }
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            0x0c => "\\f",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0..0x20 => "",
            _ => continue,
        };
        // `i` is at an ASCII byte, so both slices end on character boundaries.
        out.push_str(&s[run..i]);
        if escape.is_empty() {
            let _ = write!(out, "\\u{b:04x}");
        } else {
            out.push_str(escape);
        }
        run = i + 1;
    }
    out.push_str(&s[run..]);
    out.push('"');
}

/// Whether a JSON string escapes `b`: control characters, `"` and `\`. Bitwise, so a pass
/// over a string vectorizes.
fn escaped(b: u8) -> bool {
    (b < 0x20) | (b == b'"') | (b == b'\\')
}

/// A finite double as ECMAScript's Number::toString writes it (ECMA-262 §6.1.6.1.20, the
/// algorithm RFC 8785 §3.2.2.3 adopts): the shortest digits that round-trip, placed as
/// digits, a decimal fraction or an exponent depending on the decimal exponent.
fn number(x: f64, out: &mut String) {
    if x == 0.0 {
        out.push('0'); // -0 too
        return;
    }
    let (digits, n) = shortest(x.abs());
    let k = digits.len() as i64;
    if x < 0.0 {
        out.push('-');
    }
    if k <= n && n <= 21 {
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        out.push_str(&digits[..n as usize]);
        out.push('.');
        out.push_str(&digits[n as usize..]);
    } else if -6 < n && n <= 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(&digits);
    } else {
        out.push_str(&digits[..1]);
        if k > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{}", if n > 0 { '+' } else { '-' }, (n - 1).abs());
    }
}

/// The fewest decimal digits that read back as `x` (positive, finite) and `n` with
/// `x ≈ 0.digits × 10^n`. Among equally short candidates ECMAScript takes the closest, and of
/// two equally close the even one; Rust's shortest formatting rounds such a tie up, so a tie
/// is detected from the exact expansion and settled to the even neighbour.
fn shortest(x: f64) -> (String, i64) {
    let split = |sci: &str| -> (String, i64) {
        let (mantissa, exp) = sci.split_once('e').unwrap_or((sci, "0"));
        let digits = mantissa.chars().filter(char::is_ascii_digit).collect();
        (digits, exp.parse::<i64>().unwrap_or(0) + 1)
    };
    let (mut digits, n) = split(&format!("{x:e}"));
    let odd = digits.bytes().last().is_some_and(|d| (d - b'0') % 2 == 1);
    // A tie needs an exact expansion of one digit more than the shortest (at most 18): 41
    // significant digits show it exactly, so only a candidate pays for the full expansion.
    let candidate = odd && {
        let (first, _) = split(&format!("{x:.40e}"));
        let first = first.trim_end_matches('0');
        first.len() == digits.len() + 1 && first.ends_with('5')
    };
    if candidate {
        // Every double's exact decimal expansion has at most 767 significant digits.
        let (exact, m) = split(&format!("{x:.800e}"));
        let exact = exact.trim_end_matches('0');
        let mut lower = digits.clone().into_bytes();
        if let Some(last) = lower.last_mut() {
            *last -= 1;
        }
        let tie = m == n
            && exact.len() == digits.len() + 1
            && exact.ends_with('5')
            && exact.as_bytes().starts_with(&lower);
        if tie {
            let lower = String::from_utf8(lower).unwrap_or_default();
            let text = format!("0.{lower}e{n}");
            if text.parse::<f64>() == Ok(x) {
                digits = lower;
            }
        }
    }
    (digits, n)
}

impl<'a> ser::Serializer for &'a mut Writer {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'a>;
    type SerializeTuple = Compound<'a>;
    type SerializeTupleStruct = Compound<'a>;
    type SerializeTupleVariant = Compound<'a>;
    type SerializeMap = Compound<'a>;
    type SerializeStruct = Compound<'a>;
    type SerializeStructVariant = Compound<'a>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.out.push_str(if v { "true" } else { "false" });
        Ok(())
    }
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        self.sint(i64::from(v))
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        self.sint(i64::from(v))
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        self.sint(i64::from(v))
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        self.sint(v)
    }
    fn serialize_i128(self, v: i128) -> Result<(), Error> {
        let v = i64::try_from(v).map_err(|_| Error::InexactInteger(v.to_string()))?;
        self.sint(v)
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        self.uint(u64::from(v))
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        self.uint(u64::from(v))
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        self.uint(u64::from(v))
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        self.uint(v)
    }
    fn serialize_u128(self, v: u128) -> Result<(), Error> {
        let v = u64::try_from(v).map_err(|_| Error::InexactInteger(v.to_string()))?;
        self.uint(v)
    }
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        // As `serde_json::to_value` does: the f32 widened to the double it is.
        self.serialize_f64(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        if !v.is_finite() {
            return Err(Error::NonFinite);
        }
        number(v, &mut self.out);
        Ok(())
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        string(v.encode_utf8(&mut [0; 4]), &mut self.out);
        Ok(())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        string(v, &mut self.out);
        Ok(())
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        // serde_json writes bytes as an array of numbers.
        self.open('[');
        for b in v {
            self.element();
            self.uint(u64::from(*b))?;
        }
        self.close_array();
        Ok(())
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.out.push_str("null");
        Ok(())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.open('{');
        self.member(variant);
        value.serialize(&mut *self)?;
        self.close_object()
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Compound<'a>, Error> {
        self.open('[');
        Ok(Compound::new(self, Close::Array))
    }
    fn serialize_tuple(self, len: usize) -> Result<Compound<'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Compound<'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a>, Error> {
        self.open('{');
        self.member(variant);
        self.open('[');
        Ok(Compound::new(self, Close::ArrayInObject))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Compound<'a>, Error> {
        self.open('{');
        Ok(Compound::new(self, Close::Object))
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Compound<'a>, Error> {
        self.serialize_map(None)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'a>, Error> {
        self.open('{');
        self.member(variant);
        self.open('{');
        Ok(Compound::new(self, Close::ObjectInObject))
    }
}

/// What closes a compound value.
#[derive(Debug, Clone, Copy)]
enum Close {
    Array,
    Object,
    /// `{"Variant": [...]}`
    ArrayInObject,
    /// `{"Variant": {...}}`
    ObjectInObject,
}

#[doc(hidden)]
#[derive(Debug)]
pub struct Compound<'a> {
    w: &'a mut Writer,
    close: Close,
}

impl<'a> Compound<'a> {
    fn new(w: &'a mut Writer, close: Close) -> Self {
        Compound { w, close }
    }

    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.w.element();
        value.serialize(&mut *self.w)
    }

    fn field<T: Serialize + ?Sized>(&mut self, name: &str, value: &T) -> Result<(), Error> {
        self.w.member(name);
        value.serialize(&mut *self.w)
    }

    fn finish(self) -> Result<(), Error> {
        match self.close {
            Close::Array => {
                self.w.close_array();
                Ok(())
            }
            Close::Object => self.w.close_object(),
            Close::ArrayInObject => {
                self.w.close_array();
                self.w.close_object()
            }
            Close::ObjectInObject => {
                self.w.close_object()?;
                self.w.close_object()
            }
        }
    }
}

impl ser::SerializeSeq for Compound<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeTuple for Compound<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeTupleStruct for Compound<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeTupleVariant for Compound<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeMap for Compound<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        key.serialize(MemberName(&mut *self.w))
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        value.serialize(&mut *self.w)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeStruct for Compound<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.field(name, value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for Compound<'_> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.field(name, value)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

/// A map key as serde_json takes one: a string, or an integer, boolean or char written as a
/// string; anything else has no member name.
struct MemberName<'a>(&'a mut Writer);

impl MemberName<'_> {
    fn name(self, name: &str) -> Result<(), Error> {
        self.0.member(name);
        Ok(())
    }
}

impl ser::Serializer for MemberName<'_> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = ser::Impossible<(), Error>;
    type SerializeTuple = ser::Impossible<(), Error>;
    type SerializeTupleStruct = ser::Impossible<(), Error>;
    type SerializeTupleVariant = ser::Impossible<(), Error>;
    type SerializeMap = ser::Impossible<(), Error>;
    type SerializeStruct = ser::Impossible<(), Error>;
    type SerializeStructVariant = ser::Impossible<(), Error>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_i128(self, v: i128) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_u128(self, v: u128) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_f32(self, _: f32) -> Result<(), Error> {
        Err(Error::KeyNotString("a number"))
    }
    fn serialize_f64(self, _: f64) -> Result<(), Error> {
        Err(Error::KeyNotString("a number"))
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.name(&v.to_string())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.name(v)
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Error> {
        Err(Error::KeyNotString("bytes"))
    }
    fn serialize_none(self) -> Result<(), Error> {
        Err(Error::KeyNotString("null"))
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        Err(Error::KeyNotString("null"))
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        Err(Error::KeyNotString("null"))
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.name(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        Err(Error::KeyNotString("an enum variant with data"))
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        Err(Error::KeyNotString("an array"))
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Error> {
        Err(Error::KeyNotString("an array"))
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        Err(Error::KeyNotString("an array"))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(Error::KeyNotString("an enum variant with data"))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Error> {
        Err(Error::KeyNotString("an object"))
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Error> {
        Err(Error::KeyNotString("an object"))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(Error::KeyNotString("an enum variant with data"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_compact_escaped() {
        let v = serde_json::json!({"b": [1, "x\n"], "a": {"z": null, "y": true}, "\u{e9}": 1, "A": "\u{1}"});
        assert_eq!(
            canonical(&v),
            "{\"A\":\"\\u0001\",\"a\":{\"y\":true,\"z\":null},\"b\":[1,\"x\\n\"],\"\u{e9}\":1}"
        );
    }
    /// RFC 8785 §3.2.3: properties sorted by their UTF-16 code units — the emoji (a surrogate
    /// pair, D83D…) sorts before U+FB33, though its code point is larger.
    #[test]
    fn rfc8785_property_sorting() {
        let v = serde_json::json!({
            "\u{20ac}": "Euro Sign",
            "\r": "Carriage Return",
            "\u{fb33}": "Hebrew Letter Dalet With Dagesh",
            "1": "One",
            "\u{1f600}": "Emoji: Grinning Face",
            "\u{80}": "Control",
            "\u{f6}": "Latin Small Letter O With Diaeresis"
        });
        assert_eq!(
            canonical(&v),
            "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u{80}\":\"Control\",\
             \"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\
             \"\u{1f600}\":\"Emoji: Grinning Face\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
        );
    }

    /// RFC 8785 Appendix B: IEEE 754 doubles and their canonical text, NaN and Infinity refused.
    #[test]
    fn rfc8785_number_samples() {
        let samples = [
            (0x0000000000000000_u64, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for (bits, want) in samples {
            let x = f64::from_bits(bits);
            assert_eq!(to_canonical(&x).unwrap().as_str(), want, "{bits:016x}");
            let v = serde_json::Value::from(x);
            assert_eq!(canonical(&v), want, "{bits:016x} as a Value");
        }
        for bits in [
            0x7fffffffffffffff_u64,
            0x7ff0000000000000,
            0xfff0000000000000,
        ] {
            assert_eq!(to_canonical(&f64::from_bits(bits)), Err(Error::NonFinite));
        }
    }

    #[derive(serde::Serialize)]
    enum Shape {
        Unit,
        New(u8),
        Tuple(u8, &'static str),
        Struct { z: bool, a: Option<u8> },
    }

    #[derive(serde::Serialize)]
    struct Fields {
        zeta: &'static str,
        alpha: Vec<Shape>,
        #[serde(flatten)]
        rest: std::collections::BTreeMap<String, serde_json::Value>,
        mid: (i64, u64, f32, char),
        bytes: &'static [u8],
        nested: Inner,
    }

    #[derive(serde::Serialize)]
    struct Inner {
        y: i8,
        b: &'static str,
    }

    /// Straight from a value equals through `serde_json::to_value`, for every serde shape.
    #[test]
    fn serialize_matches_value_path() {
        let mut rest = std::collections::BTreeMap::new();
        rest.insert("\u{1f600}".to_string(), serde_json::json!([1.5, null]));
        rest.insert(
            "\u{fb33}".to_string(),
            serde_json::json!({"q\"": "\u{7}\\"}),
        );
        rest.insert("B".to_string(), serde_json::json!(-0.0));
        let f = Fields {
            zeta: "tab\there",
            alpha: vec![
                Shape::Unit,
                Shape::New(7),
                Shape::Tuple(1, "x"),
                Shape::Struct { z: true, a: None },
            ],
            rest,
            mid: (-9_007_199_254_740_991, 9_007_199_254_740_991, 0.1, '\n'),
            bytes: b"\x00\xff",
            nested: Inner { y: -1, b: "é" },
        };
        let direct = to_canonical(&f).unwrap();
        let via_value = canonical(&serde_json::to_value(&f).unwrap());
        assert_eq!(direct.as_str(), via_value);
        // Top-level members, found without parsing.
        assert_eq!(direct.member("zeta"), Some("\"tab\\there\""));
        assert_eq!(direct.member("nested"), Some("{\"b\":\"é\",\"y\":-1}"));
        assert_eq!(direct.member("B"), Some("0"));
        assert_eq!(direct.member("y"), None, "only top-level members");
        assert_eq!(direct.member("absent"), None);
        // The text is a fixed point.
        let back: serde_json::Value = serde_json::from_str(direct.as_str()).unwrap();
        assert_eq!(canonical(&back), direct.as_str());
    }

    #[test]
    fn refusals() {
        let mut m = std::collections::HashMap::new();
        m.insert(vec![1u8], 1);
        assert_eq!(to_canonical(&m), Err(Error::KeyNotString("an array")));
        let mut m = std::collections::BTreeMap::new();
        m.insert(3u16, f64::NAN);
        assert_eq!(to_canonical(&m), Err(Error::NonFinite));
        let mut m = std::collections::BTreeMap::new();
        m.insert(10u16, "x");
        m.insert(9u16, "y");
        // Integer names are strings, sorted as strings.
        assert_eq!(to_canonical(&m).unwrap().as_str(), r#"{"10":"x","9":"y"}"#);
        assert!(to_canonical(&[1, 2]).unwrap().member("0").is_none());
        // Beyond ±(2^53 − 1): refused straight from a value, the rounded double from a `Value`
        // (RFC 8785, as V8 writes them).
        for big in [9_007_199_254_740_992_u64, u64::MAX] {
            assert_eq!(
                to_canonical(&big),
                Err(Error::InexactInteger(big.to_string()))
            );
        }
        assert_eq!(
            to_canonical(&i64::MIN),
            Err(Error::InexactInteger(i64::MIN.to_string()))
        );
        assert_eq!(
            to_canonical(&u128::MAX).map(|_| ()),
            Err(Error::InexactInteger(u128::MAX.to_string()))
        );
        assert_eq!(
            to_canonical(&-9_007_199_254_740_991_i64).unwrap().as_str(),
            "-9007199254740991"
        );
        assert_eq!(
            canonical(&serde_json::json!(9_007_199_254_740_993_u64)),
            "9007199254740992"
        );
        assert_eq!(
            canonical(&serde_json::json!(u64::MAX)),
            "18446744073709552000"
        );
        assert_eq!(
            canonical(&serde_json::json!(i64::MIN)),
            "-9223372036854776000"
        );
        // A name JSON escapes is never looked up (it would match another's escaped spelling).
        let escaped = to_canonical(&serde_json::json!({"x\"y": 2, "x\\\"y": 3})).unwrap();
        assert_eq!(escaped.member("x\\\"y"), None);
        assert_eq!(escaped.member("x\"y"), None);
        #[derive(serde::Serialize)]
        struct Twice {
            b: u8,
            a: u8,
            #[serde(flatten)]
            more: std::collections::BTreeMap<&'static str, u8>,
        }
        let more = [("b", 2)].into_iter().collect();
        assert_eq!(
            to_canonical(&Twice { b: 1, a: 0, more }),
            Err(Error::DuplicateMember("b".into()))
        );
    }

    /// Random values: both entry points agree, the text parses back to the value, and is a
    /// fixed point (canonicalizing the parsed text gives the same text).
    #[test]
    fn random_values_agree_and_round_trip() {
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        fn gen_value(next: &mut dyn FnMut() -> u64, depth: u32) -> serde_json::Value {
            let pick = next() % if depth > 3 { 5 } else { 7 };
            match pick {
                0 => serde_json::Value::Null,
                1 => serde_json::Value::Bool(next().is_multiple_of(2)),
                2 => serde_json::Value::from((next() as i64) >> (11 + next() % 53)),
                // Floats a parser reads back exactly whatever its precision (serde_json's
                // default parser may be one unit off on long ones); `random_doubles` covers
                // the rest.
                3 => serde_json::Value::from((next() as i32 >> 8) as f64 / 1024.0),
                4 => serde_json::Value::String(gen_str(next)),
                5 => (0..next() % 5)
                    .map(|_| gen_value(next, depth + 1))
                    .collect(),
                _ => serde_json::Value::Object(
                    (0..next() % 6)
                        .map(|_| (gen_str(next), gen_value(next, depth + 1)))
                        .collect(),
                ),
            }
        }
        fn gen_str(next: &mut dyn FnMut() -> u64) -> String {
            const ALPHABET: [char; 12] = [
                'a',
                'B',
                '0',
                '"',
                '\\',
                '\n',
                '\u{1}',
                '\u{7f}',
                'é',
                '\u{20ac}',
                '\u{fb33}',
                '\u{1f600}',
            ];
            (0..next() % 6)
                .map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize])
                .collect()
        }
        for _ in 0..2000 {
            let v = gen_value(&mut next, 0);
            let text = canonical(&v);
            assert_eq!(to_canonical(&v).unwrap().as_str(), text);
            let back: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(canonical(&back), text, "not a fixed point: {text}");
        }
    }

    /// Random doubles: the text reads back as the same double (Rust's correctly rounding
    /// parser), is as short as `{:e}` says the shortest is, and is written in the form
    /// ECMAScript picks for its exponent.
    #[test]
    fn random_doubles() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..20_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let x = f64::from_bits(seed);
            let Ok(c) = to_canonical(&x) else {
                assert!(!x.is_finite());
                continue;
            };
            let text = c.as_str();
            assert_eq!(text.parse::<f64>(), Ok(x), "{text} for {x:e}");
            let shortest = format!("{:e}", x.abs());
            let digits = |t: &str| {
                let m = t.split(['e', 'E']).next().unwrap_or(t);
                m.trim_start_matches(['-', '0', '.'])
                    .chars()
                    .filter(char::is_ascii_digit)
                    .count()
            };
            let sig = text
                .split('e')
                .next()
                .unwrap_or(text)
                .replace(['-', '.'], "");
            let sig = sig.trim_start_matches('0').trim_end_matches('0');
            assert!(
                sig.len() <= digits(&shortest),
                "{text} longer than {shortest}"
            );
            let exp = x.abs().log10().floor() as i64;
            assert_eq!(text.contains('e'), !(-6..21).contains(&exp), "{text}");
        }
    }
}
