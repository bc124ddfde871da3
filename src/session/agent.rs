//! The connection to one agent (`images/python/agent.py`): requests written to its stdin,
//! events read back from its stdout.
//!
//! [`Agent`] knows nothing of Docker beyond the frame type: it is built from any writer and
//! any stream of output frames, so the protocol tests run the agent as a local process.

use std::time::{Duration, Instant};

use crate::docker::Engine;
use bollard::container::LogOutput;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use super::{Error, FileReply};
use crate::docker::container::Created;
use crate::docker::exec;
use crate::protocol::{self, Event, LineDecoder, PROTOCOL_VERSION, Request};

/// How long a fresh agent may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of the agent's stderr logged per request (a run or a query), escaped; the rest is
/// counted.
const STDERR_PER_REQUEST: usize = 64 << 10;
/// Bytes of the agent's stderr logged per second, over a burst of [`STDERR_PER_REQUEST`].
const STDERR_RATE: f64 = 4096.0;
/// How long the agent's main loop has to take a request off its queue (its `ack`), and again
/// after the previous run was interrupted, before the interpreter counts as held by code.
pub(super) const ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// One live agent connection.
pub(super) struct Agent {
    /// Exec id, for asking Docker its exit code; `None` when the agent is not a Docker exec.
    exec_id: Option<String>,
    input: exec::Input,
    output: exec::Output,
    decoder: LineDecoder,
    /// Last request id used. A connection may reach an agent an earlier connection (of this
    /// server or of one that died) left running, which may still answer that connection's
    /// requests: ids start from [`id_base`], past any id an earlier connection can have used,
    /// and events of unknown ids are skipped everywhere.
    last_id: u64,
    /// The agent's pid, from its hello: the same pid on a later connection means the same
    /// interpreter, state intact.
    pid: Option<u32>,
    /// How much of its stderr is still logged.
    stderr: StderrGate,
    /// The last run that ended with `done`, until a later request is taken at once. Its code
    /// may still hold the interpreter: the `done` may have been forged by the code itself.
    pub(super) last_run: Option<u64>,
    /// Set when [`Agent::submit`] had to interrupt `last_run` before its request was taken.
    interrupted: Option<u64>,
}

/// The agent's stderr as the server logs it. Before the hello it carries the agent's own
/// start-up diagnostics; after it, user code can write there (it runs in the agent's
/// process, docs/threat-model.md §1). Either way it is never parsed and never printed as a
/// line of our own: control characters escaped, in one labelled field, within a budget per
/// request and a rate, the rest counted.
#[derive(Debug)]
pub(super) struct StderrGate {
    /// Set at the hello: from then on the stream is the code's.
    untrusted: bool,
    /// Escaped bytes still logged for the current request.
    left: usize,
    /// Escaped bytes the rate allows now, up to [`STDERR_PER_REQUEST`].
    tokens: f64,
    refilled: Instant,
    /// Bytes not logged since the current request began.
    dropped: u64,
}

impl Default for StderrGate {
    fn default() -> Self {
        #[allow(clippy::cast_precision_loss)] // 64 KiB
        let tokens = STDERR_PER_REQUEST as f64;
        Self { untrusted: false, left: STDERR_PER_REQUEST, tokens, refilled: Instant::now(), dropped: 0 }
    }
}

