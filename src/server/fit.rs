//! Keeps every tool result inside one MCP message that clients accept.
//!
//! rmcp-based clients drop an incoming stdio line over 16 MiB and then wait forever for the
//! answer it carried; other SDKs have similar limits. A result holds each output stream
//! twice (text and structured), and JSON escaping can make a control byte six, so even the
//! default 1 MiB output cap could produce a line past that limit. Results are cut to a budget
//! well below it, saying so.

use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::Value;

/// The largest serialized result sent; below the 16 MiB line limit of common clients.
pub const BUDGET: usize = 12 << 20;

/// True when `text` as a JSON string stays within the budget (a control byte escapes to six
/// bytes), for replies that do not pass through `fit` (resources).
pub(super) fn text_fits(text: &str) -> bool {
    text.len() + 5 * text.bytes().filter(|b| *b < 0x20 && *b != b'\n').count() <= BUDGET
}

/// Strings shorter than this are not cut while longer ones can be: the cut goes where the
/// bytes are.
const SMALL: usize = 16 << 10;
/// When cutting the long items is not enough (many small images, notices or list entries add
/// up as surely as one long string), strings are cut down to about this, every image goes,
/// and lists lose their tail.
const TINY: usize = 256;

/// Cuts a result until it serializes within `budget` bytes: the longest strings and images
/// first, then, if that is not enough, small items too. The text says what was cut.
pub fn fit(mut r: CallToolResult, budget: usize) -> CallToolResult {
    // Cheap bound first: a result whose strings, escaped at worst, fit, needs no work. Warm
    // runs with small output stop here.
    if 6 * raw_len(&r) + 4096 <= budget {
        return r;
    }
    let mut floor = SMALL;
    let mut dropped = Dropped::default();
    for _ in 0..24 {
        let size = size_of(&r);
        if size <= budget {
            break;
        }
        #[allow(clippy::cast_precision_loss)] // sizes far below 2^52
        let keep = (budget as f64 * 0.9 / size as f64).min(0.9);
        let mut cut = cut_content(&mut r.content, keep, floor, &mut dropped);
        if let Some(v) = r.structured_content.as_mut() {
            cut |= shorten_value(v, keep, floor, &mut dropped.items);
        }
        if !cut {
            if floor == TINY {
                break;
            }
            floor = TINY;
        }
    }
    dropped.say(&mut r);
    let size = size_of(&r);
    if size <= budget {
        return r;
    }
    // Nothing more can be cut (a structure of many tiny parts): better a short error than a
    // message the client drops, after which it would wait for its answer forever.
    tracing::warn!(size, budget, "a result could not be cut to fit one MCP message");
    let mut failed = CallToolResult::error(vec![ContentBlock::text(format!(
        "[the result of {size} bytes could not be cut to fit one MCP message of {budget} bytes]"
    ))]);
    failed.structured_content = None;
    failed
}

/// The serialized size, counted as it is written: a hostile result can be tens of MiB, and
/// this runs once per cut.
fn size_of(r: &CallToolResult) -> usize {
    let mut count = Count(0);
    serde_json::to_writer(&mut count, r).map_or(usize::MAX, |()| count.0)
}

/// A writer that keeps only the number of bytes written to it.
struct Count(usize);

impl std::io::Write for Count {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What the small cuts left out, said once in the text.
#[derive(Default)]
struct Dropped {
    images: usize,
    image_bytes: usize,
    items: usize,
}

impl Dropped {
    fn say(&self, r: &mut CallToolResult) {
        let mut notes = Vec::new();
        if self.images > 0 {
            notes.push(format!("{} images ({} bytes)", self.images, self.image_bytes));
        }
        if self.items > 0 {
            notes.push(format!("the last {} entries of lists in the structured content", self.items));
        }
        if notes.is_empty() {
            return;
        }
        let note = format!("\n[left out to fit one MCP message: {}]\n", notes.join(" and "));
        match r.content.iter_mut().find_map(|c| match c {
            ContentBlock::Text(t) => Some(t),
            _ => None,
        }) {
            Some(t) => t.text.push_str(&note),
            None => r.content.insert(0, ContentBlock::text(note)),
        }
    }
}

fn cut_content(content: &mut Vec<ContentBlock>, keep: f64, floor: usize, dropped: &mut Dropped) -> bool {
    let mut cut = false;
    content.retain_mut(|block| match block {
        ContentBlock::Text(t) => {
            cut |= shorten(&mut t.text, keep, floor);
            true
        }
        // A picture cannot be cut in part: a large one goes and the text says so; once small
        // items are cut too, every one goes, counted in one note.
        ContentBlock::Image(i) if floor == TINY => {
            dropped.images += 1;
            dropped.image_bytes += i.data.len();
            cut = true;
            false
        }
        ContentBlock::Image(i) if i.data.len() > floor => {
            let note = format!("[image of {} bytes left out to fit one MCP message]", i.data.len());
            *block = ContentBlock::text(note);
            cut = true;
            true
        }
        _ => true,
    });
    cut
}

fn raw_len(r: &CallToolResult) -> usize {
    let content: usize = r
        .content
        .iter()
        .map(|c| match c {
            ContentBlock::Text(t) => t.text.len(),
            ContentBlock::Image(i) => i.data.len(),
            _ => SMALL,
        })
        .sum();
    content + r.structured_content.as_ref().map_or(0, value_len)
}

fn value_len(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(a) => a.iter().map(value_len).sum::<usize>() + a.len(),
        Value::Object(o) => o.iter().map(|(k, v)| k.len() + value_len(v) + 4).sum(),
        _ => 8,
    }
}

