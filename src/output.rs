//! Capped capture of one output stream.

/// Bytes of one stream, kept up to a cap, plus the last quarter-cap of what came after it
/// (the end of a long output is where its outcome usually is); the rest is counted, not
/// stored, so server memory is bounded by 1.25 × the cap whatever the code prints.
#[derive(Debug, Clone)]
pub struct Capture {
    cap: usize,
    data: Vec<u8>,
    dropped: u64,
    /// The last bytes past the cap, at most `tail_cap` once [`Capture::tail`] trims it; up to
    /// twice that in between, so trimming is amortised.
    tail: Vec<u8>,
}

impl Capture {
    /// An empty capture that keeps at most `cap` bytes, and the last `cap / 4` past them.
    pub fn new(cap: usize) -> Self {
        Self { cap, data: Vec::new(), dropped: 0, tail: Vec::new() }
    }

    fn tail_cap(&self) -> usize {
        self.cap / 4
    }

    /// Appends a chunk, keeping what fits.
    pub fn push(&mut self, chunk: &[u8]) {
        let room = self.cap.saturating_sub(self.data.len());
        let keep = room.min(chunk.len());
        self.data.extend_from_slice(&chunk[..keep]);
        let rest = &chunk[keep..];
        self.dropped += rest.len() as u64;
        let tail_cap = self.tail_cap();
        if rest.len() >= tail_cap {
            self.tail.clear();
            self.tail.extend_from_slice(&rest[rest.len() - tail_cap..]);
        } else {
            self.tail.extend_from_slice(rest);
            if self.tail.len() > 2 * tail_cap {
                self.tail.drain(..self.tail.len() - tail_cap);
            }
        }
    }

    /// Bytes that did not fit the cap (the kept tail among them).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The bytes kept from the start of the stream.
    pub fn head(&self) -> &[u8] {
        &self.data
    }

    /// The last bytes of the stream past the cap (at most a quarter of the cap): empty when
    /// nothing was dropped.
    pub fn tail(&self) -> &[u8] {
        let tail_cap = self.tail_cap();
        &self.tail[self.tail.len().saturating_sub(tail_cap)..]
    }

    /// Bytes written to the stream in all.
    pub fn total(&self) -> u64 {
        self.data.len() as u64 + self.dropped
    }

    /// The bytes kept in all: the head and the tail.
    pub fn kept_bound(&self) -> usize {
        self.cap + self.tail_cap()
    }

    /// The kept output as text. Invalid UTF-8 becomes U+FFFD here; the exact bytes are in
    /// the second value (base64) when that happened, so nothing is lost. A character cut by
    /// the cap is not counted as invalid. A truncation note is appended when bytes were dropped.
    pub fn render(&self) -> (String, Option<String>) {
        let mut bytes = &self.data[..];
        if self.dropped > 0 {
            // The cap may have cut a multi-byte character; trim it rather than call it invalid.
            if let Err(e) = std::str::from_utf8(bytes)
                && e.error_len().is_none()
            {
                bytes = &bytes[..e.valid_up_to()];
            }
        }
        let (mut text, raw) = match std::str::from_utf8(bytes) {
            Ok(s) => (s.to_owned(), None),
            Err(_) => {
                use base64::Engine as _;
                let raw = base64::engine::general_purpose::STANDARD.encode(bytes);
                (String::from_utf8_lossy(bytes).into_owned(), Some(raw))
            }
        };
        if self.dropped > 0 {
            let dropped = self.dropped + (self.data.len() - bytes.len()) as u64;
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!("[output truncated: {dropped} more bytes not shown (cap {} bytes)]\n", self.cap));
        }
        (text, raw)
    }
}

/// "1 file", "2 files": a count and its noun, in the number the count needs.
pub(crate) fn count(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    if n == 1 { format!("1 {noun}") } else { format!("{n} {noun}s") }
}

/// One piece of sandbox text (an exception message, a file name, an installer line) made
/// safe to print on one `[pyberth]` line: every control character escaped, newlines too.
pub(crate) fn one_line(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() { c.escape_default().collect() } else { vec![c] };
            escaped
        })
        .collect()
}

