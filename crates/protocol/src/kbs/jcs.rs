//! RFC 8785 JSON Canonicalization Scheme for the values CoCo binds (strings, objects, integers):
//! object keys sorted by UTF-16 code units, no whitespace, strings escaped as ECMAScript does.
//! Written out rather than left to `serde_json`'s map order, which a feature elsewhere in the
//! build graph could change.

use serde_json::Value;

/// The canonical form of `v`.
pub fn canonical(v: &Value) -> String {
    let mut out = String::new();
    write(v, &mut out);
    out
}

fn write(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        // Integers print as ECMAScript would; the values CoCo binds hold no floats.
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => string(s, out),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort_by(|a, b| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                string(k, out);
                out.push(':');
                if let Some(x) = m.get(*k) {
                    write(x, out);
                }
            }
            out.push('}');
        }
    }
}

fn string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
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
}
