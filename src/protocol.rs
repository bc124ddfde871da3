//! The wire protocol between the server and the in-container agent (`images/python/agent.py`).
//!
//! Why this file passes 500 lines: every message of the wire in one place, so both directions
//! read together, and the decoder's and the messages' tests beside them (about 120 lines).
//!
//! Both directions are newline-delimited JSON. A Docker frame is not a message: the
//! [`LineDecoder`] reassembles lines from frames of any size, and nothing here scans user
//! output for markers (user output only ever travels inside an [`Event::Out`] payload).
//! This module is pure: no I/O.

use std::collections::BTreeMap;

use base64::Engine as _;
use bytes::{Buf, BytesMut};
use serde::{Deserialize, Serialize};

/// Version of the protocol; the agent states its own in [`Event::Hello`].
pub(crate) const PROTOCOL_VERSION: u32 = 2;
/// What the agent answers a restore `if_saved` that finds no state.
pub(crate) const NOTHING_SAVED: &str = "nothing saved";

/// Longest event line accepted. The agent caps output chunks and texts at 64 KiB, images at
/// 4 MiB and file reads at the server's read cap (8 MiB at most), all base64; a longer line
/// means a broken agent.
pub(crate) const MAX_LINE: usize = 16 << 20;

/// A request from the server to the agent.
#[derive(Debug, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request<'a> {
    /// Run `code` in the persistent namespace, or with `file`, a workspace script in a fresh
    /// interpreter process.
    Run {
        /// Run id, echoed by every event of the run.
        id: u64,
        /// Python source.
        code: &'a str,
        /// Workspace script to run instead of `code`.
        #[serde(skip_serializing_if = "Option::is_none")]
        file: Option<&'a str>,
        /// `sys.argv[1:]` for `file`.
        #[serde(skip_serializing_if = "<[String]>::is_empty")]
        args: &'a [String],
        /// A command (argv) to run in the workspace instead of `code` or `file`.
        #[serde(skip_serializing_if = "<[String]>::is_empty")]
        cmd: &'a [String],
        /// Environment variables set for this run only.
        #[serde(skip_serializing_if = "BTreeMap::is_empty")]
        env: &'a BTreeMap<String, String>,
    },
    /// Write (or append) bytes to a workspace file.
    Write {
        /// Request id.
        id: u64,
        /// Workspace-relative path, already checked.
        path: &'a str,
        /// Content, base64. Borrowed, so that a request can be sent again to a new agent.
        b: &'a str,
        /// Append instead of replacing.
        append: bool,
    },
    /// Read part of a workspace file.
    Read {
        /// Request id.
        id: u64,
        /// Path.
        path: &'a str,
        /// First byte.
        offset: u64,
        /// Most bytes.
        length: u64,
    },
    /// List a workspace directory.
    List {
        /// Request id.
        id: u64,
        /// Path.
        path: &'a str,
        /// Descend into subdirectories.
        recursive: bool,
        /// Most entries.
        limit: usize,
    },
    /// Delete a workspace file or directory.
    Delete {
        /// Request id.
        id: u64,
        /// Path.
        path: &'a str,
    },
    /// Pack a workspace file or directory as a tar, as the code's uid: parents resolved and
    /// kept inside the workspace, the last component and everything below never followed.
    /// Answered by `file` events with `more` and a piece of the archive each, then one
    /// `file` without `more`.
    Pack {
        /// Request id.
        id: u64,
        /// Path, already checked; `.` for the whole workspace.
        path: &'a str,
        /// Most bytes of tar (headers and padding included).
        #[serde(skip_serializing_if = "Option::is_none")]
        max_bytes: Option<u64>,
        /// Most entries of any kind.
        max_entries: u64,
        /// Leave out regular files modified before this time (seconds since the epoch).
        #[serde(skip_serializing_if = "Option::is_none")]
        newer: Option<u64>,
    },
    /// Raise KeyboardInterrupt in the run `id`, if it is still the current one.
    Interrupt {
        /// Run id.
        id: u64,
    },
    /// List the user's variables.
    Vars {
        /// Request id.
        id: u64,
    },
    /// Put dependency layers on the interpreter's `sys.path` and its children's `PYTHONPATH`,
    /// ahead of those already there (the last asked for first). Each path is a set's `site`
    /// directory in the layer store; the agent refuses any other.
    Attach {
        /// Request id.
        id: u64,
        /// The sets' `site` directories, in the order they were asked for.
        paths: &'a [String],
    },
    /// List installed distributions.
    Packages {
        /// Request id.
        id: u64,
    },
    /// Save the interpreter's state and pack it with the whole workspace as one tar
    /// (`state/meta.json`, `state/*.pkl`, `workspace/...`), as the code's uid, answered as
    /// [`Request::Pack`] is: `file` pieces with `more`, then one `file` without.
    Snapshot {
        /// Request id.
        id: u64,
        /// Most bytes of tar (headers and padding included).
        max_bytes: u64,
        /// Most entries of any kind.
        max_entries: u64,
    },
    /// Save the interpreter's state into `/workspace/.pyberth-snapshot` (`meta.json` and the
    /// pickles, private to the code's uid), for the server's packer container to copy volume
    /// to volume. Answered by [`Event::Saved`].
    SaveState {
        /// Request id.
        id: u64,
        /// Most bytes of state.
        max_bytes: u64,
        /// When the state and the workspace hold fewer bytes, the agent removes the state and
        /// says `small`: the stream is the faster way for them.
        small_below: u64,
    },
    /// The answer to a `tool_call` event (code mode): the value, or why there is none.
    ToolResult {
        /// The call's number, as the agent gave it.
        call: u64,
        /// The tool's value (structured content, or its text); absent on failure.
        #[serde(skip_serializing_if = "Option::is_none")]
        result: Option<&'a serde_json::Value>,
        /// Why the call failed or was refused.
        #[serde(skip_serializing_if = "Option::is_none")]
        error: Option<&'a str>,
    },
    /// Restore the state the server unpacked into `/workspace/.pyberth-restore`, then remove
    /// it. Answered by [`Event::Restored`].
    Restore {
        /// Request id.
        id: u64,
        /// When no state is there, fail with exactly [`NOTHING_SAVED`] (the keeper's save for
        /// a next server may or may not have happened).
        if_saved: bool,
    },
}

