//! The little DER this crate writes and reads (RSA public keys for JWE, the development TLS
//! certificate) and PEM armour.

/// One TLV with a definite length.
pub fn tlv(tag: u8, v: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = v.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let b = len.to_be_bytes();
        let skip = b.iter().take_while(|&&x| x == 0).count();
        out.push(0x80 | (b.len() - skip) as u8);
        out.extend_from_slice(&b[skip..]);
    }
    out.extend_from_slice(v);
    out
}

pub fn seq(parts: &[Vec<u8>]) -> Vec<u8> {
    tlv(0x30, &parts.concat())
}

/// An unsigned INTEGER from big-endian magnitude bytes.
pub fn uint(v: &[u8]) -> Vec<u8> {
    let skip = v.iter().take_while(|&&b| b == 0).count();
    let mut m = v[skip..].to_vec();
    if m.first().is_none_or(|b| b & 0x80 != 0) {
        m.insert(0, 0);
    }
    tlv(0x02, &m)
}

/// Read one TLV: (tag, value, rest); `None` on any malformation.
pub fn read(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first & 0x80 == 0 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7F);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |a, &b| (a << 8) | usize::from(b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// PEM armour, 64 columns.
pub fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// The DER blocks labelled `label` in a PEM text, in order.
pub fn pem_blocks(text: &str, label: &str) -> Vec<Vec<u8>> {
    use base64::Engine;
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    text.split(&begin)
        .skip(1)
        .filter_map(|b| {
            let body: String = b.split(&end).next()?.split_whitespace().collect();
            base64::engine::general_purpose::STANDARD.decode(body).ok()
        })
        .collect()
}
