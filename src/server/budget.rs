//! Output sized for a model (issue 28): a run's text content within a budget of characters.
//!
//! Most clients show a model only the text of a result, and some cut a long one at its end,
//! where a notice would be lost. So a stream longer than its share keeps its head and its
//! tail with a marker between them, and one line at the very top says how much was cut and
//! where the whole stream can be read: a workspace file for a run (`.pyberth-output/`, written
//! by the caller of [`plan`]), a job's own record for a job. Pure: no I/O here.

use crate::output::Capture;

/// Where the whole output of a run's streams is kept, in the workspace; each run whose text
/// is cut replaces them, so a session holds at most one of each (docs/output.md).
pub(crate) const SAVED_DIR: &str = ".pyberth-output";

/// Characters kept for the top line and the stderr header.
const RESERVE: usize = 700;

/// A stream as a model reads it: the kept head, the bytes the capture did not keep, the tail.
#[derive(Debug, Clone)]
pub(crate) struct StreamText {
    /// `stdout` or `stderr`.
    pub name: &'static str,
    head: String,
    gap: u64,
    tail: String,
    /// Bytes written to the stream in all.
    pub total: u64,
}

impl StreamText {
    /// The text of a capture: its head and tail decoded (a character cut at either edge of
    /// the gap is left out, not shown as invalid).
    pub(crate) fn of(name: &'static str, c: &Capture) -> Self {
        let head = c.head();
        let head = if c.dropped() > 0 { whole_chars_head(head) } else { head };
        let tail = whole_chars_tail(c.tail());
        let gap = c.total() - head.len() as u64 - tail.len() as u64;
        Self {
            name,
            head: String::from_utf8_lossy(head).into_owned(),
            gap,
            tail: String::from_utf8_lossy(tail).into_owned(),
            total: c.total(),
        }
    }

    fn chars(&self) -> usize {
        self.head.chars().count() + self.tail.chars().count()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.total == 0
    }
}

/// The bytes a capture kept of a stream, as saved for reading in whole: the head, a marker
/// where bytes were not kept, the tail.
pub(crate) fn saved_bytes(c: &Capture) -> Vec<u8> {
    let mut out = c.head().to_vec();
    if c.dropped() > 0 {
        let gap = c.dropped() - c.tail().len() as u64;
        if gap > 0 {
            out.extend_from_slice(format!("\n[pyberth: {gap} bytes not kept here]\n").as_bytes());
        }
        out.extend_from_slice(c.tail());
    }
    out
}

fn whole_chars_head(b: &[u8]) -> &[u8] {
    match std::str::from_utf8(b) {
        Err(e) if e.error_len().is_none() => &b[..e.valid_up_to()],
        _ => b,
    }
}

fn whole_chars_tail(b: &[u8]) -> &[u8] {
    let skip = b.iter().take(3).take_while(|x| (0x80..0xc0).contains(*x)).count();
    &b[skip..]
}

/// Which streams a budget cuts: `[stdout, stderr]`. `fixed` is the rest of the text (value,
/// traceback, status, notices), already within its own bound.
pub(crate) fn plan(streams: &[StreamText; 2], fixed: usize, budget: usize) -> [Option<usize>; 2] {
    let room = budget.saturating_sub(fixed + RESERVE).max(budget / 10);
    let want = [streams[0].chars(), streams[1].chars()];
    let cut_by_cap = [streams[0].gap > 0, streams[1].gap > 0];
    if want[0] + want[1] <= room && !cut_by_cap[0] && !cut_by_cap[1] {
        return [None, None];
    }
    // The shorter stream gets what it needs up to half the room; the other the rest.
    let small = usize::from(want[1] < want[0]);
    let mut shares = [0; 2];
    shares[small] = want[small].min(room / 2);
    shares[1 - small] = room - shares[small];
    let mut out = [None, None];
    for i in 0..2 {
        if want[i] > shares[i] || cut_by_cap[i] {
            out[i] = Some(shares[i].min(want[i]));
        }
    }
    out
}

/// How one stream was cut.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cut {
    /// Bytes not shown.
    pub omitted: u64,
    /// Bytes in all.
    pub total: u64,
}

/// The stream's text within `keep` characters: head and tail, with a marker where it was cut
/// (also where the capture dropped bytes). `None` for the cut when nothing was left out.
pub(crate) fn cut_stream(s: &StreamText, keep: Option<usize>) -> (String, Option<Cut>) {
    let Some(keep) = keep else {
        let mut text = s.head.clone();
        text.push_str(&s.tail);
        return (text, None);
    };
    // One string, with the capture's gap at `gap_at`: the cut must cover it.
    let joined = format!("{}{}", s.head, s.tail);
    let gap_at = s.head.len();
    let total_chars = s.chars();
    let (mut h_end, mut t_start) = if total_chars <= keep {
        (gap_at, gap_at)
    } else {
        let head_chars = keep * 2 / 3;
        let tail_chars = keep - head_chars;
        (byte_at(&joined, head_chars), byte_at(&joined, total_chars - tail_chars))
    };
    if s.gap > 0 {
        h_end = h_end.min(gap_at);
        t_start = t_start.max(gap_at);
    }
    // At a line's end when one is near, so neither side starts or ends mid-line.
    let slack = if total_chars <= keep { 0 } else { keep / 8 };
    if let Some(nl) = joined[..h_end].rfind('\n').filter(|nl| h_end - nl <= slack) {
        h_end = nl + 1;
    }
    if let Some(nl) = joined[t_start..].find('\n').filter(|nl| *nl < slack && t_start + nl + 1 < joined.len()) {
        t_start += nl + 1;
    }
    let omitted = (t_start - h_end) as u64 + s.gap;
    let mut text = joined[..h_end].to_owned();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(&format!("[… {omitted} bytes of {} cut here; the top line says where the whole is …]\n", s.name));
    text.push_str(&joined[t_start..]);
    (text, Some(Cut { omitted, total: s.total }))
}