impl StderrGate {
    /// What of `frame` may be logged: escaped and cut to the budget; `None` when nothing may.
    pub(super) fn admit(&mut self, frame: &[u8]) -> Option<String> {
        #[allow(clippy::cast_precision_loss)] // 64 KiB
        let burst = STDERR_PER_REQUEST as f64;
        self.tokens = (self.tokens + self.refilled.elapsed().as_secs_f64() * STDERR_RATE).min(burst);
        self.refilled = Instant::now();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= tokens <= 64 KiB
        let room = self.left.min(self.tokens as usize);
        // Trailing line ends say nothing; every other control character is escaped.
        let frame = frame.trim_ascii_end();
        let mut logged = String::new();
        let mut used = 0;
        'chunks: for chunk in frame[..frame.len().min(room)].utf8_chunks() {
            for c in chunk.valid().chars() {
                let escaped = crate::output::one_line(c.encode_utf8(&mut [0; 4]));
                if logged.len() + escaped.len() > room {
                    break 'chunks;
                }
                logged.push_str(&escaped);
                used += c.len_utf8();
            }
            for b in chunk.invalid() {
                if logged.len() + 4 > room {
                    break 'chunks;
                }
                logged.push_str(&format!("\\x{b:02x}"));
                used += 1;
            }
        }
        self.dropped += (frame.len() - used) as u64;
        self.left -= logged.len();
        #[allow(clippy::cast_precision_loss)] // at most 64 KiB
        let spent = logged.len() as f64;
        self.tokens -= spent;
        (!logged.is_empty()).then_some(logged)
    }

    /// A new request: a fresh budget, and a count of what the last one dropped, if anything.
    pub(super) fn next_request(&mut self) -> Option<u64> {
        self.left = STDERR_PER_REQUEST;
        (self.dropped > 0).then(|| std::mem::take(&mut self.dropped))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(dropped) = self.stderr.next_request() {
            tracing::debug!(agent_stderr_dropped = dropped, "sandbox stderr over its budget: counted, not logged");
        }
    }
}

/// Whether the agent's main loop took a request off its queue.
#[derive(Debug)]
pub(super) enum Taken {
    /// It did, at once.
    Yes,
    /// Only after the previous run (its id), whose code went on after its `done`, was
    /// interrupted.
    AfterInterrupt(u64),
    /// Not even then: code holds the interpreter and ignores interrupts (or the agent hangs).
    No,
    /// The agent's output ended (`None`) or broke.
    Gone(Option<String>),
}

/// Why reading the agent failed.
pub(super) enum ReadError {
    /// A line we could not parse: skip it (user code can write into the agent's own fds).
    Skippable(protocol::Error),
    /// The stream broke or a line was too long: the agent is unusable.
    Fatal(String),
}

/// What the agent said first.
#[derive(Debug)]
pub(super) enum Greeting {
    /// It is ready, speaking our protocol.
    Ready {
        /// Python version.
        python: String,
        /// Its pid.
        pid: u32,
    },
    /// Its output ended before it said anything.
    Exited,
}

impl Agent {
    /// An agent speaking through `input` (its stdin) and `output` (its stdout and stderr as
    /// frames; stderr carries the agent's own diagnostics). Any writer and stream will do:
    /// the protocol tests pass a local process's pipes.
    pub(super) fn new(input: exec::Input, output: exec::Output) -> Self {
        Self {
            exec_id: None,
            input,
            output,
            decoder: LineDecoder::default(),
            last_id: 0,
            pid: None,
            stderr: StderrGate::default(),
            last_run: None,
            interrupted: None,
        }
    }

    fn from_exec(attached: exec::Attached) -> Self {
        let mut agent = Self::new(attached.input, attached.output);
        agent.exec_id = Some(attached.id);
        // An exec may reach an agent an earlier connection left running (a local process is
        // always fresh, and starts from 1).
        agent.last_id = id_base();
        agent
    }

    /// The agent's pid, once it said hello.
    pub(super) fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// True when the stream to the agent has ended already (the relay exec died, or the
    /// agent exited), found without waiting: what arrived is kept for the next read. A
    /// session checks this before a call, so that a stream dropped between calls is
    /// reattached instead of failing the call.
    pub(super) fn stream_ended(&mut self) -> bool {
        use futures::FutureExt as _;
        // Bounded: frames that keep coming are read by the call itself.
        for _ in 0..64 {
            match self.output.next().now_or_never() {
                None => return false,
                Some(None | Some(Err(_))) => return true,
                Some(Some(Ok(LogOutput::StdOut { message }))) => self.decoder.push(&message),
                Some(Some(Ok(LogOutput::StdErr { message }))) => {
                    if let Some(text) = self.stderr.admit(&message) {
                        tracing::debug!(agent_stderr = %text, "sandbox stderr (untrusted, escaped)");
                    }
                }
                Some(Some(Ok(_))) => {}
            }
        }
        false
    }

