//! Output of `pyberth run` made safe for a CI log or a terminal. Bytes from the sandbox reach
//! a log that the CI runner parses and a terminal that interprets escapes: a line starting
//! `::add-mask::` or `##vso[task.setvariable …]` is a command to the runner, an OSC sequence
//! sets the title, the clipboard or a hyperlink, and a line starting `[pyberth]` would pass
//! for one of ours. So by default, as bytes stream through:
//! - a line (after `\n` or `\r`) that starts a runner command (`::`, `##[`, `##vso[`,
//!   `##teamcity[`) or `[pyberth]` gets a `\` in front: visible, and no longer a command;
//! - ESC, the other C0 control bytes (but tab, newline and carriage return), DEL and the C1
//!   controls (U+0080 to U+009F) are written as `\xNN`.
//!
//! `--raw-output` turns this off. Invalid UTF-8 passes as it is: terminals in UTF-8 mode do
//! not act on a lone C1 byte.

/// Line starts that a CI runner or a reader would take for a command or for pyberth.
const PREFIXES: &[&[u8]] = &[b"::", b"##[", b"##vso[", b"##teamcity[", b"[pyberth]"];

/// One output stream's filter; chunk boundaries may fall anywhere.
#[derive(Debug)]
pub(crate) struct Neutralizer {
    /// Bytes at the start of a line that may still become a prefix.
    pending: Vec<u8>,
    /// At the start of a line (nothing of it written yet but `pending`).
    at_start: bool,
    /// The last byte was 0xC2, the lead byte of a C1 control's UTF-8 form; held back.
    held_c2: bool,
}

impl Default for Neutralizer {
    fn default() -> Self {
        Self { pending: Vec::new(), at_start: true, held_c2: false }
    }
}

impl Neutralizer {
    /// Filters `input` into `out`, holding back what the next chunk decides.
    pub(crate) fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) {
        for &b in input {
            if self.held_c2 {
                self.held_c2 = false;
                if (0x80..=0x9f).contains(&b) {
                    out.extend_from_slice(format!("\\u{{{b:04x}}}").as_bytes());
                    continue;
                }
                self.byte(0xc2, out);
            }
            if b == 0xc2 {
                self.held_c2 = true;
                continue;
            }
            self.byte(b, out);
        }
    }

    /// Writes whatever is held back, at the end of the stream.
    pub(crate) fn finish(&mut self, out: &mut Vec<u8>) {
        if self.held_c2 {
            self.held_c2 = false;
            self.byte(0xc2, out);
        }
        if !self.pending.is_empty() {
            self.flush_pending(out);
        }
    }

    /// True when everything written so far ends a line.
    pub(crate) fn at_line_start(&self) -> bool {
        self.at_start && self.pending.is_empty()
    }

    fn byte(&mut self, b: u8, out: &mut Vec<u8>) {
        if b == b'\n' || b == b'\r' {
            self.flush_pending(out);
            out.push(b);
            self.at_start = true;
            return;
        }
        if self.at_start {
            self.pending.push(b);
            let p = &self.pending;
            if PREFIXES.iter().any(|x| x == &p.as_slice()) {
                out.push(b'\\');
                self.flush_pending(out);
            } else if !PREFIXES.iter().any(|x| x.starts_with(p)) {
                self.flush_pending(out);
            }
            return;
        }
        escape(b, out);
    }

    /// Writes the held line start (escaped), and leaves the start of the line.
    fn flush_pending(&mut self, out: &mut Vec<u8>) {
        let pending = std::mem::take(&mut self.pending);
        if !pending.is_empty() {
            self.at_start = false;
        }
        for b in pending {
            escape(b, out);
        }
    }
}

fn escape(b: u8, out: &mut Vec<u8>) {
    if (b < 0x20 && b != b'\t' && b != b'\n' && b != b'\r') || b == 0x7f {
        out.extend_from_slice(format!("\\x{b:02x}").as_bytes());
    } else {
        out.push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]]) -> String {
        let mut n = Neutralizer::default();
        let mut out = Vec::new();
        for c in chunks {
            n.feed(c, &mut out);
        }
        n.finish(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn runner_commands_and_our_prefix_are_defused_at_line_start_only() {
        assert_eq!(run(&[b"::add-mask::secret\n"]), "\\::add-mask::secret\n");
        assert_eq!(run(&[b"ok\n##vso[task.setvariable variable=x]1\n"]), "ok\n\\##vso[task.setvariable variable=x]1\n");
        assert_eq!(run(&[b"a\r::error::x"]), "a\r\\::error::x");
        assert_eq!(run(&[b"[pyberth] status: ok\n"]), "\\[pyberth] status: ok\n");
        assert_eq!(run(&[b"x ::error:: y\n"]), "x ::error:: y\n", "only at the start of a line");
        assert_eq!(run(&[b"#"]), "#", "a held start is written at the end");
        assert_eq!(run(&[b"##x\n"]), "##x\n");
    }

    #[test]
    fn every_split_point_gives_the_same_text() {
        let input: &[u8] = "ok\n::error::bad\n##[warning]w\n\x1b]0;title\x07\n[pyberth] x\u{9b}31m\n".as_bytes();
        let whole = run(&[input]);
        assert!(!whole.contains('\x1b') && !whole.contains('\x07') && !whole.contains('\u{9b}'), "{whole:?}");
        assert!(whole.contains("\\x1b]0;title\\x07") && whole.contains("\\u{009b}"), "{whole:?}");
        for i in 0..=input.len() {
            assert_eq!(run(&[&input[..i], &input[i..]]), whole, "split at {i}");
        }
        let bytes: Vec<&[u8]> = input.chunks(1).collect();
        assert_eq!(run(&bytes), whole, "byte by byte");
    }

    #[test]
    fn text_and_tabs_pass_and_one_line_escapes_newlines() {
        assert_eq!(run(&["héllo\tworld\n".as_bytes()]), "héllo\tworld\n");
        assert_eq!(crate::output::one_line("a\n::error::b\x1b"), "a\\n::error::b\\u{1b}");
    }
}
