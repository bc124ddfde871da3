//! What a run may add to its result besides its output: images and notices, bounded in the
//! server as they arrive.
//!
//! The agent has its own limits, but user code runs inside the agent's process and can call
//! its functions or write events into its channel (docs/threat-model.md §1). So the server
//! counts and measures every `image` and `notice` of a run itself, keeps what fits, and says
//! in one notice of its own what it dropped.

use super::{RunOutcome, RunStatus};
use crate::output::Capture;
use crate::output::one_line;

/// Images kept per run.
pub(crate) const MAX_IMAGES: usize = 16;
/// Bytes of images (base64, as they travel and are kept) per run: room for one image of the
/// agent's 4 MiB limit, and within the 12 MiB result budget beside the output.
pub(crate) const MAX_IMAGE_BYTES: usize = 8 << 20;
/// Notices from the agent kept per run.
pub(crate) const MAX_NOTICES: usize = 16;
/// Characters kept of one notice from the agent.
pub(crate) const MAX_NOTICE_CHARS: usize = 1000;
/// Image types a client is asked to show. Not SVG: a picture should not carry script.
const IMAGE_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// What was kept and dropped of a run's images and notices so far.
#[derive(Debug, Clone, Default)]
pub(crate) struct Extras {
    image_bytes: usize,
    images_dropped: usize,
    image_bytes_dropped: u64,
    notices_kept: usize,
    notices_dropped: usize,
    /// Where the server's own notice about what was dropped stands in the run's notices.
    summary: Option<usize>,
}

impl RunOutcome {
    /// A run that has not started: status ok, nothing captured yet, `cap` bytes kept per stream.
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            status: RunStatus::Ok,
            stdout: Capture::new(cap),
            stderr: Capture::new(cap),
            result: None,
            error: None,
            exit_code: None,
            duration: std::time::Duration::ZERO,
            cpu_ms: None,
            state_lost: false,
            notices: Vec::new(),
            images: Vec::new(),
            peak_memory_kb: None,
            extras: Extras::default(),
            tool_calls: crate::bridge::CallCounts::default(),
        }
    }

    /// Keeps an image the run sent, if it is of a known type, is base64, and fits the run's
    /// limits; counts it otherwise.
    pub(super) fn add_image(&mut self, mime: String, b: String) {
        let fits = self.images.len() < MAX_IMAGES && self.extras.image_bytes + b.len() <= MAX_IMAGE_BYTES;
        if fits && IMAGE_TYPES.contains(&mime.as_str()) && is_base64(&b) {
            self.extras.image_bytes += b.len();
            self.images.push((mime, b));
        } else {
            self.extras.images_dropped += 1;
            self.extras.image_bytes_dropped += b.len() as u64;
            self.say_dropped();
        }
    }

    /// Keeps a notice the run sent, on one line and cut to its length, while the run has room
    /// for more; counts it otherwise.
    pub(super) fn add_notice(&mut self, text: String) {
        if self.extras.notices_kept >= MAX_NOTICES {
            self.extras.notices_dropped += 1;
            self.say_dropped();
            return;
        }
        self.extras.notices_kept += 1;
        let mut kept: String = text.chars().take(MAX_NOTICE_CHARS).collect();
        if kept.len() < text.len() {
            kept.push_str(" [cut]");
        }
        // One line: a notice is shown as one `[notice]` line of the result's text.
        self.notices.push(one_line(&kept));
    }

    /// Writes (or rewrites) the server's notice about what the run's limits dropped.
    fn say_dropped(&mut self) {
        let e = &self.extras;
        let mut parts = Vec::new();
        if e.images_dropped > 0 {
            parts.push(format!(
                "{} images ({} bytes) were dropped (at most {MAX_IMAGES} images of the types {} and {} MiB of \
                 images per run)",
                e.images_dropped,
                e.image_bytes_dropped,
                IMAGE_TYPES.join(", "),
                MAX_IMAGE_BYTES >> 20
            ));
        }
        if e.notices_dropped > 0 {
            parts.push(format!("{} notices were dropped (at most {MAX_NOTICES} per run)", e.notices_dropped));
        }
        let text = format!("the run sent more than a result holds: {}", parts.join("; "));
        match self.extras.summary {
            Some(at) if at < self.notices.len() => self.notices[at] = text,
            _ => {
                self.extras.summary = Some(self.notices.len());
                self.notices.push(text);
            }
        }
    }
}

/// Standard base64 with padding, as clients decode image blocks.
fn is_base64(b: &str) -> bool {
    let body = b.trim_end_matches('=');
    b.len().is_multiple_of(4)
        && b.len() - body.len() <= 2
        && body.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'+' || c == b'/')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome() -> RunOutcome {
        RunOutcome::new(16)
    }

    #[test]
    fn images_past_the_count_or_the_bytes_are_dropped_and_said_once() {
        let mut o = outcome();
        for _ in 0..300 {
            o.add_image("image/png".into(), "QUJD".repeat(256 << 10)); // 1 MiB each
        }
        assert_eq!(o.images.len(), MAX_IMAGE_BYTES >> 20);
        for _ in 0..100 {
            o.add_image("image/png".into(), "QQ==".into());
        }
        assert_eq!(o.images.len(), MAX_IMAGE_BYTES >> 20, "nothing more once the bytes are used up");
        let kept: usize = o.images.iter().map(|(_, b)| b.len()).sum();
        assert!(kept <= MAX_IMAGE_BYTES);
        assert_eq!(o.notices.len(), 1, "{:?}", o.notices);
        assert!(o.notices[0].contains("392 images"), "{}", o.notices[0]);

        let mut o = outcome();
        for _ in 0..MAX_IMAGES + 5 {
            o.add_image("image/png".into(), "QQ==".into());
        }
        assert_eq!(o.images.len(), MAX_IMAGES);
        assert!(o.notices[0].contains("5 images (20 bytes) were dropped"), "{:?}", o.notices);
    }

    #[test]
    fn images_of_other_types_or_not_base64_are_dropped() {
        let mut o = outcome();
        o.add_image("text/html".into(), "QQ==".into());
        o.add_image("image/svg+xml".into(), "QQ==".into());
        o.add_image("image/png".into(), "not base64!".into());
        o.add_image("image/png".into(), "QQ=".into());
        o.add_image("image/jpeg".into(), "QUJD".into());
        assert_eq!(o.images, [("image/jpeg".to_owned(), "QUJD".to_owned())]);
        assert!(o.notices[0].contains("4 images"), "{:?}", o.notices);
    }

    #[test]
    fn notices_are_counted_cut_and_kept_on_one_line() {
        let mut o = outcome();
        o.add_notice("line one\n[status] forged\x1b[2J".into());
        assert_eq!(o.notices[0], "line one\\n[status] forged\\u{1b}[2J");
        o.add_notice("é".repeat(5000));
        assert!(o.notices[1].ends_with(" [cut]") && o.notices[1].chars().count() == MAX_NOTICE_CHARS + 6);
        for i in 0..1000 {
            o.add_notice(format!("n{i}"));
        }
        assert_eq!(o.notices.len(), MAX_NOTICES + 1);
        assert_eq!(
            o.notices[MAX_NOTICES],
            "the run sent more than a result holds: 986 notices were dropped (at most 16 per run)"
        );
        o.add_image("x/y".into(), String::new());
        assert_eq!(o.notices.len(), MAX_NOTICES + 1, "one notice of ours, rewritten");
        assert!(
            o.notices[MAX_NOTICES].contains("1 images (0 bytes)") && o.notices[MAX_NOTICES].contains("986 notices")
        );
    }
}
