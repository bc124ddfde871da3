//! The installed tree is hostile input (docs/threat-model.md §4): it is streamed out of the
//! installer, re-packed with links out, devices, setuid bits and unsafe paths removed, and
//! only then stored: as one `.tmp-*` directory of the layer store (`store.rs`), holding
//! `site/` and, last, the set's `meta.json`.

use std::io::{Read, Write};

use crate::docker::Engine;
use bollard::query_parameters::DownloadFromContainerOptionsBuilder;
use bytes::Bytes;
use futures::TryStreamExt;
use tokio::sync::mpsc;

use super::{Error, MAX_TREE, Meta};
use crate::docker::chunks::{ChunkReader, ChunkWriter};
use crate::tarcheck::{Modes, link_inside, own_by_root, under};

/// Forwards the installer's `/workspace/site`, a tar, to the re-packer, bounded in size. A
/// failure reaches the re-packer as an error, never as an early end: a tree cut short must
/// not become a layer.
pub(super) async fn download_tree(
    docker: &dyn Engine,
    id: &str,
    tx: mpsc::Sender<std::io::Result<Bytes>>,
) -> Result<(), Error> {
    let opts = DownloadFromContainerOptionsBuilder::default().path("/workspace/site").build();
    let mut stream = docker.download_from_container(id, Some(opts));
    let mut total = 0u64;
    let failed = loop {
        let chunk = match stream.try_next().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => return Ok(()),
            Err(e) => break Error::from(e),
        };
        total += chunk.len() as u64;
        if total > MAX_TREE {
            break Error::Failed(format!("install failed: the installed packages exceed {} GiB", MAX_TREE >> 30));
        }
        if tx.send(Ok(chunk)).await.is_err() {
            // The re-packer stopped: at the archive's end, or with an error it reports.
            return Ok(());
        }
    };
    let _ = tx.send(Err(std::io::Error::other("the download of the installed tree failed"))).await;
    Err(failed)
}

/// Re-packs the tree arriving on `tree` into the upload sent down `context` (on a blocking
/// thread); returns the tree's size. Also says whether the upload stopped reading.
pub(super) fn repack(
    tmp: &str,
    mut meta: Meta,
    tree: mpsc::Receiver<std::io::Result<Bytes>>,
    context: mpsc::Sender<std::io::Result<Option<Bytes>>>,
) -> (Result<u64, String>, bool) {
    // `None` marks the end, sent only once the tree is whole: a body that stops without it,
    // because the re-packer failed or panicked, ends in an error, so the engine never stores
    // part of a tree.
    let mut out = ChunkWriter::new(context, |chunk| Ok(Some(chunk)));
    let tree = ChunkReader::new(tree);
    let packed = context_from_tree(tmp, &mut meta, tree, &mut out)
        .and_then(|w| w.flush().and_then(|()| w.send(Ok(None))).map_err(|e| e.to_string()));
    if let Err(e) = &packed {
        let _ = out.send(Err(std::io::Error::other(e.clone())));
    }
    (packed.map(|()| meta.size), out.gone())
}

/// The request body of the upload, from the re-packer's chunks.
pub(super) fn context_body(
    rx: mpsc::Receiver<std::io::Result<Option<Bytes>>>,
) -> impl futures::Stream<Item = std::io::Result<Bytes>> + Send + 'static {
    futures::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Some(Ok(Some(chunk))) => Some((Ok(chunk), Some(rx))),
            Some(Ok(None)) => None,
            Some(Err(e)) => Some((Err(e), None)),
            None => Some((Err(std::io::Error::other("the context was cut short")), None)),
        }
    })
}

/// Cuts off a writer after a failure: tar's `Builder` writes an end-of-archive marker when
/// dropped, and that marker would make a refused tree look whole to whoever reads it.
struct Cut<W> {
    inner: W,
    cut: bool,
}

impl<W: Write> Write for Cut<W> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if self.cut { Ok(data.len()) } else { self.inner.write(data) }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.cut { Ok(()) } else { self.inner.flush() }
    }
}

/// Re-packs the installer's tree into the store upload written to `out`: `tmp/`, `tmp/site/…`,
/// then `tmp/meta.json` (root-only) with the tree's size. The tree came from a container that
/// ran untrusted install hooks, so it is treated as hostile: entries must stay under `site/`,
/// links may not point out of it, devices and fifos are dropped, every entry is root's and
/// modes are made readable (never setuid, never writable but by root) so the code's uid can
/// import it. On failure `out` gets no end-of-archive marker, and no `meta.json`: the store
/// discards what arrived.
pub(super) fn context_from_tree<W: Write>(tmp: &str, meta: &mut Meta, tree: impl Read, out: W) -> Result<W, String> {
    let mut out = tar::Builder::new(Cut { inner: out, cut: false });
    match append_tree(tmp, meta, tree, &mut out) {
        Ok(()) => out.into_inner().map(|c| c.inner).map_err(|e| e.to_string()),
        Err(e) => {
            out.get_mut().cut = true;
            Err(e)
        }
    }
}

fn append_tree<W: Write>(tmp: &str, meta: &mut Meta, tree: impl Read, out: &mut tar::Builder<W>) -> Result<(), String> {
    let root = std::path::Path::new(tmp);
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_size(0);
    h.set_mode(0o755);
    // Now: the store's writer removes `.tmp-*` directories older than an hour as leftovers.
    h.set_mtime(u64::try_from(meta.created).unwrap_or(0));
    h.set_cksum();
    out.append_data(&mut h, root, &[][..]).map_err(|e| e.to_string())?;
    let mut size = 0u64;
    let mut ar = tar::Archive::new(tree);
    for entry in ar.entries().map_err(|e| e.to_string())? {
        let mut entry = entry.map_err(|e| e.to_string())?;
        let path = entry.path().map_err(|e| e.to_string())?.into_owned();
        if !under(&path, "site") {
            return Err(format!("installer produced an unsafe path {}", path.display()));
        }
        let kind = entry.header().entry_type();
        let mut header = entry.header().clone();
        // Where a kept link points, as written into the store's tar.
        let link = match kind {
            tar::EntryType::Regular | tar::EntryType::Directory => None,
            tar::EntryType::Symlink | tar::EntryType::Link => {
                let hard = kind == tar::EntryType::Link;
                let target = entry.link_name().map_err(|e| e.to_string())?.unwrap_or_default().into_owned();
                let Some(resolved) = link_inside(&path, &target, hard, "site") else { continue };
                // A symlink's target is relative to it: the same under the set's directory. A
                // hard link names its target from the archive's root, the store's root on
                // upload: re-rooted with the tree.
                Some(if hard { root.join(resolved) } else { target })
            }
            _ => continue,
        };
        own_by_root(&mut header, Modes::Shared);
        header.set_cksum();
        if let Some(target) = link {
            header.set_size(0);
            out.append_link(&mut header, root.join(&path), target).map_err(|e| e.to_string())?;
            continue;
        }
        if kind == tar::EntryType::Regular {
            size += header.size().unwrap_or(0);
        }
        // Streamed, not read whole: one file of a tree may be gigabytes.
        out.append_data(&mut header, root.join(&path), &mut entry).map_err(|e| e.to_string())?;
    }
    meta.size = size;
    let json = serde_json::to_vec(&*meta).map_err(|e| e.to_string())?;
    let mut h = tar::Header::new_gnu();
    h.set_size(json.len() as u64);
    h.set_mode(0o600);
    h.set_mtime(0);
    h.set_cksum();
    out.append_data(&mut h, root.join(super::store::META), &json[..]).map_err(|e| e.to_string())
}
