//! W3C trace context (`traceparent`), read strictly: a client-supplied string reaches our logs
//! and our spans only as the ids it validated to, never as it came.

use std::fmt;

/// A validated `traceparent`: version 00, non-zero ids, lowercase hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace the caller's span belongs to.
    pub trace_id: [u8; 16],
    /// The caller's span: the parent of ours.
    pub span_id: [u8; 8],
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

/// The longest `traceparent` looked at: anything longer is refused before any parsing.
const LEN: usize = 55;

impl TraceParent {
    /// Parses `00-<32 hex>-<16 hex>-<2 hex>`. Anything else (other versions included: their
    /// fields are not ours to guess) is `None`, and the caller goes on without a parent.
    pub fn parse(value: &str) -> Option<Self> {
        let b = value.as_bytes();
        if b.len() != LEN || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' || &b[..2] != b"00" {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        let mut flags = [0u8; 1];
        hex(&b[3..35], &mut trace_id)?;
        hex(&b[36..52], &mut span_id)?;
        hex(&b[53..55], &mut flags)?;
        // All-zero ids are invalid by the spec.
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(Self { trace_id, span_id, flags: flags[0] })
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_hex(&self) -> String {
        to_hex(&self.trace_id)
    }

    /// The caller's span id as 16 lowercase hex digits.
    pub fn span_hex(&self) -> String {
        to_hex(&self.span_id)
    }

    /// Whether the caller sampled its span.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-{}-{:02x}", self.trace_hex(), self.span_hex(), self.flags)
    }
}

/// Lowercase hex only: the spec forbids uppercase, and one spelling keeps log joins exact.
fn hex(src: &[u8], out: &mut [u8]) -> Option<()> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    for (i, pair) in src.chunks_exact(2).enumerate() {
        *out.get_mut(i)? = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(())
}

/// Lowercase hex of bytes.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let tp = TraceParent::parse(GOOD).expect("a valid traceparent");
        assert_eq!(tp.trace_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.span_hex(), "00f067aa0ba902b7");
        assert!(tp.sampled());
        assert_eq!(tp.to_string(), GOOD);
    }

    #[test]
    fn malformed_values_are_refused() {
        let bad = [
            "",
            "00",
            // uppercase hex
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            // zero trace id, zero span id
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // other versions, forbidden ff
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            // trailing data, wrong separators, non-hex, non-ASCII of the right byte length
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\n",
        ];
        for v in bad {
            assert_eq!(TraceParent::parse(v), None, "{v:?} must be refused");
        }
    }
}
