//! Serialize any value straight into a [`regorus::Value`], as
//! `regorus::Value::from(serde_json::to_value(v))` would build it, without the `serde_json`
//! tree in between: a release policy's input is built per request, and the tree (every string
//! allocated twice, every map built twice) cost a CoCo flow about 4% of the KBS's CPU.
//!
//! Equal to the two-step conversion (the same serde data model, mapped the way `serde_json`
//! maps it: non-finite floats are null, bytes are arrays of numbers, enum variants are one-key
//! objects, map keys are strings, or integers, booleans and characters written as text), as the
//! differential tests below check, with three deliberate differences:
//!
//! - an object whose first member is named `$serde_json::private::Number` stays an object. The
//!   round trip turned it into a number, or the whole value into `undefined` (a requester
//!   could name a query parameter so);
//! - a float map key is refused (`serde_json` writes it as text): every input here is keyed by
//!   strings;
//! - a `serde_json::value::RawValue` is refused (`serde_json` parses it): none is reachable from
//!   the values converted here, and an error beats a silently different value.

use std::collections::BTreeMap;
use std::fmt::Display;

use regorus::Value;
use serde::Serialize;
use serde::ser::{self, Impossible};

/// Why a value could not be serialized (a map key that is not a string or an integer, or a
/// type's own `Serialize` failing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToRegoError(String);

impl Display for ToRegoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ToRegoError {}

impl ser::Error for ToRegoError {
    fn custom<T: Display>(msg: T) -> Self {
        ToRegoError(msg.to_string())
    }
}

/// `value` as a Rego value.
pub fn to_rego<T: Serialize + ?Sized>(value: &T) -> Result<Value, ToRegoError> {
    value.serialize(RegoSerializer)
}

/// The struct name `serde_json` gives a `RawValue` when serializing it.
const RAW_VALUE: &str = "$serde_json::private::RawValue";

/// Serializes into a [`Value`].
struct RegoSerializer;

type Object = BTreeMap<Value, Value>;

fn one_key(key: &'static str, value: Value) -> Value {
    let mut m = Object::new();
    m.insert(Value::from(key), value);
    Value::from(m)
}

impl ser::Serializer for RegoSerializer {
    type Ok = Value;
    type Error = ToRegoError;
    type SerializeSeq = Seq;
    type SerializeTuple = Seq;
    type SerializeTupleStruct = Seq;
    type SerializeTupleVariant = Variant<Seq>;
    type SerializeMap = Map;
    type SerializeStruct = Map;
    type SerializeStructVariant = Variant<Map>;

