//! A small XML tree and inclusive Canonical XML 1.1 (W3C, 2008; without comments) over it —
//! what NVIDIA's RIM signatures need: the whole document minus the enveloped signature, and the
//! `SignedInfo` subtree with the namespaces in scope at its position.
//!
//! Deliberately narrow: no DTDs (a DOCTYPE is refused, so no entity can change the text), only
//! the five predefined entities and character references, UTF-8 only. Prefixes are kept as
//! written, which c14n requires and DOM-style parsers that resolve namespaces often lose.

use std::collections::BTreeMap;

use quick_xml::events::Event;

use crate::error::{Error, Result};

pub const XML_NS: &str = "http://www.w3.org/XML/1998/namespace";

/// Namespaces in scope: prefix ("" for the default namespace) → URI.
pub type Scope = BTreeMap<String, String>;

/// An element with its attributes, in-scope namespaces and children.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element {
    /// Qualified name as written (`ds:Signature`).
    pub qname: String,
    /// Local part of the name.
    pub local: String,
    /// Namespace URI the name resolves to ("" when none).
    pub ns: String,
    /// Attributes other than namespace declarations: (qualified name, value after parsing).
    pub attrs: Vec<(String, String)>,
    /// Namespaces in scope at this element (declarations on it included).
    pub scope: Scope,
    pub children: Vec<Node>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Element(Element),
    Text(String),
    /// Processing instruction: (target, content).
    Pi(String, String),
}

impl Element {
    /// Value of an unprefixed attribute.
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Attribute by namespace URI and local name.
    pub fn attr_ns(&self, ns: &str, local: &str) -> Option<&str> {
        self.attrs.iter().find_map(|(k, v)| {
            let (p, l) = split(k);
            let uri = match p {
                Some(p) => self.scope.get(p).map(String::as_str).unwrap_or(""),
                None => "",
            };
            (l == local && uri == ns).then_some(v.as_str())
        })
    }

    /// Child elements.
    pub fn elements(&self) -> impl Iterator<Item = &Element> {
        self.children.iter().filter_map(|n| match n {
            Node::Element(e) => Some(e),
            _ => None,
        })
    }

