//! Fair admission (issue 27, Medium 3): several client addresses, each within its own cap, must
//! not take every connection between them. Loopback only (127.0.0.x), bounded counts and time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;

use crate::common::text;
use crate::http::{ALICE, HttpServer, call};

/// A connection from `127.0.0.<source>` to `target`, or `None` if it cannot be made in 3 s.
async fn connect_from(source: u8, target: SocketAddr) -> Option<TcpStream> {
    let sock = TcpSocket::new_v4().ok()?;
    sock.bind(SocketAddr::from(([127, 0, 0, source], 0))).ok()?;
    tokio::time::timeout(Duration::from_secs(3), sock.connect(target)).await.ok()?.ok()
}

/// Whether the server closed the connection (EOF, reset, or an answer before closing).
fn closed_now(stream: &TcpStream) -> bool {
    let mut buf = [0u8; 256];
    match stream.try_read(&mut buf) {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    }
}

/// One attacking address: keeps `share` half-sent requests open, opening a new one for each
/// the server closes, until `stop`. Counts the connections it opened in `opened`.
async fn hold_share(source: u8, share: usize, target: SocketAddr, stop: CancellationToken, opened: Arc<AtomicUsize>) {
    let mut held: Vec<TcpStream> = Vec::new();
    while !stop.is_cancelled() {
        held.retain(|s| !closed_now(s));
        while held.len() < share && !stop.is_cancelled() {
            let Some(mut stream) = connect_from(source, target).await else { break };
            let _ = stream.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").await;
            opened.fetch_add(1, Ordering::Relaxed);
            held.push(stream);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET /healthz` on a fresh connection from `127.0.0.<source>`: the status line, or why not.
async fn healthz_from(source: u8, target: SocketAddr) -> Result<String, String> {
    let mut stream = connect_from(source, target).await.ok_or("no connection")?;
    let request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    stream.write_all(request).await.map_err(|e| format!("write: {e}"))?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.map_err(|e| format!("read: {e}"))?;
    let answer = String::from_utf8_lossy(&answer);
    Ok(answer.lines().next().unwrap_or("(closed without an answer)").to_owned())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_few_addresses_cannot_take_every_connection() {
    // The review's numbers: 256 places, 32 per address, 8 addresses that each fill their 32.
    hold_and_probe("http-fair", 256, 32, 32, 8).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_addresses_cannot_take_a_small_server() {
    // The review's second case: --max-connections 64, two addresses were enough.
    hold_and_probe("http-fair-small", 64, 32, 32, 2).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn many_addresses_of_one_place_each_cannot_take_every_connection() {
    // No address is bigger than another: 70 addresses of one half-sent request each, 64 places.
    hold_and_probe("http-fair-many", 64, 2, 1, 70).await;
}

/// `attackers` addresses (127.0.0.2 on) each keep `share` half-sent requests open against a
/// server of `max` places, `per_client` per address; a fresh address asks for /healthz 30 times and must get it each
/// time, and an authenticated client must get in too.
async fn hold_and_probe(tag: &str, max: usize, per_client: usize, share: usize, attackers: u8) {
    let env =
        [("PYBERTH_MAX_CONNECTIONS", max.to_string()), ("PYBERTH_MAX_CONNECTIONS_PER_CLIENT", per_client.to_string())];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let s = HttpServer::start_with(tag, &env, None).await;
    let target: SocketAddr = format!("127.0.0.1:{}", s.port).parse().expect("addr");

    let stop = CancellationToken::new();
    let opened = Arc::new(AtomicUsize::new(0));
    let sources = 2..2 + attackers;
    let tasks: Vec<_> =
        sources.map(|source| tokio::spawn(hold_share(source, share, target, stop.clone(), opened.clone()))).collect();
    // Let them fill every place first.
    let filling = Instant::now();
    while opened.load(Ordering::Relaxed) < max && filling.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(opened.load(Ordering::Relaxed) >= max, "the attack opened {opened:?} connections");

    // A fresh address asks for /healthz 30 times while the others keep refilling their share.
    let fresh = 2 + attackers;
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    let probing = Instant::now();
    for i in 0..30 {
        let asked = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(5), healthz_from(fresh, target)).await;
        slowest = slowest.max(asked.elapsed());
        match answer {
            Ok(Ok(line)) if line.contains(" 200 ") => {}
            other => failures.push(format!("#{i}: {other:?}")),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = probing.elapsed();
    eprintln!(
        "fair admission ({tag}): 30 probes in {took:?}, slowest {slowest:?}, {opened:?} attack connections opened"
    );
    assert!(failures.is_empty(), "/healthz from a fresh address failed {} of 30: {failures:?}", failures.len());
    assert!(took < Duration::from_secs(60), "30 probes took {took:?}");
    // An authenticated client gets in as well.
    let alice = tokio::time::timeout(Duration::from_secs(20), s.client(ALICE)).await;
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    let alice = alice.expect("MCP initialize in time");
    let (r, _) = call(&alice, "list_sessions", json!({})).await;
    assert_eq!(r.is_error, Some(false), "{}", text(&r));
    let _ = alice.cancel().await;
    s.stop().await;
}