    /// The Docker exec running this agent, if it is one.
    pub(super) fn exec_id(&self) -> Option<&str> {
        self.exec_id.as_deref()
    }

    /// A fresh request id. Each request gets a fresh budget for the agent's stderr.
    pub(super) fn next_id(&mut self) -> u64 {
        if let Some(dropped) = self.stderr.next_request() {
            tracing::debug!(agent_stderr_dropped = dropped, "sandbox stderr over its budget: counted, not logged");
        }
        self.last_id += 1;
        self.last_id
    }

    pub(super) async fn send(&mut self, req: &Request<'_>) -> std::io::Result<()> {
        self.send_line(&req.to_line()).await
    }

    /// Sends a request already made a line ([`Request::to_line`]).
    pub(super) async fn send_line(&mut self, line: &[u8]) -> std::io::Result<()> {
        self.input.write_all(line).await?;
        self.input.flush().await
    }

    /// Ends the agent's stdin, the relay's: the relay lets go of its keeper in order, and the
    /// stream ends once it has written out all the keeper sent it (docs/design.md D12, a
    /// graceful leave). What the keeper did not send waits for the next relay.
    pub(super) async fn close_input(&mut self) -> std::io::Result<()> {
        self.input.shutdown().await
    }

    /// Next event; `Ok(None)` when the agent's output ended (it exited). Cancel-safe: bytes
    /// already read stay in the decoder.
    pub(super) async fn next_event(&mut self) -> Result<Option<Event>, ReadError> {
        loop {
            match self.decoder.next_event() {
                Ok(Some(ev)) => return Ok(Some(ev)),
                Ok(None) => {}
                Err(protocol::Error::LineTooLong) => {
                    return Err(ReadError::Fatal("agent line too long".into()));
                }
                Err(e) => return Err(ReadError::Skippable(e)),
            }
            match self.output.next().await {
                Some(Ok(LogOutput::StdOut { message })) => self.decoder.push(&message),
                Some(Ok(LogOutput::StdErr { message })) => match self.stderr.admit(&message) {
                    Some(text) if self.stderr.untrusted => {
                        tracing::debug!(agent_stderr = %text, "sandbox stderr (untrusted, escaped)");
                    }
                    Some(text) => tracing::warn!(agent_stderr = %text, "agent diagnostics before its hello"),
                    None => {}
                },
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(ReadError::Fatal(e.to_string())),
                None => return Ok(None),
            }
        }
    }

    /// Waits up to `timeout` for the agent's first event, which must be a hello in our
    /// protocol version.
    pub(super) async fn hello(&mut self, timeout: Duration) -> Result<Greeting, Error> {
        let first = tokio::time::timeout(timeout, self.next_event()).await.map_err(|_| Error::AgentTimeout(timeout))?;
        match first {
            // Any process of the code's uid can answer an attach (its own listener on the
            // keeper's socket), so the version is the code's word: it reaches the log, the
            // listing and the host's records only when it looks like one.
            Ok(Some(Event::Hello { protocol, python, .. })) if !is_version(&python) => Err(Error::AgentStart(format!(
                "agent protocol {protocol}: a hello whose Python version is not one ({} bytes)",
                python.len()
            ))),
            Ok(Some(Event::Hello { protocol, python, pid })) if protocol == PROTOCOL_VERSION => {
                self.stderr.untrusted = true;
                self.pid = Some(pid);
                Ok(Greeting::Ready { python, pid })
            }
            Ok(Some(Event::Hello { protocol, .. })) => Err(Error::AgentStart(format!(
                "agent protocol {protocol}, server protocol {PROTOCOL_VERSION}: rebuild the image with `pyberth image build`"
            ))),
            // Bounded: whatever answers an attach chooses this line (up to 16 MiB), and it is logged.
            Ok(Some(other)) => {
                let said: String = format!("{other:?}").chars().take(200).collect();
                Err(Error::AgentStart(format!("unexpected first event {said}…")))
            }
            Ok(None) => Ok(Greeting::Exited),
            Err(ReadError::Skippable(e)) => Err(Error::AgentStart(e.to_string())),
            Err(ReadError::Fatal(e)) => Err(Error::AgentStart(e)),
        }
    }