    /// Child elements with this namespace and local name.
    pub fn children_named<'a>(
        &'a self,
        ns: &'a str,
        local: &'a str,
    ) -> impl Iterator<Item = &'a Element> + 'a {
        self.elements()
            .filter(move |e| e.ns == ns && e.local == local)
    }

    /// The only child element with this name; an error when absent or repeated.
    pub fn only_child(&self, ns: &str, local: &str) -> Result<&Element> {
        let mut it = self.elements().filter(|e| e.ns == ns && e.local == local);
        match (it.next(), it.next()) {
            (Some(e), None) => Ok(e),
            (None, _) => Err(Error::malformed("XML", format!("<{local}> is missing"))),
            (Some(_), Some(_)) => Err(Error::malformed("XML", format!("<{local}> appears twice"))),
        }
    }

    /// Concatenated text content of direct text children.
    pub fn text(&self) -> String {
        self.children
            .iter()
            .filter_map(|n| match n {
                Node::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }
}

fn split(qname: &str) -> (Option<&str>, &str) {
    match qname.split_once(':') {
        Some((p, l)) => (Some(p), l),
        None => (None, qname),
    }
}

fn bad(detail: impl Into<String>) -> Error {
    Error::malformed("XML", detail)
}

/// Attribute values as a conforming parser reports them: literal whitespace becomes a space
/// (XML 1.0 §3.3.3), then references are replaced.
fn attr_value(raw: &[u8]) -> Result<String> {
    let s = std::str::from_utf8(raw).map_err(|_| bad("attribute is not UTF-8"))?;
    let s: String = s
        .chars()
        .map(|c| {
            if matches!(c, '\t' | '\n' | '\r') {
                ' '
            } else {
                c
            }
        })
        .collect();
    quick_xml::escape::unescape(&s)
        .map(|c| c.into_owned())
        .map_err(|e| bad(format!("attribute value: {e}")))
}

/// Parse a document into its root element.
pub fn parse(xml: &[u8]) -> Result<Element> {
    let text = std::str::from_utf8(xml).map_err(|_| bad("document is not UTF-8"))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    // XML 1.0 §2.11: line ends are normalized to LF before parsing.
    let text = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut reader = quick_xml::Reader::from_str(&text);
    reader.config_mut().expand_empty_elements = true;
    reader.config_mut().check_end_names = true;
    let mut stack: Vec<Element> = Vec::new();
    let mut root: Option<Element> = None;
    loop {
        let event = reader
            .read_event()
            .map_err(|e| bad(format!("at byte {}: {e}", reader.buffer_position())))?;
        match event {
            Event::Start(e) => {
                if root.is_some() {
                    return Err(bad("content after the root element"));
                }
                let qname = std::str::from_utf8(e.name().as_ref())
                    .map_err(|_| bad("element name is not UTF-8"))?
                    .to_string();
                let mut scope = stack.last().map(|p| p.scope.clone()).unwrap_or_default();
                let mut attrs = Vec::new();
                for a in e.attributes() {
                    let a = a.map_err(|e| bad(format!("attribute: {e}")))?;
                    let key = std::str::from_utf8(a.key.as_ref())
                        .map_err(|_| bad("attribute name is not UTF-8"))?
                        .to_string();
                    let value = attr_value(&a.value)?;
                    if key == "xmlns" {
                        scope.insert(String::new(), value);
                    } else if let Some(p) = key.strip_prefix("xmlns:") {
                        if value.is_empty() {
                            return Err(bad(format!("prefix '{p}' undeclared to empty")));
                        }
                        scope.insert(p.to_string(), value);
                    } else {
                        attrs.push((key, value));
                    }
                }
                let (prefix, local) = split(&qname);
                let ns = match prefix {
                    Some("xml") => XML_NS.to_string(),
                    Some(p) => scope
                        .get(p)
                        .cloned()
                        .ok_or_else(|| bad(format!("prefix '{p}' is not declared")))?,
                    None => scope.get("").cloned().unwrap_or_default(),
                };
                for (k, _) in &attrs {
                    if let (Some(p), _) = split(k)
                        && p != "xml"
                        && !scope.contains_key(p)
                    {
                        return Err(bad(format!("attribute prefix '{p}' is not declared")));
                    }
                }
                let local = local.to_string();
                stack.push(Element {
                    qname,
                    local,
                    ns,
                    attrs,
                    scope,
                    children: Vec::new(),
                });
            }
            Event::End(_) => {
                let done = stack.pop().ok_or_else(|| bad("unbalanced end tag"))?;
                match stack.last_mut() {
                    Some(parent) => parent.children.push(Node::Element(done)),
                    None => root = Some(done),
                }
            }
            Event::Text(t) => {
                let s = t.decode().map_err(|e| bad(format!("text: {e}")))?;
                push_text(&mut stack, &s)?;
            }
            Event::CData(t) => {
                let s = std::str::from_utf8(&t).map_err(|_| bad("CDATA is not UTF-8"))?;
                push_text(&mut stack, s)?;
            }
            Event::GeneralRef(r) => {
                let s = if r.is_char_ref() {
                    r.resolve_char_ref()
                        .map_err(|e| bad(format!("character reference: {e}")))?
                        .ok_or_else(|| bad("character reference"))?
                        .to_string()
                } else {
                    let name = r.decode().map_err(|e| bad(format!("reference: {e}")))?;
                    match name.as_ref() {
                        "lt" => "<",
                        "gt" => ">",
                        "amp" => "&",
                        "apos" => "'",
                        "quot" => "\"",
                        other => return Err(bad(format!("undefined entity '&{other};'"))),
                    }
                    .to_string()
                };
                push_text(&mut stack, &s)?;
            }
            Event::PI(pi) => {
                if let Some(parent) = stack.last_mut() {
                    let target = String::from_utf8_lossy(pi.target()).into_owned();
                    let content = String::from_utf8_lossy(pi.content())
                        .trim_start()
                        .to_string();
                    parent.children.push(Node::Pi(target, content));
                }
            }
            Event::DocType(_) => return Err(bad("DOCTYPE is not accepted")),
            Event::Comment(_) | Event::Decl(_) => {}
            Event::Empty(_) => return Err(bad("unexpected empty-element event")),
            Event::Eof => break,
        }
    }
    if !stack.is_empty() {
        return Err(bad("document ends inside an element"));
    }
    root.ok_or_else(|| bad("no root element"))
}

fn push_text(stack: &mut [Element], s: &str) -> Result<()> {
    match stack.last_mut() {
        Some(parent) => {
            if let Some(Node::Text(prev)) = parent.children.last_mut() {
                prev.push_str(s);
            } else {
                parent.children.push(Node::Text(s.to_string()));
            }
            Ok(())
        }
        // Whitespace around the root is not part of the document's content.
        None if s.chars().all(char::is_whitespace) => Ok(()),
        None => Err(bad("text outside the root element")),
    }
}

/// Canonical form of `apex` and its subtree, skipping `exclude` (compared by address) —
/// the enveloped-signature transform. `apex.scope` already holds every namespace in scope at
/// its position, so the inherited declarations are rendered on it as c14n requires.
pub fn canonicalize(apex: &Element, exclude: Option<&Element>) -> String {
    let mut out = String::new();
    write_element(&mut out, apex, &Scope::new(), exclude);
    out
}

fn write_element(out: &mut String, e: &Element, rendered: &Scope, exclude: Option<&Element>) {
    out.push('<');
    out.push_str(&e.qname);
    // Namespace declarations: those whose binding differs from the nearest output ancestor's,
    // sorted by prefix with the default namespace first (BTreeMap order: "" sorts first).
    for (prefix, uri) in &e.scope {
        if prefix == "xml" || rendered.get(prefix) == Some(uri) {
            continue;
        }
        if prefix.is_empty() {
            if uri.is_empty() && rendered.get("").is_none_or(|u| u.is_empty()) {
                continue;
            }
            out.push_str(" xmlns=\"");
        } else {
            out.push_str(" xmlns:");
            out.push_str(prefix);
            out.push_str("=\"");
        }
        escape_attr(out, uri);
        out.push('"');
    }
    if !e.scope.contains_key("") && rendered.get("").is_some_and(|u| !u.is_empty()) {
        out.push_str(" xmlns=\"\"");
    }
    // Attributes sorted by namespace URI (none first), then local name.
    let mut attrs: Vec<(&str, &str, &str, &str)> = e
        .attrs
        .iter()
        .map(|(k, v)| {
            let (p, l) = split(k);
            let uri = match p {
                Some("xml") => XML_NS,
                Some(p) => e.scope.get(p).map(String::as_str).unwrap_or(""),
                None => "",
            };
            (uri, l, k.as_str(), v.as_str())
        })
        .collect();
    attrs.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    for (_, _, k, v) in attrs {
        out.push(' ');
        out.push_str(k);
        out.push_str("=\"");
        escape_attr(out, v);
        out.push('"');
    }
    out.push('>');
    for child in &e.children {
        match child {
            Node::Element(c) => {
                if exclude.is_some_and(|x| std::ptr::eq(x, c)) {
                    continue;
                }
                write_element(out, c, &e.scope, exclude);
            }
            Node::Text(t) => escape_text(out, t),
            Node::Pi(target, content) => {
                out.push_str("<?");
                out.push_str(target);
                if !content.is_empty() {
                    out.push(' ');
                    out.push_str(content);
                }
                out.push_str("?>");
            }
        }
    }
    out.push_str("</");
    out.push_str(&e.qname);
    out.push('>');
}

fn escape_text(out: &mut String, t: &str) {
    for c in t.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '\r' => out.push_str("&#xD;"),
            c => out.push(c),
        }
    }
}