/// Cuts the strings of `v` longer than `floor`; at the smallest floor, lists lose their tail
/// too (counted in `items`): the entries kept are whole, and of the type the schema says.
fn shorten_value(v: &mut Value, keep: f64, floor: usize, items: &mut usize) -> bool {
    match v {
        Value::Object(o) => {
            let mut cut = false;
            for (key, value) in o.iter_mut() {
                // Exact bytes as base64 cannot be cut in part: dropped, the text stays.
                if key.ends_with("_base64") && value.as_str().is_some_and(|s| s.len() > floor) {
                    *value = Value::Null;
                    cut = true;
                } else {
                    cut |= shorten_value(value, keep, floor, items);
                }
            }
            cut
        }
        Value::Array(a) => {
            let mut cut = false;
            if floor == TINY && a.len() > 1 {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
                let kept = ((a.len() as f64 * keep) as usize).max(1);
                *items += a.len() - kept;
                a.truncate(kept);
                cut = true;
            }
            a.iter_mut().fold(cut, |cut, v| shorten_value(v, keep, floor, items) | cut)
        }
        Value::String(s) => shorten(s, keep, floor),
        _ => false,
    }
}

/// Keeps the first `keep` share of a string longer than `floor` (at a character boundary,
/// and at least half the floor) and says so.
fn shorten(s: &mut String, keep: f64, floor: usize) -> bool {
    if s.len() <= floor {
        return false;
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    // 0 < keep < 1: within the string
    let mut at = ((s.len() as f64 * keep) as usize).max(floor / 2);
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    let dropped = s.len() - at;
    s.truncate(at);
    if floor == TINY {
        s.push_str(&format!(" [cut: {dropped} more bytes]"));
    } else {
        s.push_str(&format!(
            "\n[cut to fit one MCP message: {dropped} more bytes not shown; write large output to a file and read it \
             in parts]\n"
        ));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn result(text: &str, structured: Value) -> CallToolResult {
        let mut r = CallToolResult::structured(structured);
        r.content = vec![ContentBlock::text(text.to_owned())];
        r
    }

    #[test]
    fn small_results_pass_untouched() {
        let r = result("hi\n", json!({ "stdout": "hi\n" }));
        let before = serde_json::to_string(&r).expect("json");
        assert_eq!(serde_json::to_string(&fit(r, BUDGET)).expect("json"), before);
    }

    #[test]
    fn escape_heavy_output_is_cut_to_the_budget_and_says_so() {
        // 1 MiB of control bytes, twice: 24 MiB once escaped.
        let ctl = "\u{1}".repeat(1 << 20);
        let r = result(
            &format!("{ctl}{ctl}"),
            json!({ "stdout": ctl, "stderr": ctl, "stdout_base64": "QQ==".repeat(1 << 18), "status": "ok" }),
        );
        let fitted = fit(r, BUDGET);
        let size = serde_json::to_vec(&fitted).expect("json").len();
        assert!(size <= BUDGET, "{size}");
        let sc = fitted.structured_content.expect("structured");
        assert_eq!(sc["status"], "ok", "small fields are kept");
        assert!(sc["stdout"].as_str().expect("stdout").contains("[cut to fit one MCP message"));
        assert!(sc["stdout_base64"].is_null(), "base64 is dropped, not corrupted");
    }

    #[test]
    fn a_cut_never_splits_a_character() {
        let mut s = "é".repeat(40_000);
        assert!(shorten(&mut s, 0.5001, SMALL));
        assert!(s.starts_with('é'));
    }
}