    /// Waits up to `within` for the `ack` of request `id`, skipping every other event: `None`
    /// when none came in time.
    async fn ack(&mut self, id: u64, within: Duration) -> Option<Result<(), Option<String>>> {
        let wait = async {
            loop {
                match self.next_event().await {
                    Ok(Some(Event::Ack { id: i })) if i == id => return Ok(()),
                    Ok(Some(other)) => tracing::debug!(event = ?other, "event before the request was taken ignored"),
                    Err(ReadError::Skippable(_)) => {}
                    Ok(None) => return Err(None),
                    Err(ReadError::Fatal(e)) => return Err(Some(e)),
                }
            }
        };
        tokio::time::timeout(within, wait).await.ok()
    }

    /// After request `id` was sent: waits for the agent's main loop to take it. When it does
    /// not within [`ACK_TIMEOUT`] and a run ended with `done` before, that run's code is
    /// still in the interpreter (a forged `done`): it is interrupted, and the main loop gets
    /// [`ACK_TIMEOUT`] again.
    pub(super) async fn taken(&mut self, id: u64) -> Taken {
        match self.ack(id, ACK_TIMEOUT).await {
            Some(Ok(())) => {
                self.last_run = None;
                return Taken::Yes;
            }
            Some(Err(why)) => return Taken::Gone(why),
            None => {}
        }
        let Some(previous) = self.last_run.take() else { return Taken::No };
        tracing::warn!(run = previous, "the code of a finished run still holds the interpreter; interrupting it");
        if self.send(&Request::Interrupt { id: previous }).await.is_err() {
            return Taken::Gone(None);
        }
        match self.ack(id, ACK_TIMEOUT).await {
            Some(Ok(())) => Taken::AfterInterrupt(previous),
            Some(Err(why)) => Taken::Gone(why),
            None => Taken::No,
        }
    }

    /// Sends the request `make(id)` for a fresh id and waits until the agent's main loop takes
    /// it ([`Agent::taken`]); returns the id. [`Error::Stuck`] when it never does,
    /// [`Error::AgentGone`] when the agent cannot be written to or its output ends.
    pub(super) async fn submit<'r>(&mut self, make: impl FnOnce(u64) -> Request<'r>) -> Result<u64, Error> {
        let id = self.next_id();
        if self.send(&make(id)).await.is_err() {
            return Err(Error::AgentGone);
        }
        match self.taken(id).await {
            Taken::Yes => Ok(id),
            Taken::AfterInterrupt(previous) => {
                self.interrupted = Some(previous);
                Ok(id)
            }
            Taken::No => Err(Error::Stuck),
            Taken::Gone(_) => Err(Error::AgentGone),
        }
    }

    /// The run whose code [`Agent::submit`] last had to interrupt, once.
    pub(super) fn take_interrupted(&mut self) -> Option<u64> {
        self.interrupted.take()
    }

    /// Waits up to `timeout` for the event that `pick(id, event)` recognises as the answer to
    /// the request `id`; every other event is skipped. [`Error::AgentGone`] when the agent's
    /// output ends, [`Error::AgentTimeout`] when it does not answer in time: the agent is
    /// unusable after either.
    pub(super) async fn answer<T>(
        &mut self,
        id: u64,
        pick: impl Fn(u64, Event) -> Option<T>,
        timeout: Duration,
    ) -> Result<T, Error> {
        let answer = tokio::time::timeout(timeout, async {
            loop {
                match self.next_event().await {
                    Ok(Some(ev)) => {
                        if let Some(v) = pick(id, ev) {
                            return Some(v);
                        }
                    }
                    Err(ReadError::Skippable(_)) => {}
                    Ok(None) | Err(ReadError::Fatal(_)) => return None,
                }
            }
        })
        .await;
        match answer {
            Ok(Some(v)) => Ok(v),
            Ok(None) => Err(Error::AgentGone),
            Err(_) => Err(Error::AgentTimeout(timeout)),
        }
    }

    /// [`Agent::submit`], then [`Agent::answer`].
    #[cfg(test)]
    pub(super) async fn request<'r, T>(
        &mut self,
        make: impl FnOnce(u64) -> Request<'r>,
        pick: impl Fn(u64, Event) -> Option<T>,
        timeout: Duration,
    ) -> Result<T, Error> {
        let id = self.submit(make).await?;
        self.answer(id, pick, timeout).await
    }

    /// The next piece of the streamed answer to request `id` (`pack`): `Some` bytes, `None`
    /// at its end. [`Error::Refused`] with the agent's reason when it failed,
    /// [`Error::AgentTimeout`] when nothing came for `idle`, [`Error::AgentGone`] when the
    /// output ended; after the last two (or a piece that does not decode) the agent is still
    /// busy with the stream, or dead, and must be restarted.
    pub(super) async fn piece(&mut self, id: u64, idle: Duration) -> Result<Option<Vec<u8>>, Error> {
        self.answer(
            id,
            |id, ev| match ev {
                Event::File { id: i, more: true, b, .. } if i == id => {
                    Some(Event::payload(None, Some(b.unwrap_or_default())).map(Some).map_err(|_| Error::AgentGone))
                }
                Event::File { id: i, more: false, .. } if i == id => Some(Ok(None)),
                Event::Failed { id: Some(i), message } if i == id => Some(Err(Error::Refused(message))),
                _ => None,
            },
            idle,
        )
        .await?
    }
}

