//! The exec websocket of the simulated API server: the subprotocols kube-rs offers
//! (`v5.channel.k8s.io`, `v4.channel.k8s.io`) with their framing (a first byte naming the
//! channel: 0 stdin, 1 stdout, 2 stderr, 3 the closing `metav1.Status`, 4 resize, 255 close
//! a channel, v5 only), bridged to a real `docker exec` in the pod's container.

use std::sync::Arc;

use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecResults};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use hyper::body::Incoming;
use hyper::header::{CONNECTION, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL, UPGRADE};
use hyper::{Request, Response, StatusCode};
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

use super::apiserver::{Body, State, status};

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const CLOSE: u8 = 255;

pub(crate) async fn upgrade(state: Arc<State>, name: &str, req: Request<Incoming>) -> Response<Body> {
    let stored = state.pods.lock().expect("pods").get(name).map(|s| (s.container.clone(), s.pod.clone()));
    let Some((container, pod)) = stored else {
        return status(StatusCode::NOT_FOUND, "NotFound", &format!("pods \"{name}\" not found"));
    };
    let Some(container) = container else {
        // What a real API server answers for a pod not yet running.
        return status(StatusCode::BAD_REQUEST, "BadRequest", &format!("pod {name} is not running"));
    };
    let q: Vec<(String, String)> =
        form_urlencoded::parse(req.uri().query().unwrap_or_default().as_bytes()).into_owned().collect();
    let cmd: Vec<String> = q.iter().filter(|(k, _)| k == "command").map(|(_, v)| v.clone()).collect();
    let stdin = q.iter().any(|(k, v)| k == "stdin" && v == "true");
    let header = |h| req.headers().get(h).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let offered = header(SEC_WEBSOCKET_PROTOCOL);
    let offered: Vec<&str> = offered.split(',').map(str::trim).collect();
    let Some(protocol) = state.opts.protocols.iter().copied().find(|p| offered.contains(p)) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "no subprotocol this server speaks was offered");
    };
    let key = header(SEC_WEBSOCKET_KEY);
    if key.is_empty() || cmd.is_empty() {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "an exec needs a websocket key and a command");
    }
    let spec = pod.spec.unwrap_or_default();
    let uid = spec.security_context.and_then(|s| s.run_as_user).unwrap_or(65534);
    let docker = state.docker.clone();
    let cut = state.opts.cut_exec_after;
    tokio::spawn(async move {
        let Ok(upgraded) = hyper::upgrade::on(req).await else { return };
        let ws = WebSocketStream::from_raw_socket(hyper_util::rt::TokioIo::new(upgraded), Role::Server, None).await;
        let link = Link { v5: protocol == "v5.channel.k8s.io", cut_after: cut };
        bridge(docker, container, cmd, stdin, uid, link, ws).await;
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(CONNECTION, "Upgrade")
        .header(UPGRADE, "websocket")
        .header(SEC_WEBSOCKET_ACCEPT, derive_accept_key(key.as_bytes()))
        .header(SEC_WEBSOCKET_PROTOCOL, protocol)
        .body(http_body_util::Empty::new().map_err(|n| match n {}).boxed_unsync())
        .unwrap_or_default()
}

use http_body_util::BodyExt as _;

fn frame(channel: u8, data: &[u8]) -> Message {
    let mut v = Vec::with_capacity(data.len() + 1);
    v.push(channel);
    v.extend_from_slice(data);
    Message::Binary(Bytes::from(v))
}

/// The closing status of an exec, as the kubelet writes it on channel 3.
fn end_status(code: Option<i64>) -> serde_json::Value {
    match code {
        Some(0) => json!({"metadata": {}, "status": "Success"}),
        Some(n) => json!({"metadata": {}, "status": "Failure",
            "message": format!("command terminated with non-zero exit code: exit code {n}"),
            "reason": "NonZeroExitCode", "details": {"causes": [{"reason": "ExitCode", "message": n.to_string()}]}}),
        None => json!({"metadata": {}, "status": "Failure", "message": "the exec ended without an exit code",
            "reason": "InternalError"}),
    }
}

/// How one exec stream behaves.
#[derive(Clone, Copy)]
struct Link {
    /// `v5.channel.k8s.io`: the client may close stdin alone.
    v5: bool,
    /// The connection is cut this long after it opened, with no Status and no close frame
    /// (an API server restart, a load balancer's reset, the kubelet's stream limit).
    cut_after: Option<std::time::Duration>,
}

async fn bridge<S>(
    docker: bollard::Docker,
    container: String,
    cmd: Vec<String>,
    stdin: bool,
    uid: i64,
    link: Link,
    ws: WebSocketStream<S>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut to_client, mut from_client) = ws.split();
    let opts = CreateExecOptions {
        cmd: Some(cmd),
        attach_stdin: Some(stdin),
        attach_stdout: Some(true),
        attach_stderr: Some(true),
        user: Some(format!("{uid}:{uid}")),
        ..Default::default()
    };
    let started = match docker.create_exec(&container, opts).await {
        Ok(e) => docker.start_exec(&e.id, None).await.map(|s| (e.id, s)),
        Err(e) => Err(e),
    };
    let (exec_id, mut output, mut input) = match started {
        Ok((id, StartExecResults::Attached { output, input })) => (id, output, input),
        Ok((_, StartExecResults::Detached)) | Err(_) => {
            let msg = serde_json::to_vec(&end_status(None)).unwrap_or_default();
            let _ = to_client.send(frame(ERROR, &msg)).await;
            let _ = to_client.close().await;
            return;
        }
    };
    // Client to process: stdin frames; a v5 close of channel 0 closes stdin; the end of the
    // websocket closes stdin too (the process itself goes on, as on a kubelet).
    let feed = tokio::spawn(async move {
        while let Some(Ok(msg)) = from_client.next().await {
            let Message::Binary(b) = msg else {
                if matches!(msg, Message::Close(_)) {
                    break;
                }
                continue;
            };
            match b.first() {
                Some(&STDIN) if input.write_all(&b[1..]).await.is_err() => break,
                Some(&STDIN) => {
                    let _ = input.flush().await;
                }
                Some(&CLOSE) if link.v5 && b.get(1) == Some(&STDIN) => {
                    let _ = input.shutdown().await;
                }
                _ => {}
            }
        }
        let _ = input.shutdown().await;
    });
    let relay = async {
        while let Some(Ok(out)) = output.next().await {
            let sent = match out {
                LogOutput::StdOut { message } => to_client.send(frame(STDOUT, &message)).await,
                LogOutput::StdErr { message } => to_client.send(frame(STDERR, &message)).await,
                _ => Ok(()),
            };
            if sent.is_err() {
                // The client is gone: what the process writes next goes nowhere.
                return false;
            }
        }
        true
    };
    let ended = match link.cut_after {
        Some(after) => tokio::time::timeout(after, relay).await.unwrap_or(false),
        None => relay.await,
    };
    feed.abort();
    if !ended {
        // Dropped as it is: the client sees the stream end with no Status.
        return;
    }
    let code = docker.inspect_exec(&exec_id).await.ok().and_then(|i| i.exit_code);
    let msg = serde_json::to_vec(&end_status(code)).unwrap_or_default();
    let _ = to_client.send(frame(ERROR, &msg)).await;
    let _ = to_client.close().await;
}
