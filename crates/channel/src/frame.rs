//! The channel's frames (sans-IO).
//!
//! ```text
//! offset size  field
//! 0      4     stream id, big-endian; 0 is never a stream
//! 4      1     kind: 1 OPEN, 2 DATA, 3 FIN, 4 RESET, 5 CREDIT
//! 5      4     payload length, big-endian, at most MAX_PAYLOAD
//! 9      n     payload
//! ```
//!
//! - OPEN: the target's name (1 to 320 bytes of `[A-Za-z0-9._/-]`, no `..`, not starting with
//!   `/`); only the guest opens.
//! - DATA: 1 to [`MAX_PAYLOAD`] bytes; the sender may have at most [`WINDOW`] bytes of a stream
//!   unacknowledged (a slow stream stalls no other).
//! - FIN: the sender sends no more on this stream (TCP's half-close); empty.
//! - RESET: the stream is gone, with a reason (UTF-8, at most 256 bytes).
//! - CREDIT: the receiver consumed this many more bytes (4 bytes, big-endian, above 0).
//!
//! A frame that breaks a rule is a [`FrameError`]: the link is broken or hostile, and its
//! streams end.

/// Bytes before a payload.
pub const HEADER: usize = 9;
/// The most one frame carries.
pub const MAX_PAYLOAD: usize = 64 * 1024;
/// The most a stream's sender may have in flight (sent, not yet credited back).
pub const WINDOW: u32 = 256 * 1024;
/// The longest target name (`store/` and a 255-byte file name fit).
pub const MAX_TARGET: usize = 320;
/// The longest reset reason.
pub const MAX_REASON: usize = 256;

/// A frame's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Open = 1,
    Data = 2,
    Fin = 3,
    Reset = 4,
    Credit = 5,
}

/// One frame, borrowed from the decoder's buffer or the sender's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<'a> {
    Open { stream: u32, target: &'a str },
    Data { stream: u32, bytes: &'a [u8] },
    Fin { stream: u32 },
    Reset { stream: u32, reason: &'a str },
    Credit { stream: u32, bytes: u32 },
}

/// Why a frame is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    #[error("frame kind {0} is not one of OPEN, DATA, FIN, RESET, CREDIT")]
    UnknownKind(u8),
    #[error("a frame of {0} bytes is over the {MAX_PAYLOAD}-byte limit")]
    TooLong(u32),
    #[error("stream id 0 is never a stream")]
    StreamZero,
    #[error("OPEN target refused: {0}")]
    Target(&'static str),
    #[error("DATA with no bytes")]
    EmptyData,
    #[error("FIN carries no payload")]
    FinPayload,
    #[error("RESET reason: over {MAX_REASON} bytes or not UTF-8")]
    Reason,
    #[error("CREDIT is 4 bytes above 0")]
    Credit,
}

impl Frame<'_> {
    pub fn stream(&self) -> u32 {
        match *self {
            Frame::Open { stream, .. }
            | Frame::Data { stream, .. }
            | Frame::Fin { stream }
            | Frame::Reset { stream, .. }
            | Frame::Credit { stream, .. } => stream,
        }
    }

    /// The frame's bytes, appended to `out`. A frame this module would refuse is refused
    /// here too (a sender cannot emit what its peer must drop).
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), FrameError> {
        let credit;
        let (kind, payload): (Kind, &[u8]) = match self {
            Frame::Open { target, .. } => {
                check_target(target)?;
                (Kind::Open, target.as_bytes())
            }
            Frame::Data { bytes, .. } => (Kind::Data, bytes),
            Frame::Fin { .. } => (Kind::Fin, &[]),
            Frame::Reset { reason, .. } => (Kind::Reset, reason.as_bytes()),
            Frame::Credit { bytes, .. } => {
                credit = bytes.to_be_bytes();
                (Kind::Credit, &credit)
            }
        };
        let len = u32::try_from(payload.len()).map_err(|_| FrameError::TooLong(u32::MAX))?;
        if payload.len() > MAX_PAYLOAD {
            return Err(FrameError::TooLong(len));
        }
        let start = out.len();
        out.extend_from_slice(&header(self.stream(), kind, len));
        out.extend_from_slice(payload);
        // Checked as the peer will check it; nothing is left in `out` on refusal.
        if let Err(e) = parse(kind as u8, self.stream(), &out[start + HEADER..]) {
            out.truncate(start);
            return Err(e);
        }
        Ok(())
    }
}