/// A progress line as a person should read it: terminal escape sequences (colour, cursor
/// moves, as `docker build` and pip emit) removed, other control characters dropped.
pub(crate) fn plain_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI (`ESC [ … final`) and OSC (`ESC ] … BEL or ESC \\`); else the one next char.
            match chars.next() {
                Some('[') => while chars.next().is_some_and(|c| !('@'..='~').contains(&c)) {},
                Some(']') => {
                    while let Some(c) = chars.next() {
                        if c == '\u{7}' || (c == '\u{1b}' && chars.next_if_eq(&'\\').is_some()) {
                            break;
                        }
                    }
                }
                _ => {}
            }
        } else if !c.is_control() || c == '\t' {
            out.push(c);
        }
    }
    out
}

/// How a run ended, as reported to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    /// The code ran to the end.
    Ok,
    /// The code raised an exception (or called `sys.exit` with a non-zero status).
    Error,
    /// The time limit passed and the code was stopped.
    Timeout,
    /// The caller cancelled the call and the code was stopped.
    Cancelled,
    /// The interpreter died during the run (`os._exit`, a fatal signal) and was restarted;
    /// variables are gone, workspace files are kept.
    InterpreterRestarted,
    /// The code ran out of memory and the interpreter was restarted.
    Oom,
    /// The run goes on in the background (a job).
    Running,
}

impl std::fmt::Display for RunStatus {
    /// The word the structured results use (`ok`, `interpreter_restarted`), so text and fields
    /// agree.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ok => "ok",
            Self::Error => "error",
            Self::Timeout => "timeout",
            Self::Cancelled => "cancelled",
            Self::InterpreterRestarted => "interpreter_restarted",
            Self::Oom => "oom",
            Self::Running => "running",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_lose_their_escapes() {
        assert_eq!(plain_line("\u{1b}[1;32mStep 1/9\u{1b}[0m : FROM x\r"), "Step 1/9 : FROM x");
        assert_eq!(plain_line("a\u{1b}]0;title\u{7}b\u{1b}]8;;u\u{1b}\\c"), "abc");
        assert_eq!(plain_line("tab\there"), "tab\there");
    }

    #[test]
    fn counts_take_their_number() {
        assert_eq!(
            (count(1u32, "snapshot"), count(0u32, "file"), count(2u64, "name")),
            ("1 snapshot".into(), "0 files".into(), "2 names".into())
        );
    }

    #[test]
    fn under_the_cap_everything_is_kept() {
        let mut c = Capture::new(100);
        c.push(b"hello ");
        c.push(b"world");
        assert_eq!(c.render(), ("hello world".to_owned(), None));
        assert_eq!(c.dropped(), 0);
    }

    #[test]
    fn over_the_cap_bytes_are_counted_and_marked() {
        let mut c = Capture::new(10);
        for _ in 0..5 {
            c.push(b"abcdef");
        }
        assert_eq!(c.dropped(), 20);
        assert_eq!(c.tail(), b"ef", "the last cap/4 bytes past the cap are kept");
        let (text, raw) = c.render();
        assert!(text.starts_with("abcdefabcd\n[output truncated: 20 more bytes"), "{text}");
        assert!(raw.is_none());
    }

    #[test]
    fn the_tail_is_the_last_bytes_whatever_the_chunks() {
        let mut c = Capture::new(8);
        c.push(b"0123456789");
        assert_eq!((c.head(), c.tail(), c.total()), (&b"01234567"[..], &b"89"[..], 10));
        for b in b"abcdefgh" {
            c.push(&[*b]);
        }
        assert_eq!(c.tail(), b"gh");
        c.push(b"xyz");
        assert_eq!(c.tail(), b"yz");
        assert_eq!(c.total(), 21);
    }

    #[test]
    fn invalid_utf8_keeps_the_exact_bytes() {
        let mut c = Capture::new(100);
        c.push(&[b'a', 0xff, b'b']);
        let (text, raw) = c.render();
        assert_eq!(text, "a\u{fffd}b");
        assert_eq!(raw.as_deref(), Some("Yf9i"));
    }

    #[test]
    fn a_character_cut_by_the_cap_is_not_invalid() {
        let mut c = Capture::new(5);
        c.push("abcd\u{e9}\u{e9}".as_bytes()); // the cap cuts the first é in half
        let (text, raw) = c.render();
        assert!(text.starts_with("abcd\n[output truncated: 4 more bytes"), "{text}");
        assert!(raw.is_none());
    }

    #[test]
    fn split_characters_join_up() {
        let mut c = Capture::new(100);
        let s = "\u{1F600}".as_bytes();
        c.push(&s[..1]);
        c.push(&s[1..3]);
        c.push(&s[3..]);
        assert_eq!(c.render(), ("\u{1F600}".to_owned(), None));
    }
}
