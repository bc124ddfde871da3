//! Bytes between a blocking thread (the synchronous `tar` crate) and the engine's streamed
//! request and response bodies: a `Write` that sends fixed-size chunks down a channel, and a
//! `Read` over chunks arriving on one. Uploads, copy-backs and snapshots share them.

use std::io::{Read, Write};

use bytes::Bytes;
use tokio::sync::mpsc;

/// Chunk size of the bodies streamed to the engine.
const CHUNK: usize = 256 << 10;

/// A `Read` over chunks arriving on a channel (used from a blocking thread).
#[derive(Debug)]
pub struct ChunkReader {
    rx: mpsc::Receiver<Bytes>,
    cur: Bytes,
}

impl Read for ChunkReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(b) => self.cur = b,
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len());
        out[..n].copy_from_slice(&self.cur.split_to(n));
        Ok(n)
    }
}

/// A reader fed by the returned sender.
pub fn chunk_reader() -> (mpsc::Sender<Bytes>, ChunkReader) {
    let (tx, rx) = mpsc::channel(8);
    (tx, ChunkReader { rx, cur: Bytes::new() })
}

/// A `Write` that sends chunks down a channel (used from a blocking thread); the receiver is
/// a request body.
#[derive(Debug)]
pub struct ChunkWriter {
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    /// Ends the body with an error, so that the engine discards it.
    pub fn fail(&self, why: &str) {
        let _ = self.tx.blocking_send(Err(std::io::Error::other(why.to_owned())));
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.flush()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx.blocking_send(Ok(chunk)).map_err(|_| std::io::Error::other("the transfer was abandoned"))
    }
}

/// A writer and the request body it feeds.
pub fn chunk_writer() -> (ChunkWriter, mpsc::Receiver<Result<Bytes, std::io::Error>>) {
    let (tx, rx) = mpsc::channel(8);
    (ChunkWriter { tx, buf: Vec::with_capacity(CHUNK) }, rx)
}