/// A frame's header (the table above): what the DATA path writes before a payload it does not
/// copy.
pub fn header(stream: u32, kind: Kind, len: u32) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(&stream.to_be_bytes());
    h[4] = kind as u8;
    h[5..].copy_from_slice(&len.to_be_bytes());
    h
}

/// The rule for a target's name: a short relative path of plain characters. The host maps
/// names to what it serves; a name never reaches a file system or resolver unchecked.
pub fn check_target(t: &str) -> Result<(), FrameError> {
    if t.is_empty() || t.len() > MAX_TARGET {
        return Err(FrameError::Target("1 to 320 bytes"));
    }
    if !t
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'/' | b'-'))
    {
        return Err(FrameError::Target("only A-Z a-z 0-9 . _ / -"));
    }
    if t.starts_with('/')
        || t.ends_with('/')
        || t.split('/').any(|p| p.is_empty() || p == ".." || p == ".")
    {
        return Err(FrameError::Target(
            "a relative name without empty, . or .. parts",
        ));
    }
    Ok(())
}

fn parse(kind: u8, stream: u32, payload: &[u8]) -> Result<Frame<'_>, FrameError> {
    if stream == 0 {
        return Err(FrameError::StreamZero);
    }
    Ok(match kind {
        1 => {
            let target =
                std::str::from_utf8(payload).map_err(|_| FrameError::Target("not UTF-8"))?;
            check_target(target)?;
            Frame::Open { stream, target }
        }
        2 if payload.is_empty() => return Err(FrameError::EmptyData),
        2 => Frame::Data {
            stream,
            bytes: payload,
        },
        3 if !payload.is_empty() => return Err(FrameError::FinPayload),
        3 => Frame::Fin { stream },
        4 => {
            if payload.len() > MAX_REASON {
                return Err(FrameError::Reason);
            }
            let reason = std::str::from_utf8(payload).map_err(|_| FrameError::Reason)?;
            Frame::Reset { stream, reason }
        }
        5 => {
            let b: [u8; 4] = payload.try_into().map_err(|_| FrameError::Credit)?;
            let bytes = u32::from_be_bytes(b);
            if bytes == 0 {
                return Err(FrameError::Credit);
            }
            Frame::Credit { stream, bytes }
        }
        k => return Err(FrameError::UnknownKind(k)),
    })
}

