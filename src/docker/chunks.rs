//! Bytes between a blocking thread (the synchronous `tar` crate) and the engine's streamed
//! request and response bodies: a `Write` that sends fixed-size chunks down a channel, and a
//! `Read` over chunks arriving on one. Uploads, copy-backs, snapshots and the layer store's
//! re-packer share them; each channel carries its own item type (a plain chunk, a chunk or an
//! error, a chunk or the end mark), so the two ends are generic over it.

use std::io::{Read, Write};

use bytes::Bytes;
use tokio::sync::mpsc;

/// Chunk size of the bodies streamed to the engine.
pub const CHUNK: usize = 256 << 10;

/// An item of a channel that a [`ChunkReader`] reads: a chunk, or an error that ends the read.
pub trait Chunk: Send {
    /// The chunk's bytes, or the error it carries.
    fn bytes(self) -> std::io::Result<Bytes>;
}

impl Chunk for Bytes {
    fn bytes(self) -> std::io::Result<Bytes> {
        Ok(self)
    }
}

impl Chunk for std::io::Result<Bytes> {
    fn bytes(self) -> std::io::Result<Bytes> {
        self
    }
}

/// A `Read` over chunks arriving on a channel (used from a blocking thread). An error item
/// fails the read; the channel's end is the end of the data.
#[derive(Debug)]
pub struct ChunkReader<T = Bytes> {
    rx: mpsc::Receiver<T>,
    cur: Bytes,
}

impl<T: Chunk> ChunkReader<T> {
    /// Reads what arrives on `rx`.
    pub fn new(rx: mpsc::Receiver<T>) -> Self {
        Self { rx, cur: Bytes::new() }
    }
}

impl<T: Chunk> Read for ChunkReader<T> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(item) => self.cur = item.bytes()?,
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
    (tx, ChunkReader::new(rx))
}

/// A `Write` that sends chunks down a channel (used from a blocking thread), each wrapped
/// into the channel's item type; the receiver is a request body.
#[derive(Debug)]
pub struct ChunkWriter<T = std::io::Result<Bytes>> {
    tx: mpsc::Sender<T>,
    wrap: fn(Bytes) -> T,
    buf: Vec<u8>,
    /// The receiver stopped reading (it failed on its own, or was dropped).
    gone: bool,
}

impl<T: Send> ChunkWriter<T> {
    /// Writes into `tx`, each chunk made an item by `wrap`.
    pub fn new(tx: mpsc::Sender<T>, wrap: fn(Bytes) -> T) -> Self {
        Self { tx, wrap, buf: Vec::with_capacity(CHUNK), gone: false }
    }

    /// Sends one item as it is (an end mark, an error), after nothing: flush first.
    pub fn send(&mut self, item: T) -> std::io::Result<()> {
        self.tx.blocking_send(item).map_err(|_| {
            self.gone = true;
            std::io::Error::other("the transfer was abandoned")
        })
    }

    /// Whether the receiver stopped reading.
    pub fn gone(&self) -> bool {
        self.gone
    }
}

impl ChunkWriter {
    /// Ends the body with an error, so that the engine discards it.
    pub fn fail(&mut self, why: &str) {
        let _ = self.send(Err(std::io::Error::other(why.to_owned())));
    }
}

impl<T: Send> Write for ChunkWriter<T> {
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
        let item = (self.wrap)(chunk);
        self.send(item)
    }
}

/// A writer and the request body it feeds.
pub fn chunk_writer() -> (ChunkWriter, mpsc::Receiver<std::io::Result<Bytes>>) {
    let (tx, rx) = mpsc::channel(8);
    (ChunkWriter::new(tx, Ok), rx)
}
