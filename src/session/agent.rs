//! The connection to one agent (`images/python/agent.py`): requests written to its stdin,
//! events read back from its stdout.
//!
//! [`Agent`] knows nothing of Docker beyond the frame type: it is built from any writer and
//! any stream of output frames, so the protocol tests run the agent as a local process.

use std::time::Duration;

use bollard::Docker;
use bollard::container::LogOutput;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use super::{Error, FileReply};
use crate::docker::exec;
use crate::protocol::{self, Event, LineDecoder, PROTOCOL_VERSION, Request};

/// How long a fresh agent may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// One live agent connection.
pub(super) struct Agent {
    /// Exec id, for asking Docker its exit code; `None` when the agent is not a Docker exec.
    exec_id: Option<String>,
    input: exec::Input,
    output: exec::Output,
    decoder: LineDecoder,
    /// Last request id used. Ids only need to be unique per connection: a new agent has a
    /// new stream, so nothing from an old one can arrive on it.
    last_id: u64,
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
        Self { exec_id: None, input, output, decoder: LineDecoder::default(), last_id: 0 }
    }

    fn from_exec(attached: exec::Attached) -> Self {
        Self { exec_id: Some(attached.id), ..Self::new(attached.input, attached.output) }
    }

    /// The Docker exec running this agent, if it is one.
    pub(super) fn exec_id(&self) -> Option<&str> {
        self.exec_id.as_deref()
    }

    /// A fresh request id.
    pub(super) fn next_id(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }

    pub(super) async fn send(&mut self, req: &Request<'_>) -> std::io::Result<()> {
        self.input.write_all(&req.to_line()).await?;
        self.input.flush().await
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
                Some(Ok(LogOutput::StdErr { message })) => {
                    tracing::warn!(agent_stderr = %String::from_utf8_lossy(&message).trim_end(), "agent diagnostics");
                }
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
            Ok(Some(Event::Hello { protocol, python, pid })) if protocol == PROTOCOL_VERSION => {
                Ok(Greeting::Ready { python, pid })
            }
            Ok(Some(Event::Hello { protocol, .. })) => Err(Error::AgentStart(format!(
                "agent protocol {protocol}, server protocol {PROTOCOL_VERSION}: rebuild the image with `pyberth image build`"
            ))),
            Ok(Some(other)) => Err(Error::AgentStart(format!("unexpected first event {other:?}"))),
            Ok(None) => Ok(Greeting::Exited),
            Err(ReadError::Skippable(e)) => Err(Error::AgentStart(e.to_string())),
            Err(ReadError::Fatal(e)) => Err(Error::AgentStart(e)),
        }
    }

    /// Sends the request `make(id)` for a fresh id and waits up to `timeout` for the event
    /// that `pick(id, event)` recognises as its answer; every other event is skipped.
    /// [`Error::AgentGone`] when the agent cannot be written to or its output ends,
    /// [`Error::AgentTimeout`] when it does not answer in time: the agent is unusable after
    /// either.
    pub(super) async fn request<'r, T>(
        &mut self,
        make: impl FnOnce(u64) -> Request<'r>,
        pick: impl Fn(u64, Event) -> Option<T>,
        timeout: Duration,
    ) -> Result<T, Error> {
        let id = self.next_id();
        let req = make(id);
        if self.send(&req).await.is_err() {
            return Err(Error::AgentGone);
        }
        // A write request holds the whole file, base64: free it before waiting.
        drop(req);
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
}

/// Recognises the answer to the file request `id`: the reply, or the agent's reason for
/// refusing it (no such file, a path leading outside the workspace, ...).
pub(super) fn file_answer(id: u64, ev: Event) -> Option<Result<FileReply, String>> {
    match ev {
        Event::File { id: i, size, b, entries, truncated } if i == id => {
            let data = match b {
                Some(b) => match Event::payload(None, Some(b)) {
                    Ok(d) => d,
                    Err(_) => return Some(Err("the file could not be decoded".to_owned())),
                },
                None => Vec::new(),
            };
            let entries = entries.unwrap_or_default();
            Some(Ok(FileReply { size, data, entries, truncated: truncated.unwrap_or(false) }))
        }
        Event::Failed { id: Some(i), message } if i == id => Some(Err(message)),
        _ => None,
    }
}

/// Starts the agent in `container` and waits for its greeting; returns it with its Python
/// version.
pub(super) async fn greet(docker: &Docker, container: &str, name: &str) -> Result<(Agent, String), Error> {
    let attached = exec::attach_agent(docker, container).await?;
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