fn escape_attr(out: &mut String, t: &str) {
    for c in t.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '"' => out.push_str("&quot;"),
            '\t' => out.push_str("&#x9;"),
            '\n' => out.push_str("&#xA;"),
            '\r' => out.push_str("&#xD;"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_form_of_w3c_style_example() {
        // Empty elements expanded, attributes sorted by (namespace, local), namespace
        // declarations first and only where they change, character references resolved.
        let doc = br#"<?xml version="1.0"?>
<doc xmlns="http://example/d" xmlns:a="http://example/a">
   <e1   />
   <e2 b="2" a:x="&#x41;" a="1"   ><!-- c --><a:f xmlns:a="http://example/a">t &amp; &#60;</a:f></e2>
   <e3 xmlns="">x&#xD;</e3>
</doc>"#;
        let root = parse(doc).unwrap();
        let c = canonicalize(&root, None);
        assert_eq!(
            c,
            "<doc xmlns=\"http://example/d\" xmlns:a=\"http://example/a\">\n   <e1></e1>\n   \
             <e2 a=\"1\" b=\"2\" a:x=\"A\"><a:f>t &amp; &lt;</a:f></e2>\n   \
             <e3 xmlns=\"\">x&#xD;</e3>\n</doc>"
        );
        // A subtree inherits the declarations in scope.
        let Node::Element(e2) = &root.children[3] else {
            panic!()
        };
        assert_eq!(
            canonicalize(e2, None),
            "<e2 xmlns=\"http://example/d\" xmlns:a=\"http://example/a\" a=\"1\" b=\"2\" \
             a:x=\"A\"><a:f>t &amp; &lt;</a:f></e2>"
        );
    }

    #[test]
    fn refuses_doctype_and_bad_input() {
        assert!(parse(b"<!DOCTYPE x [<!ENTITY e \"boom\">]><x>&e;</x>").is_err());
        assert!(parse(b"<x>&e;</x>").is_err());
        assert!(parse(b"<x><y></x>").is_err());
        assert!(parse(b"<p:x/>").is_err());
        assert!(parse(b"").is_err());
        assert!(parse(&[0xff, 0xfe]).is_err());
    }
}