impl Request<'_> {
    /// The request as one protocol line.
    pub fn to_line(&self) -> Vec<u8> {
        // Serialising these plain structs cannot fail.
        let mut line = serde_json::to_vec(self).unwrap_or_default();
        line.push(b'\n');
        line
    }
}

/// Which user stream a chunk of output came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    /// File descriptor 1.
    Stdout,
    /// File descriptor 2.
    Stderr,
}

/// How a run ended, as the agent saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DoneStatus {
    /// The code ran to the end (or called `sys.exit(0)`).
    Ok,
    /// The code raised.
    Error,
    /// KeyboardInterrupt, raised by our interrupt.
    Interrupted,
}

/// A Python exception, as reported by the agent.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
pub struct PyError {
    /// Exception class name, e.g. `ZeroDivisionError`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `str()` of the exception.
    pub message: String,
    /// Formatted traceback, without the agent's own frames.
    pub traceback: String,
}

/// One variable of the user's namespace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
pub struct Variable {
    /// Name.
    pub name: String,
    /// Type name.
    #[serde(rename = "type")]
    pub kind: String,
    /// Short repr (at most 200 characters).
    pub repr: String,
}

/// One workspace entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
pub struct FileEntry {
    /// Path relative to the workspace.
    pub path: String,
    /// Size in bytes (apparent: what reading it gives).
    pub size: u64,
    /// Bytes of storage it takes (`st_blocks` × 512): less than `size` for a sparse file,
    /// more for one with blocks allocated past its end. Absent from agents before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated: Option<u64>,
    /// file, dir or link.
    pub kind: String,
}

/// A name a snapshot or a restore could not keep, and why.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
pub(crate) struct Lost {
    /// The global's name.
    pub name: String,
    /// Why (the exception, or what kind of object it was).
    pub why: String,
}

/// An installed distribution.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
pub struct Package {
    /// Distribution name as its metadata spells it.
    pub name: String,
    /// Installed version.
    pub version: String,
}

