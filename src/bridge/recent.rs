//! The latest replies a run sent the agent ([`Recent`]), sent again on the stream of a
//! reattach: a reply the old relay took just before it died is lost with it (its buffers,
//! or the half line the keeper drops at the next attach), while the code still waits for it.
//! A reply sent twice is harmless: the agent ignores numbers it no longer waits for, and
//! never reuses one in an interpreter.

use std::collections::VecDeque;

/// Bytes of replies kept; the latest is kept whole whatever its size (a result is capped by
/// its upstream's `max_result_kb`, at most 8 MiB).
const RECENT_BYTES: usize = 2 << 20;

/// The latest request lines sent, oldest first, within [`RECENT_BYTES`] but for the latest.
#[derive(Debug, Default)]
pub struct Recent {
    lines: VecDeque<Vec<u8>>,
    bytes: usize,
}

impl Recent {
    /// Keeps `line`, just sent, dropping the oldest ones past the bound.
    pub fn keep(&mut self, line: Vec<u8>) {
        self.bytes += line.len();
        self.lines.push_back(line);
        while self.bytes > RECENT_BYTES && self.lines.len() > 1 {
            if let Some(old) = self.lines.pop_front() {
                self.bytes -= old.len();
            }
        }
    }

    /// The lines kept, oldest first.
    pub fn lines(&self) -> impl Iterator<Item = &[u8]> {
        self.lines.iter().map(Vec::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(r: &Recent) -> Vec<usize> {
        r.lines().map(<[u8]>::len).collect()
    }

    #[test]
    fn the_latest_replies_are_kept_within_the_bound_and_the_latest_always_whole() {
        let mut r = Recent::default();
        assert_eq!(r.lines().count(), 0);
        for n in [10, 20, 30] {
            r.keep(vec![b'x'; n]);
        }
        assert_eq!(sizes(&r), [10, 20, 30], "small ones all kept, oldest first");
        r.keep(vec![b'y'; RECENT_BYTES - 50]);
        assert_eq!(sizes(&r), [20, 30, RECENT_BYTES - 50], "the oldest dropped to stay within the bound");
        r.keep(vec![b'z'; 3 * RECENT_BYTES]);
        assert_eq!(sizes(&r), [3 * RECENT_BYTES], "the latest whole, alone");
        r.keep(vec![b'w'; 5]);
        assert_eq!(sizes(&r), [5], "and dropped once a newer one comes");
    }
}