/// The first request id of a new connection: microseconds since the epoch, so a connection
/// made later starts past every id an earlier one used (one id per microsecond of its life
/// would be needed to catch up), and below 2^53, so ids stay exact in any JSON reader.
fn id_base() -> u64 {
    let micros = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros());
    u64::try_from(micros).unwrap_or(0) % (1 << 53)
}

/// Recognises the answer to the file request `id`: the reply, or the agent's reason for
/// refusing it (no such file, a path leading outside the workspace, ...).
pub(super) fn file_answer(id: u64, ev: Event) -> Option<Result<FileReply, String>> {
    match ev {
        Event::File { id: i, size, b, entries, truncated, more: false } if i == id => {
            let data = match b {
                Some(b) => match Event::payload(None, Some(b)) {
                    Ok(d) => d,
                    Err(_) => return Some(Err("the file could not be decoded".to_owned())),
                },
                None => Vec::new(),
            };
            // The code may have answered for the agent: entries are checked as requests are.
            let (entries, dropped) = super::checked_entries(entries.unwrap_or_default());
            Some(Ok(FileReply { size, data, entries, truncated: truncated.unwrap_or(false), dropped }))
        }
        Event::Failed { id: Some(i), message } if i == id => Some(Err(message)),
        _ => None,
    }
}

/// A Python version as the agent says it (`3.11.2`, `3.13.0rc1`): short, no more than that.
fn is_version(v: &str) -> bool {
    !v.is_empty() && v.len() <= 32 && v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-'))
}

/// Starts the agent in `container` and waits for its greeting; returns it with its Python
/// version.
pub(super) async fn greet(docker: &dyn Engine, container: &Created, name: &str) -> Result<(Agent, String), Error> {
    let attached = exec::attach_agent(docker, &container.id, container.uid).await?;
    let mut agent = Agent::from_exec(attached);
    match agent.hello(HELLO_TIMEOUT).await? {
        Greeting::Ready { python, pid } => {
            tracing::debug!(session = %name, %python, pid, "agent ready");
            Ok((agent, python))
        }
        Greeting::Exited => {
            let code = match agent.exec_id() {
                Some(id) => exec::exit_code(docker, id).await,
                None => None,
            };
            Err(Error::AgentStart(format!("the agent exited at start (exit code {code:?})")))
        }
    }
}