/// An event from the agent.
#[derive(Debug, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub(crate) enum Event {
    /// First line the agent writes.
    Hello {
        /// The agent's protocol version.
        protocol: u32,
        /// Python version, e.g. `3.12.7`.
        python: String,
        /// PID of the agent inside the container.
        pid: u32,
    },
    /// The agent's main loop took the request `id` off its queue: nothing of an earlier run
    /// holds the interpreter any more (unless the code forged this too).
    Ack {
        /// Request id.
        id: u64,
    },
    /// A chunk of user output.
    Out {
        /// Run the output belongs to; `None` for output of leftover background processes.
        id: Option<u64>,
        /// Stream.
        s: Stream,
        /// Payload as text, when it was valid UTF-8.
        t: Option<String>,
        /// Payload as base64, when it was not.
        b: Option<String>,
    },
    /// End of a run.
    Done {
        /// Run id.
        id: u64,
        /// How it ended.
        status: DoneStatus,
        /// repr of the value of a final expression.
        #[serde(default)]
        result: Option<String>,
        /// The exception, if any.
        #[serde(default)]
        error: Option<PyError>,
        /// Exit status passed to `sys.exit`, when the code called it.
        #[serde(default)]
        exit_code: Option<i64>,
        /// Wall time measured inside the agent. Part of the wire format; the server reports its
        /// own measure, which includes the trip to and from the container.
        #[allow(dead_code)]
        wall_ms: f64,
        /// CPU time (user + system, children included) of the run.
        cpu_ms: f64,
        /// Peak resident memory during the run, KiB.
        #[serde(default)]
        peak_kb: Option<u64>,
    },
    /// Code in run `id` calls an upstream tool (`op` absent or `call`, `tool` = `server.tool`)
    /// or asks for the tools it may call (`op` = `list`): answered by [`Request::ToolResult`].
    /// The code can forge it: the server checks everything (`bridge`).
    ToolCall {
        /// Run id.
        id: u64,
        /// The call's number, the agent's own.
        call: u64,
        /// `call` (the default) or `list`.
        #[serde(default)]
        op: Option<String>,
        /// `server.tool`.
        #[serde(default)]
        tool: Option<String>,
        /// Keyword arguments.
        #[serde(default)]
        args: Option<serde_json::Value>,
    },
    /// Answer to [`Request::Vars`].
    Vars {
        /// Request id.
        id: u64,
        /// The variables.
        vars: Vec<Variable>,
    },
    /// Answer to [`Request::Attach`].
    Attached {
        /// Request id.
        id: u64,
        /// Paths that are not there (a set removed from the store) or not in it.
        #[serde(default)]
        missing: Vec<String>,
    },
    /// Answer to [`Request::Packages`].
    Packages {
        /// Request id.
        id: u64,
        /// Installed distributions.
        packages: Vec<Package>,
    },
    /// Answer to [`Request::SaveState`].
    Saved {
        /// Request id.
        id: u64,
        /// Names saved.
        #[serde(default)]
        saved: Vec<String>,
        /// Names not saved, with why.
        #[serde(default)]
        lost: Vec<Lost>,
        /// Below `small_below`: nothing kept, to be streamed instead.
        #[serde(default)]
        small: bool,
    },
    /// Answer to [`Request::Restore`].
    Restored {
        /// Request id.
        id: u64,
        /// Names that came back.
        #[serde(default)]
        restored: Vec<String>,
        /// Names that did not, with why.
        #[serde(default)]
        lost: Vec<Lost>,
    },
    /// Answer to a file request.
    File {
        /// Request id.
        id: u64,
        /// File size after a write, or of the file read.
        #[serde(default)]
        size: Option<u64>,
        /// Bytes read, base64.
        #[serde(default)]
        b: Option<String>,
        /// Directory listing.
        #[serde(default)]
        entries: Option<Vec<FileEntry>>,
        /// The listing was cut at its limit.
        #[serde(default)]
        truncated: Option<bool>,
        /// A piece of a streamed answer (`pack`): more `file` events follow.
        #[serde(default)]
        more: bool,
    },
    /// An image produced by a run (a matplotlib figure, or `display()`).
    Image {
        /// Run id.
        id: Option<u64>,
        /// MIME type.
        mime: String,
        /// Image bytes, base64.
        b: String,
    },
    /// Something the caller should know about a run (images left out, ...).
    Notice {
        /// Run id.
        id: Option<u64>,
        /// What.
        text: String,
    },
    /// The agent could not serve a request.
    Failed {
        /// Request id.
        id: Option<u64>,
        /// Why.
        message: String,
    },
}

