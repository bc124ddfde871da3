//! The bench's output: each row printed on stdout as soon as it is measured (its note, set
//! right after, waits with it until the next row), and one progress line on stderr saying
//! which step runs and for how long the bench has run.

use std::io::{IsTerminal as _, Write as _};
use std::time::{Duration, Instant};

/// p50 and p95 of a set of durations, in milliseconds.
pub(super) fn percentiles(samples: &mut [Duration]) -> (f64, f64) {
    samples.sort();
    let at = |q: f64| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= q <= 1: an index in range
        let i = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(i).map(|d| d.as_secs_f64() * 1e3).unwrap_or(f64::NAN)
    };
    (at(0.50), at(0.95))
}

/// One row: a latency (p50, p95) or one figure that is not.
enum Row {
    Latency { what: String, p50: f64, p95: f64, note: String },
    Figure { what: String, figure: String, note: String },
}

/// The rows as they come, and the progress line.
pub(super) struct Table {
    /// The last latency row, held until its note is known (the next row, a step, the end).
    pending: Option<Row>,
    header: bool,
    started: Instant,
    steps: usize,
    step: usize,
    /// The progress line rewritten in place (stderr is a terminal), and whether it shows.
    tty: bool,
    shown: Option<String>,
}

impl Table {
    /// A table for a bench of `steps` steps.
    pub(super) fn new(steps: usize) -> Self {
        let tty = std::io::stderr().is_terminal();
        Self { pending: None, header: false, started: Instant::now(), steps, step: 0, tty, shown: None }
    }

    /// Adds a latency row; returns its p50 and p95.
    pub(super) fn add(&mut self, what: &str, samples: &mut [Duration], note: String) -> (f64, f64) {
        let (p50, p95) = percentiles(samples);
        self.flush();
        self.pending = Some(Row::Latency { what: what.to_owned(), p50, p95, note });
        (p50, p95)
    }

    /// A row with one figure that is not a latency.
    pub(super) fn text(&mut self, what: &str, figure: String, note: String) {
        self.flush();
        self.emit(&Row::Figure { what: what.to_owned(), figure, note });
    }

    /// Sets the note of the last latency row.
    pub(super) fn note(&mut self, note: String) {
        if let Some(Row::Latency { note: n, .. }) = &mut self.pending {
            *n = note;
        }
    }

    /// The next step begins: rows before it are out, and the progress line says which it is.
    pub(super) fn step(&mut self, what: &str) {
        self.flush();
        self.step += 1;
        let line =
            format!("bench: step {}/{} after {:.0} s: {what}", self.step, self.steps.max(self.step), self.elapsed());
        if self.tty {
            let _ = write!(std::io::stderr(), "\r\x1b[2K{line}");
            self.shown = Some(line);
        } else {
            eprintln!("{line}");
        }
    }

    /// Everything out, and the whole bench's time on stderr.
    pub(super) fn finish(&mut self) {
        self.flush();
        self.clear();
        self.shown = None;
        eprintln!("bench: {} steps in {:.0} s", self.step, self.elapsed());
    }

    /// Text that is not a row (another table), printed between rows.
    pub(super) fn raw(&mut self, text: &str) {
        self.flush();
        self.clear();
        #[allow(clippy::print_stdout)] // the figures are the command's output
        {
            print!("{text}");
        }
        let _ = std::io::stdout().flush();
        self.reshow();
    }

    fn elapsed(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn flush(&mut self) {
        if let Some(row) = self.pending.take() {
            self.emit(&row);
        }
    }

    fn emit(&mut self, row: &Row) {
        let mut out = String::new();
        if !self.header {
            self.header = true;
            out.push_str(&format!("{:<58} {:>10} {:>10}  {}\n", "measurement", "p50 ms", "p95 ms", "note"));
        }
        match row {
            Row::Latency { what, p50, p95, note } => {
                out.push_str(&format!("{what:<58} {p50:>10.3} {p95:>10.3}  {note}\n"));
            }
            Row::Figure { what, figure, note } => out.push_str(&format!("{what:<58} {figure:>21}  {note}\n")),
        }
        self.clear();
        #[allow(clippy::print_stdout)] // the table is the command's output
        {
            print!("{out}");
        }
        let _ = std::io::stdout().flush();
        self.reshow();
    }

    /// Takes the progress line off the terminal before a row goes out.
    fn clear(&self) {
        if self.shown.is_some() {
            let _ = write!(std::io::stderr(), "\r\x1b[2K");
        }
    }

    fn reshow(&self) {
        if let Some(line) = &self.shown {
            let _ = write!(std::io::stderr(), "{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_right_samples() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let (p50, p95) = percentiles(&mut v);
        assert!((p50 - 50.0).abs() <= 1.0, "{p50}");
        assert!((p95 - 95.0).abs() <= 1.0, "{p95}");
    }
}