/// Frames out of a byte stream: feed what the port gave, take frames while there are whole
/// ones. The buffer holds at most one read's bytes and the unfinished frame before them.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already handed out as a frame (dropped at the next call).
    consumed: usize,
}

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append bytes read from the link (frames already handed out are dropped first: once per
    /// read, not once per frame).
    pub fn feed(&mut self, bytes: &[u8]) {
        if self.consumed > 0 {
            self.buf.drain(..self.consumed);
            self.consumed = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, `None` until one is. An error is final: the header is refused
    /// before its payload is waited for (a length over the limit is not buffered).
    pub fn next_frame(&mut self) -> Result<Option<Frame<'_>>, FrameError> {
        let rest = &self.buf[self.consumed..];
        let Some(h) = rest.get(..HEADER) else {
            return Ok(None);
        };
        let stream = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
        let kind = h[4];
        let len = u32::from_be_bytes([h[5], h[6], h[7], h[8]]);
        if !(1..=5).contains(&kind) {
            return Err(FrameError::UnknownKind(kind));
        }
        if len as usize > MAX_PAYLOAD {
            return Err(FrameError::TooLong(len));
        }
        let end = HEADER + len as usize;
        if rest.len() < end {
            return Ok(None);
        }
        let start = self.consumed;
        self.consumed += end;
        parse(kind, stream, &self.buf[start + HEADER..start + end]).map(Some)
    }

    /// Bytes held (a whole frame at most, plus one read's worth).
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.consumed
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn enc(f: &Frame) -> Vec<u8> {
        let mut v = Vec::new();
        f.encode(&mut v).unwrap();
        v
    }

    #[test]
    fn frames_round_trip_split_at_every_byte() {
        let frames = [
            Frame::Open {
                stream: 1,
                target: "store/model.age",
            },
            Frame::Data {
                stream: 1,
                bytes: &[7u8; 1000],
            },
            Frame::Fin { stream: 1 },
            Frame::Reset {
                stream: 2,
                reason: "connect: refused",
            },
            Frame::Credit {
                stream: 3,
                bytes: WINDOW,
            },
        ];
        let wire: Vec<u8> = frames.iter().flat_map(enc).collect();
        for split in 0..wire.len() {
            let mut d = Decoder::new();
            let mut got = Vec::new();
            for part in [&wire[..split], &wire[split..]] {
                d.feed(part);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(format!("{f:?}"));
                }
            }
            let want: Vec<String> = frames.iter().map(|f| format!("{f:?}")).collect();
            assert_eq!(got, want, "split at {split}");
            assert_eq!(d.buffered(), 0);
        }
    }

    #[test]
    fn every_broken_rule_is_refused_with_its_reason() {
        let raw = |stream: u32, kind: u8, payload: &[u8]| {
            let mut v = stream.to_be_bytes().to_vec();
            v.push(kind);
            v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            v.extend_from_slice(payload);
            v
        };
        let mut too_long = raw(1, 2, &[]);
        too_long[5..9].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_be_bytes());
        for (wire, want) in [
            (raw(1, 9, b"x"), FrameError::UnknownKind(9)),
            (raw(1, 0, b""), FrameError::UnknownKind(0)),
            (too_long, FrameError::TooLong(MAX_PAYLOAD as u32 + 1)),
            (raw(0, 2, b"x"), FrameError::StreamZero),
            (raw(1, 2, b""), FrameError::EmptyData),
            (raw(1, 3, b"x"), FrameError::FinPayload),
            (raw(1, 4, &[0xff]), FrameError::Reason),
            (raw(1, 4, &[b'a'; MAX_REASON + 1]), FrameError::Reason),
            (raw(1, 5, &[0, 0, 0, 0]), FrameError::Credit),
            (raw(1, 5, &[0, 1]), FrameError::Credit),
            (raw(1, 1, b""), FrameError::Target("1 to 320 bytes")),
            (
                raw(1, 1, &[b'a'; 321]),
                FrameError::Target("1 to 320 bytes"),
            ),
            (
                raw(1, 1, b"/etc/passwd"),
                FrameError::Target("a relative name without empty, . or .. parts"),
            ),
            (
                raw(1, 1, b"store/../x"),
                FrameError::Target("a relative name without empty, . or .. parts"),
            ),
            (
                raw(1, 1, b"store//x"),
                FrameError::Target("a relative name without empty, . or .. parts"),
            ),
            (
                raw(1, 1, b"a b"),
                FrameError::Target("only A-Z a-z 0-9 . _ / -"),
            ),
            (raw(1, 1, &[0xc3, 0x28]), FrameError::Target("not UTF-8")),
        ] {
            let mut d = Decoder::new();
            d.feed(&wire);
            assert_eq!(d.next_frame().unwrap_err(), want, "{wire:?}");
        }
        // The length is refused from the header alone: nothing waits for 4 GiB to arrive.
        let mut d = Decoder::new();
        d.feed(&[0, 0, 0, 1, 2, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(d.next_frame().unwrap_err(), FrameError::TooLong(u32::MAX));
        // What would be refused is not encoded either.
        let mut out = vec![1u8];
        for f in [
            Frame::Data {
                stream: 1,
                bytes: &[],
            },
            Frame::Open {
                stream: 1,
                target: "../x",
            },
            Frame::Fin { stream: 0 },
            Frame::Data {
                stream: 1,
                bytes: &[0u8; MAX_PAYLOAD + 1],
            },
        ] {
            assert!(f.encode(&mut out).is_err(), "{f:?}");
            assert_eq!(out, [1u8]);
        }
    }
}