impl Event {
    /// The raw bytes of an [`Event::Out`] payload.
    pub(crate) fn payload(t: Option<String>, b: Option<String>) -> Result<Vec<u8>, Error> {
        match (t, b) {
            (Some(t), _) => Ok(t.into_bytes()),
            (None, Some(b)) => base64::engine::general_purpose::STANDARD.decode(b).map_err(|_| Error::BadPayload),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// A protocol violation by the agent.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// A line longer than [`MAX_LINE`].
    #[error("agent sent a line longer than {MAX_LINE} bytes")]
    LineTooLong,
    /// A line that is not a known event.
    #[error("agent sent an unreadable event")]
    BadEvent(#[source] serde_json::Error),
    /// A base64 payload that does not decode.
    #[error("agent sent an undecodable output payload")]
    BadPayload,
}

/// Reassembles newline-delimited events from arbitrarily split byte chunks.
#[derive(Debug, Default)]
pub(crate) struct LineDecoder {
    buf: BytesMut,
    /// Bytes of `buf` already searched for a newline, so a long line is scanned once.
    scanned: usize,
}

impl LineDecoder {
    /// Appends a chunk as it came off the stream.
    pub(crate) fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// Next complete event, `Ok(None)` when more bytes are needed.
    pub(crate) fn next_event(&mut self) -> Result<Option<Event>, Error> {
        let Some(pos) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') else {
            self.scanned = self.buf.len();
            if self.buf.len() > MAX_LINE {
                return Err(Error::LineTooLong);
            }
            return Ok(None);
        };
        let end = self.scanned + pos;
        self.scanned = 0;
        let parsed = serde_json::from_slice(&self.buf[..end]);
        self.buf.advance(end + 1);
        parsed.map(Some).map_err(Error::BadEvent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream() -> Vec<u8> {
        let mut s = Vec::new();
        s.extend_from_slice(br#"{"ev":"hello","protocol":2,"python":"3.12.1","pid":7}"#);
        s.push(b'\n');
        s.extend_from_slice(
            "{\"ev\":\"out\",\"id\":1,\"s\":\"stdout\",\"t\":\"h\u{e9}llo \u{1F600}\\n\"}\n".as_bytes(),
        );
        s.extend_from_slice(br#"{"ev":"out","id":1,"s":"stderr","b":"//4="}"#);
        s.push(b'\n');
        s.extend_from_slice(
            br#"{"ev":"done","id":1,"status":"ok","result":"42","error":null,"wall_ms":1.5,"cpu_ms":0.0}"#,
        );
        s.push(b'\n');
        s
    }

    fn decode_all(chunks: &[&[u8]]) -> Vec<Event> {
        let mut d = LineDecoder::default();
        let mut out = Vec::new();
        for c in chunks {
            d.push(c);
            while let Some(e) = d.next_event().expect("valid stream") {
                out.push(e);
            }
        }
        out
    }

    fn summary(events: &[Event]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                Event::Hello { python, pid, .. } => format!("hello {python} {pid}"),
                Event::Out { s, t, b, .. } => {
                    let bytes = Event::payload(t.clone(), b.clone()).expect("payload");
                    format!("{s:?} {bytes:?}")
                }
                Event::Done { id, status, result, .. } => format!("done {id} {status:?} {result:?}"),
                other => format!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn every_split_point_gives_the_same_events() {
        let s = stream();
        let whole = summary(&decode_all(&[&s]));
        assert_eq!(whole.len(), 4);
        assert_eq!(whole[0], "hello 3.12.1 7");
        assert_eq!(whole[2], format!("Stderr {:?}", vec![0xffu8, 0xfe]));
        for i in 0..=s.len() {
            assert_eq!(summary(&decode_all(&[&s[..i], &s[i..]])), whole, "split at {i}");
        }
        for i in 0..s.len() {
            for j in i..=s.len() {
                if j % 7 == 0 {
                    let got = summary(&decode_all(&[&s[..i], &s[i..j], &s[j..]]));
                    assert_eq!(got, whole, "split at {i} and {j}");
                }
            }
        }
    }

    #[test]
    fn byte_by_byte() {
        let s = stream();
        let chunks: Vec<&[u8]> = s.chunks(1).collect();
        assert_eq!(summary(&decode_all(&chunks)), summary(&decode_all(&[&s])));
    }

    #[test]
    fn multibyte_text_survives() {
        let events = decode_all(&[&stream()]);
        let Event::Out { t, b, .. } = &events[1] else { panic!("not out") };
        let bytes = Event::payload(t.clone(), b.clone()).expect("payload");
        assert_eq!(String::from_utf8(bytes).expect("utf8"), "h\u{e9}llo \u{1F600}\n");
    }

    #[test]
    fn oversized_line_is_an_error() {
        let mut d = LineDecoder::default();
        let chunk = vec![b'x'; 1 << 20];
        let mut failed = false;
        for _ in 0..=(MAX_LINE >> 20) {
            d.push(&chunk);
            if matches!(d.next_event(), Err(Error::LineTooLong)) {
                failed = true;
                break;
            }
        }
        assert!(failed);
    }

    #[test]
    fn garbage_line_is_an_error_and_the_next_line_still_decodes() {
        let mut d = LineDecoder::default();
        d.push(b"not json\n{\"ev\":\"vars\",\"id\":3,\"vars\":[]}\n");
        assert!(matches!(d.next_event(), Err(Error::BadEvent(_))));
        assert!(matches!(d.next_event(), Ok(Some(Event::Vars { id: 3, .. }))));
        assert!(matches!(d.next_event(), Ok(None)));
    }

    #[test]
    fn bad_base64_is_an_error() {
        assert!(matches!(Event::payload(None, Some("@@".into())), Err(Error::BadPayload)));
    }

    #[test]
    fn requests_are_one_line() {
        let env = BTreeMap::new();
        let line =
            Request::Run { id: 9, code: "print('a\\nb')\nx = 1", file: None, args: &[], cmd: &[], env: &env }.to_line();
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        assert!(line.ends_with(b"\n"));
        let v: serde_json::Value = serde_json::from_slice(&line).expect("json");
        assert_eq!(v["op"], "run");
        assert_eq!(v["code"], "print('a\\nb')\nx = 1");
    }
}