    fn serialize_bool(self, v: bool) -> Result<Value, ToRegoError> {
        Ok(Value::from(v))
    }
    fn serialize_i8(self, v: i8) -> Result<Value, ToRegoError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i16(self, v: i16) -> Result<Value, ToRegoError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i32(self, v: i32) -> Result<Value, ToRegoError> {
        self.serialize_i64(v.into())
    }
    fn serialize_i64(self, v: i64) -> Result<Value, ToRegoError> {
        // serde_json keeps a non-negative integer as unsigned, and regorus reads it so.
        Ok(u64::try_from(v).map_or_else(|_| Value::from(v), Value::from))
    }
    fn serialize_i128(self, v: i128) -> Result<Value, ToRegoError> {
        match (u64::try_from(v), i64::try_from(v)) {
            (Ok(u), _) => Ok(Value::from(u)),
            (_, Ok(i)) => Ok(Value::from(i)),
            _ => Err(ToRegoError("number out of range".into())),
        }
    }
    fn serialize_u8(self, v: u8) -> Result<Value, ToRegoError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u16(self, v: u16) -> Result<Value, ToRegoError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u32(self, v: u32) -> Result<Value, ToRegoError> {
        self.serialize_u64(v.into())
    }
    fn serialize_u64(self, v: u64) -> Result<Value, ToRegoError> {
        Ok(Value::from(v))
    }
    fn serialize_u128(self, v: u128) -> Result<Value, ToRegoError> {
        u64::try_from(v)
            .map(Value::from)
            .map_err(|_| ToRegoError("number out of range".into()))
    }
    fn serialize_f32(self, v: f32) -> Result<Value, ToRegoError> {
        self.serialize_f64(v.into())
    }
    fn serialize_f64(self, v: f64) -> Result<Value, ToRegoError> {
        // serde_json writes a non-finite float as null.
        Ok(if v.is_finite() {
            Value::from(v)
        } else {
            Value::Null
        })
    }
    fn serialize_char(self, v: char) -> Result<Value, ToRegoError> {
        Ok(Value::from(v.encode_utf8(&mut [0; 4]) as &str))
    }
    fn serialize_str(self, v: &str) -> Result<Value, ToRegoError> {
        Ok(Value::from(v))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Value, ToRegoError> {
        Ok(Value::from(
            v.iter()
                .map(|b| Value::from(u64::from(*b)))
                .collect::<Vec<_>>(),
        ))
    }
    fn serialize_none(self) -> Result<Value, ToRegoError> {
        Ok(Value::Null)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<Value, ToRegoError> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<Value, ToRegoError> {
        Ok(Value::Null)
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<Value, ToRegoError> {
        Ok(Value::Null)
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<Value, ToRegoError> {
        Ok(Value::from(variant))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<Value, ToRegoError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<Value, ToRegoError> {
        Ok(one_key(variant, value.serialize(self)?))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<Seq, ToRegoError> {
        Ok(Seq(Vec::with_capacity(len.unwrap_or(0).min(4096))))
    }
    fn serialize_tuple(self, len: usize) -> Result<Seq, ToRegoError> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Seq, ToRegoError> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Variant<Seq>, ToRegoError> {
        Ok(Variant {
            name: variant,
            inner: self.serialize_seq(Some(len))?,
        })
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Map, ToRegoError> {
        Ok(Map {
            map: Object::new(),
            key: None,
        })
    }
    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Map, ToRegoError> {
        if name == RAW_VALUE {
            return Err(ToRegoError("raw JSON values are not supported".into()));
        }
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Variant<Map>, ToRegoError> {
        Ok(Variant {
            name: variant,
            inner: self.serialize_map(Some(len))?,
        })
    }
}

/// An array being built.
struct Seq(Vec<Value>);

impl Seq {
    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ToRegoError> {
        self.0.push(value.serialize(RegoSerializer)?);
        Ok(())
    }
}

impl ser::SerializeSeq for Seq {
    type Ok = Value;
    type Error = ToRegoError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ToRegoError> {
        self.push(value)
    }
    fn end(self) -> Result<Value, ToRegoError> {
        Ok(Value::from(self.0))
    }
}

impl ser::SerializeTuple for Seq {
    type Ok = Value;
    type Error = ToRegoError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ToRegoError> {
        self.push(value)
    }
    fn end(self) -> Result<Value, ToRegoError> {
        Ok(Value::from(self.0))
    }
}

impl ser::SerializeTupleStruct for Seq {
    type Ok = Value;
    type Error = ToRegoError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ToRegoError> {
        self.push(value)
    }
    fn end(self) -> Result<Value, ToRegoError> {
        Ok(Value::from(self.0))
    }
}

/// An object being built (a key waits for its value).
struct Map {
    map: Object,
    key: Option<Value>,
}

impl ser::SerializeMap for Map {
    type Ok = Value;
    type Error = ToRegoError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), ToRegoError> {
        self.key = Some(key.serialize(KeySerializer)?);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ToRegoError> {
        let key = self
            .key
            .take()
            .ok_or_else(|| ToRegoError("a map value without its key".into()))?;
        self.map.insert(key, value.serialize(RegoSerializer)?);
        Ok(())
    }
    fn end(self) -> Result<Value, ToRegoError> {
        Ok(Value::from(self.map))
    }
}

impl ser::SerializeStruct for Map {
    type Ok = Value;
    type Error = ToRegoError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), ToRegoError> {
        self.map
            .insert(Value::from(key), value.serialize(RegoSerializer)?);
        Ok(())
    }
    fn end(self) -> Result<Value, ToRegoError> {
        Ok(Value::from(self.map))
    }
}

/// A tuple or struct variant: `{variant: inner}`.
struct Variant<T> {
    name: &'static str,
    inner: T,
}

impl ser::SerializeTupleVariant for Variant<Seq> {
    type Ok = Value;
    type Error = ToRegoError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ToRegoError> {
        self.inner.push(value)
    }
    fn end(self) -> Result<Value, ToRegoError> {
        Ok(one_key(self.name, Value::from(self.inner.0)))
    }
}

impl ser::SerializeStructVariant for Variant<Map> {
    type Ok = Value;
    type Error = ToRegoError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), ToRegoError> {
        ser::SerializeStruct::serialize_field(&mut self.inner, key, value)
    }
    fn end(self) -> Result<Value, ToRegoError> {
        Ok(one_key(self.name, Value::from(self.inner.map)))
    }
}

/// A map key: a string as it is; an integer, a boolean or a unit variant as its text (as
/// `serde_json` writes them); anything else refused.
struct KeySerializer;

fn key_text(text: impl ToString) -> Result<Value, ToRegoError> {
    Ok(Value::from(text.to_string()))
}

fn not_a_key() -> ToRegoError {
    ToRegoError("a map key must be a string".into())
}

impl ser::Serializer for KeySerializer {
    type Ok = Value;
    type Error = ToRegoError;
    type SerializeSeq = Impossible<Value, ToRegoError>;
    type SerializeTuple = Impossible<Value, ToRegoError>;
    type SerializeTupleStruct = Impossible<Value, ToRegoError>;
    type SerializeTupleVariant = Impossible<Value, ToRegoError>;
    type SerializeMap = Impossible<Value, ToRegoError>;
    type SerializeStruct = Impossible<Value, ToRegoError>;
    type SerializeStructVariant = Impossible<Value, ToRegoError>;

    fn serialize_bool(self, v: bool) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_i8(self, v: i8) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_i16(self, v: i16) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_i32(self, v: i32) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_i64(self, v: i64) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_i128(self, v: i128) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_u8(self, v: u8) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_u16(self, v: u16) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_u32(self, v: u32) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_u64(self, v: u64) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_u128(self, v: u128) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_f32(self, _: f32) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_f64(self, _: f64) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_char(self, v: char) -> Result<Value, ToRegoError> {
        key_text(v)
    }
    fn serialize_str(self, v: &str) -> Result<Value, ToRegoError> {
        Ok(Value::from(v))
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_none(self) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_unit(self) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<Value, ToRegoError> {
        Ok(Value::from(variant))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<Value, ToRegoError> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<Value, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStruct, ToRegoError> {
        Err(not_a_key())
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, ToRegoError> {
        Err(not_a_key())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashMap};

    use serde::Serialize;
    use serde_json::json;

    use super::*;

    /// The two-step conversion this module replaces.
    fn via_json<T: Serialize>(v: &T) -> Value {
        Value::from(serde_json::to_value(v).unwrap())
    }

    #[derive(Serialize)]
    enum Shape {
        Unit,
        New(u8),
        Tuple(i32, String),
        Struct { side: f64, tags: Vec<&'static str> },
    }

    #[derive(Serialize)]
    struct Everything {
        flag: bool,
        small: i8,
        negative: i64,
        positive: i64,
        big: u64,
        wide: i128,
        unsigned_wide: u128,
        half: f32,
        real: f64,
        nan: f64,
        infinite: f32,
        letter: char,
        text: String,
        #[serde(with = "serde_bytes_like")]
        bytes: Vec<u8>,
        absent: Option<String>,
        present: Option<u16>,
        unit: (),
        pair: (u8, &'static str),
        shapes: Vec<Shape>,
        by_number: BTreeMap<i32, String>,
        by_flag: BTreeMap<bool, u8>,
        by_name: HashMap<String, String>,
        #[serde(flatten)]
        flattened: BTreeMap<String, serde_json::Value>,
        json: serde_json::Value,
    }

    /// Bytes through `serialize_bytes` (what `serde_bytes` does), not as a sequence.
    mod serde_bytes_like {
        pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(v)
        }
    }

    #[test]
    fn equals_the_conversion_through_serde_json() {
        let v = Everything {
            flag: true,
            small: -3,
            negative: -1 << 40,
            positive: 1 << 40,
            big: u64::MAX,
            wide: -5,
            unsigned_wide: 7,
            half: 0.5,
            real: -2.25e10,
            nan: f64::NAN,
            infinite: f32::INFINITY,
            letter: 'é',
            text: "a \"quoted\" ünïcode \u{1F512} line\n".into(),
            bytes: vec![0, 1, 254, 255],
            absent: None,
            present: Some(443),
            unit: (),
            pair: (9, "nine"),
            shapes: vec![
                Shape::Unit,
                Shape::New(4),
                Shape::Tuple(-1, "t".into()),
                Shape::Struct {
                    side: 1.5,
                    tags: vec!["a", "b"],
                },
            ],
            by_number: [(-2, "minus two".into()), (10, "ten".into())].into(),
            by_flag: [(true, 1), (false, 0)].into(),
            by_name: [("lease".into(), "l-1".into()), ("x".into(), "".into())].into(),
            flattened: [("extra".into(), json!({"deep": [1, {"k": null}]}))].into(),
            json: json!({"n": 1, "f": 1.25, "neg": -7, "s": "x", "a": [true, null], "o": {}}),
        };
        assert_eq!(to_rego(&v).unwrap(), via_json(&v));
    }

    #[test]
    fn an_ear_converts_as_through_serde_json() {
        let ear: cgx_attestation::results::Ear = serde_json::from_value(json!({
            "eat_profile": "tag:ietf.org,2026:rats/ear#04",
            "iat": 1_790_000_000,
            "exp": 1_790_000_300,
            "ear_verifier_id": {"developer": "cgx", "build": "test"},
            "ear_status": "affirming",
            "eat_nonce": "bm9uY2U",
            "submods": {
                "cpu0": {
                    "ear_status": "affirming",
                    "ear_trustworthiness_vector": {"instance-identity": 2, "hardware": 2},
                    "ear_appraisal_policy_ids": ["policy:cgx-default"],
                    "ear_verifier_claims": {
                        "cgx.kind": "sample",
                        "sample": {"svn": 1, "launch_digest": "abcd", "tcb": [1, 2, 3]},
                        "ratio": 0.5
                    }
                },
                "gpu0": {"ear_status": "warning"}
            }
        }))
        .unwrap();
        assert_eq!(to_rego(&ear).unwrap(), via_json(&ear));
    }

    #[test]
    fn keys_serde_json_refuses_are_refused() {
        let by_bytes: BTreeMap<Vec<u8>, u8> = [(vec![1], 1)].into();
        assert!(serde_json::to_value(&by_bytes).is_err());
        assert_eq!(
            to_rego(&by_bytes).unwrap_err().to_string(),
            "a map key must be a string"
        );
    }

    #[test]
    fn the_deliberate_differences() {
        // A float key: serde_json writes it as text, this refuses it.
        let by_float: HashMap<String, f64> = [("k".to_string(), 0.5)].into();
        assert_eq!(to_rego(&by_float).unwrap(), via_json(&by_float));
        #[derive(Serialize)]
        struct FloatKeyed(#[serde(serialize_with = "float_keyed")] ());
        fn float_keyed<S: serde::Serializer>(_: &(), s: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeMap;
            let mut m = s.serialize_map(Some(1))?;
            m.serialize_entry(&1.5f64, "x")?;
            m.end()
        }
        assert!(serde_json::to_value(FloatKeyed(())).is_ok());
        assert_eq!(
            to_rego(&FloatKeyed(())).unwrap_err().to_string(),
            "a map key must be a string"
        );
        // serde_json's private number member: the round trip made the whole object a number
        // (or undefined); here it is the object a requester sent.
        let query: HashMap<String, String> =
            [("$serde_json::private::Number".to_string(), "5".to_string())].into();
        assert_eq!(via_json(&query), Value::from(5u64));
        let kept = to_rego(&query).unwrap();
        assert_eq!(kept["$serde_json::private::Number"], Value::from("5"));
        let query: HashMap<String, String> =
            [("$serde_json::private::Number".to_string(), "x".to_string())].into();
        assert_eq!(via_json(&query), Value::Undefined);
        assert_eq!(
            to_rego(&query).unwrap()["$serde_json::private::Number"],
            Value::from("x")
        );
        // A raw value: refused, not carried as a one-member object.
        let raw = serde_json::value::RawValue::from_string("[1,2]".into()).unwrap();
        assert_eq!(
            to_rego(&raw).unwrap_err().to_string(),
            "raw JSON values are not supported"
        );
    }
}