/// The byte index of the `n`th character of `s` (its length past the end).
fn byte_at(s: &str, n: usize) -> usize {
    s.char_indices().nth(n).map_or(s.len(), |(i, _)| i)
}

/// `s` within `keep` characters, its head and tail kept; true when it was cut.
pub(crate) fn cut_text(s: &str, keep: usize, what: &str) -> (String, bool) {
    let chars = s.chars().count();
    if chars <= keep {
        return (s.to_owned(), false);
    }
    let head = keep * 2 / 3;
    let tail = keep - head;
    let (h, t) = (byte_at(s, head), byte_at(s, chars - tail));
    (format!("{}\n[… {} characters of {what} cut here …]\n{}", &s[..h], chars - keep, &s[t..]), true)
}

/// The line at the top of a cut result: how much of which stream was cut, and where the
/// whole of each can be read.
pub(crate) fn top_line(budget: usize, cuts: &[(&str, Cut, &str)]) -> String {
    let parts: Vec<String> = cuts
        .iter()
        .map(|(name, c, whole)| format!("{name} {} bytes, {} not shown; whole {name}: {whole}", c.total, c.omitted))
        .collect();
    format!("[output cut to fit {budget} characters (head and tail kept): {}]\n", parts.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture(cap: usize, chunks: &[&[u8]]) -> Capture {
        let mut c = Capture::new(cap);
        for ch in chunks {
            c.push(ch);
        }
        c
    }

    #[test]
    fn short_streams_are_not_cut() {
        let s = [StreamText::of("stdout", &capture(1000, &[b"hi\n"])), StreamText::of("stderr", &capture(1000, &[]))];
        assert_eq!(plan(&s, 50, 20_000), [None, None]);
        assert_eq!(cut_stream(&s[0], None).0, "hi\n");
    }

    #[test]
    fn a_long_stream_keeps_head_and_tail_within_its_share() {
        let lines: String = (0..100_000).map(|i| format!("line {i}\n")).collect();
        let c = capture(1 << 20, &[lines.as_bytes()]);
        let s = [StreamText::of("stdout", &c), StreamText::of("stderr", &capture(1000, &[b"warn\n"]))];
        let shares = plan(&s, 100, 20_000);
        assert!(shares[1].is_none(), "the short stream is whole");
        let (text, cut) = cut_stream(&s[0], shares[0]);
        assert!(text.chars().count() <= 20_000, "{}", text.len());
        assert!(text.starts_with("line 0\nline 1\n"));
        assert!(text.ends_with("line 99999\n"), "{}", &text[text.len() - 40..]);
        assert!(text.contains("bytes of stdout cut here"));
        let cut = cut.expect("cut");
        assert_eq!(cut.total, lines.len() as u64);
        let shown: usize = text.lines().filter(|l| l.starts_with("line")).map(|l| l.len() + 1).sum();
        assert_eq!(shown as u64 + cut.omitted, cut.total, "what is shown and what is cut add up");
    }

    #[test]
    fn a_capture_gap_is_inside_the_cut_and_counted() {
        // 10 000 bytes kept, 2 500 of tail, 50 000 written: the gap is in the middle.
        let mut c = Capture::new(10_000);
        c.push(&b"a".repeat(30_000));
        c.push(&b"z".repeat(20_000));
        let s = StreamText::of("stdout", &c);
        let shares = plan(&[s.clone(), StreamText::of("stderr", &Capture::new(10))], 0, 20_000);
        let (text, cut) = cut_stream(&s, shares[0]);
        let cut = cut.expect("cut by the cap");
        assert!(text.starts_with("aaaa") && text.ends_with("zzzz"), "{text:.40}");
        assert_eq!(cut.total, 50_000);
        assert_eq!(cut.omitted, 50_000 - 10_000 - 2_500);
        assert_eq!(saved_bytes(&c).len(), 12_500 + "\n[pyberth: 37500 bytes not kept here]\n".len());
    }

    #[test]
    fn multibyte_edges_stay_whole() {
        let mut c = Capture::new(1025);
        c.push("é".repeat(5000).as_bytes());
        let s = StreamText::of("stdout", &c);
        assert!(!s.head.contains('\u{fffd}') && !s.tail.contains('\u{fffd}'));
        let (text, _) = cut_stream(&s, Some(300));
        assert!(!text.contains('\u{fffd}'));
    }

    #[test]
    fn text_cut_keeps_both_ends() {
        let (t, cut) = cut_text(&format!("[{}]", "1, ".repeat(10_000)), 1000, "the value");
        assert!(cut && t.starts_with("[1, ") && t.ends_with("1, ]"));
        assert!(t.chars().count() < 1100);
        assert_eq!(cut_text("short", 10, "x"), ("short".to_owned(), false));
    }
}
