//! The layer store (docs/design.md D6): one volume per engine, shared by every server on it,
//! mounted read-only into every session and pool container at [`STORE_DIR`]. Each installed
//! set is one directory, named HMAC-SHA256(secret, key): the secret is a label of the volume,
//! which only the Docker API shows, so a sandbox can neither guess the name of a set it did
//! not ask for nor list the root (mode 0711). Each set directory holds `site/` (the packages)
//! and `meta.json` (root-only, 0600: its requirements, size and creation time).
//!
//! Only short-lived containers of ours write it: no network, root without capabilities, our
//! own script and nothing else. A set arrives as an upload into a fresh `.tmp-*` directory
//! and is renamed into place, so a half-written set is never visible; when two writers race
//! for one set, the first rename wins and the second discards its copy.

use std::collections::HashMap;

use crate::docker::Engine;
use bollard::container::LogOutput;
use bollard::models::{Mount, MountType, MountVolumeOptions, VolumeCreateRequest};
use bollard::query_parameters::{AttachContainerOptionsBuilder, UploadToContainerOptionsBuilder};
use futures::StreamExt;
use sha2::{Digest, Sha256};

use super::Error;
use crate::docker::LABEL_MANAGED;
use crate::docker::container::{self, Owner};

/// Where the store is mounted in sessions (read-only).
pub const STORE_DIR: &str = "/opt/pyberth/layers";
/// The store volume's name unless [`STORE_ENV`] names another.
pub const DEFAULT_STORE: &str = "pyberth-layers";
/// Names another store volume: tests that prune or need a cold store use one of their own.
pub const STORE_ENV: &str = "PYBERTH_LAYER_STORE";
/// Label marking the store volume.
pub const LABEL_STORE: &str = "pyberth.layer-store";
/// Label holding the store's secret.
const LABEL_SECRET: &str = "pyberth.layer-secret";
/// Where writer and reader containers mount the store.
const MOUNT: &str = "/store";
/// A set's metadata file, root-only.
pub const META: &str = "meta.json";

/// The store volume's name: [`STORE_ENV`] when it is a plain volume name, else the default.
pub fn store_name() -> String {
    std::env::var(STORE_ENV)
        .ok()
        .filter(|n| {
            !n.is_empty()
                && n.len() <= 128
                && n.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && n.starts_with(|c: char| c.is_ascii_alphanumeric())
        })
        .unwrap_or_else(|| DEFAULT_STORE.to_owned())
}

/// The store volume and its secret.
#[derive(Clone)]
pub struct Store {
    /// Volume name.
    pub volume: String,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("volume", &self.volume).finish_non_exhaustive()
    }
}

/// The last store opened by this process: the secret only changes when someone removes the
/// volume, and every container create opens it again ([`Store::open`]).
static OPENED: std::sync::Mutex<Option<Store>> = std::sync::Mutex::new(None);

impl Store {
    /// Creates the store volume if absent and reads its secret. Two servers creating it at
    /// once each propose a secret; the engine keeps one volume, and both use the label it kept.
    pub async fn open(docker: &dyn Engine) -> Result<Store, Error> {
        let volume = store_name();
        let labels = HashMap::from([
            (LABEL_MANAGED.to_owned(), "1".to_owned()),
            (LABEL_STORE.to_owned(), "1".to_owned()),
            (LABEL_SECRET.to_owned(), random_hex()?),
        ]);
        docker
            .create_volume(VolumeCreateRequest {
                name: Some(volume.clone()),
                labels: Some(labels),
                ..Default::default()
            })
            .await?;
        let kept = docker.inspect_volume(&volume).await?;
        let secret = kept.labels.get(LABEL_SECRET).filter(|s| s.len() >= 32).ok_or_else(|| {
            Error::Failed(format!(
                "the layer store volume {volume} has no secret label, so pyberth did not make it: remove it \
                 (docker volume rm {volume}) or name another store with {STORE_ENV}"
            ))
        })?;
        let store = Store { volume, secret: secret.as_bytes().to_vec() };
        if let Ok(mut opened) = OPENED.lock() {
            *opened = Some(store.clone());
        }
        Ok(store)
    }

    /// A store of volume `volume` with a fixed secret, for tests that need its mounts.
    #[cfg(test)]
    pub fn for_test(volume: &str) -> Store {
        Store { volume: volume.to_owned(), secret: b"test".to_vec() }
    }

    /// The store this process opened last, else opened now.
    pub async fn get(docker: &dyn Engine) -> Result<Store, Error> {
        let known = OPENED.lock().ok().and_then(|o| o.clone()).filter(|s| s.volume == store_name());
        match known {
            Some(s) => Ok(s),
            None => Self::open(docker).await,
        }
    }

    /// The directory name of the set `key`: 128 bits of HMAC-SHA256(secret, key), hex.
    pub fn dir_name(&self, key: &str) -> String {
        hex(&hmac_sha256(&self.secret, key.as_bytes())[..16])
    }

    /// Where a session finds the packages of set `key`.
    pub fn site_path(&self, key: &str) -> String {
        format!("{STORE_DIR}/{}/site", self.dir_name(key))
    }

    /// The read-only mount of the store in a session container. `nocopy`: an empty volume
    /// must never be filled from the image's files at that path.
    pub fn session_mount(&self) -> Mount {
        Mount {
            target: Some(STORE_DIR.into()),
            source: Some(self.volume.clone()),
            typ: Some(MountType::VOLUME),
            read_only: Some(true),
            volume_options: Some(MountVolumeOptions { no_copy: Some(true), ..Default::default() }),
            ..Default::default()
        }
    }
}

/// A tar streamed to the engine.
pub type Tar = futures::stream::BoxStream<'static, std::io::Result<bytes::Bytes>>;

/// What a writer did with a set.
#[derive(Debug, PartialEq, Eq)]
pub enum Stored {
    /// Renamed into place.
    New,
    /// Another writer stored the same set first; this copy was discarded.
    Exists,
}

/// The one script writer and reader containers run: ours, over files of ours (a set's
/// `meta.json`) and names; it never reads a package's files.
const SCRIPT: &str = r#"import json, os, shutil, sys, time
root = "/store"
op = sys.argv[1]
def meta_key(d):
    try:
        with open(os.path.join(root, d, "meta.json")) as f:
            return json.load(f).get("key")
    except Exception:
        return None
if op == "list":
    out = {}
    for d in os.listdir(root):
        if d.startswith("."):
            continue
        try:
            with open(os.path.join(root, d, "meta.json")) as f:
                out[d] = json.load(f)
        except Exception:
            out[d] = None
    print(json.dumps(out))
    sys.exit(0)
os.chmod(root, 0o711)
now = time.time()
for d in os.listdir(root):
    p = os.path.join(root, d)
    # Left by a writer that died: an hour is far past any upload.
    if d.startswith(".tmp-") and d != (sys.argv[2] if op == "store" else "") and now - os.lstat(p).st_mtime > 3600:
        shutil.rmtree(p, ignore_errors=True)
if op == "store":
    tmp, final, key = sys.argv[2:5]
    t, f = os.path.join(root, tmp), os.path.join(root, final)
    if meta_key(tmp) != key:
        print("incomplete:", tmp, sorted(os.listdir(t)) if os.path.isdir(t) else sorted(os.listdir(root)), file=sys.stderr)
        shutil.rmtree(t, ignore_errors=True)
        sys.exit(3)
    try:
        os.rename(t, f)
        sys.exit(0)
    except OSError:
        shutil.rmtree(t, ignore_errors=True)
        sys.exit(1 if meta_key(final) == key else 4)
if op == "remove":
    for d in sys.argv[2:]:
        if d.startswith(".") or "/" in d or not os.path.isdir(os.path.join(root, d)):
            continue
        gone = os.path.join(root, ".tmp-gone-" + d)
        os.rename(os.path.join(root, d), gone)
        shutil.rmtree(gone, ignore_errors=True)
        print(d)
    sys.exit(0)
sys.exit(2)
"#;

/// Runs [`SCRIPT`] with `args` in a short-lived container of `image` that mounts the store
/// (read-only unless `write`), after uploading `upload` (a tar) into the store's root when
/// given. Returns the exit code and what the script printed. An upload that fails still
/// runs the script, whose `store` step then discards the partial directory.
async fn run_script(
    docker: &dyn Engine,
    store: &Store,
    image: &str,
    owner: &Owner,
    args: Vec<String>,
    write: bool,
    upload: Option<Tar>,
) -> Result<(i64, String, Option<Error>), Error> {
    let id = create_script(docker, store, image, owner, args, write).await?;
    let result = finish_script(docker, &id, upload).await;
    container::remove_container(docker, &id).await;
    result
}

/// Creates (does not start) the container of [`run_script`].
async fn create_script(
    docker: &dyn Engine,
    store: &Store,
    image: &str,
    owner: &Owner,
    args: Vec<String>,
    write: bool,
) -> Result<String, Error> {
    let name = format!("pyberth-{}-store-{}", owner.instance, crate::docker::next_serial());
    let mounts = vec![Mount {
        target: Some(MOUNT.into()),
        source: Some(store.volume.clone()),
        typ: Some(MountType::VOLUME),
        read_only: Some(!write),
        volume_options: Some(MountVolumeOptions { no_copy: Some(true), ..Default::default() }),
        ..Default::default()
    }];
    let utility = crate::docker::utility::Utility {
        name: &name,
        owner,
        image,
        script: SCRIPT,
        args,
        // Root, without capabilities: the owner of the store's root and of every set in it.
        user: "0:0".into(),
        memory: 256 << 20,
        pids: 64,
        runtime: None,
        mounts,
    };
    let mut t = std::time::Instant::now();
    let id = crate::docker::utility::create_utility(docker, utility).await?;
    super::lap("store: create", &mut t);
    Ok(id)
}

/// Uploads `upload` into the created container `id`, starts it and waits for its script.
/// The caller removes the container.
async fn finish_script(
    docker: &dyn Engine,
    id: &str,
    upload: Option<Tar>,
) -> Result<(i64, String, Option<Error>), Error> {
    let mut t = std::time::Instant::now();
    let mut upload_error = None;
    if let Some(tar) = upload {
        let opts = UploadToContainerOptionsBuilder::default().path(MOUNT).build();
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counter = sent.clone();
        let tar = tar.inspect(move |c| {
            if let Ok(c) = c {
                counter.fetch_add(c.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
        });
        if let Err(e) = docker.upload_to_container(id, Some(opts), crate::docker::body_try_stream(tar)).await {
            upload_error = Some(Error::from(e));
        }
        tracing::debug!(bytes = sent.load(std::sync::atomic::Ordering::Relaxed), "uploaded to the layer store");
        super::lap("store: upload", &mut t);
    }
    let attach = AttachContainerOptionsBuilder::default().stream(true).stdout(true).stderr(true).build();
    let mut output = docker.attach_container(id, Some(attach)).await?.output;
    docker.start_container(id, None).await?;
    let mut out = Vec::new();
    let read = async {
        while let Some(frame) = output.next().await {
            match frame {
                Ok(LogOutput::StdOut { message }) => out.extend_from_slice(&message),
                Ok(LogOutput::StdErr { message }) => {
                    tracing::warn!(output = %String::from_utf8_lossy(&message), "layer store script");
                }
                Ok(_) => {}
                Err(e) => return Err(Error::from(e)),
            }
        }
        Ok(())
    };
    tokio::time::timeout(std::time::Duration::from_secs(600), read)
        .await
        .map_err(|_| Error::Failed("the layer store did not answer within 600 s".into()))??;
    super::lap("store: attach, start, script", &mut t);
    let code = match docker.wait_container(id, None).next().await {
        Some(Ok(r)) => r.status_code,
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code,
        Some(Err(e)) => return Err(e.into()),
        None => -1,
    };
    super::lap("store: wait", &mut t);
    Ok((code, String::from_utf8_lossy(&out).into_owned(), upload_error))
}

/// A store writer created ahead of the tree it will store (its creation then overlaps the
/// install): [`Writer::put`] uploads and renames, [`Writer::discard`] removes it unused.
#[derive(Debug)]
pub struct Writer {
    id: String,
    /// The upload's temporary directory, in the store's root.
    pub tmp: String,
}

impl Writer {
    /// A writer for set `key`, created now and started by [`Writer::put`].
    pub async fn create(
        docker: &dyn Engine,
        store: &Store,
        image: &str,
        owner: &Owner,
        key: &str,
    ) -> Result<Self, Error> {
        let tmp = tmp_name()?;
        let args = vec!["store".into(), tmp.clone(), store.dir_name(key), key.to_owned()];
        let id = create_script(docker, store, image, owner, args, true).await?;
        Ok(Writer { id, tmp })
    }

    /// Uploads `tar` (one `.tmp-*` directory, [`Writer::tmp`], holding `site/` and, last,
    /// `meta.json` naming the key) and renames it into the set's place. A tar cut short has no
    /// whole `meta.json` and is discarded, as is a copy that lost the race to another writer.
    /// The writer's container is left for [`Writer::discard`], which the caller may overlap
    /// with its own clean-up.
    pub async fn put(&self, docker: &dyn Engine, tar: Tar) -> Result<Stored, Error> {
        let (code, _, upload_error) = finish_script(docker, &self.id, Some(tar)).await?;
        match (code, upload_error) {
            (0, None) => Ok(Stored::New),
            (1, None) => Ok(Stored::Exists),
            (_, Some(e)) => Err(e),
            (3, None) => Err(Error::Failed("install failed: the installed tree did not arrive whole".into())),
            (code, None) => {
                Err(Error::Failed(format!("install failed: the layer store refused the set (code {code})")))
            }
        }
    }

    /// Removes the writer's container.
    pub async fn discard(self, docker: &dyn Engine) {
        container::remove_container(docker, &self.id).await;
    }
}

/// A set as its `meta.json` describes it, by directory name (None: unreadable metadata).
pub async fn index(
    docker: &dyn Engine,
    store: &Store,
    image: &str,
    owner: &Owner,
) -> Result<HashMap<String, Option<serde_json::Value>>, Error> {
    let (code, out, _) = run_script(docker, store, image, owner, vec!["list".into()], false, None).await?;
    if code != 0 {
        return Err(Error::Failed(format!("cannot list the layer store (code {code})")));
    }
    serde_json::from_str(out.trim()).map_err(|e| Error::Failed(format!("cannot read the layer store's listing: {e}")))
}

/// Removes the sets in `dirs`: each renamed away first, so it disappears at once, then deleted.
/// Returns those removed.
pub async fn remove(
    docker: &dyn Engine,
    store: &Store,
    image: &str,
    owner: &Owner,
    dirs: &[String],
) -> Result<Vec<String>, Error> {
    if dirs.is_empty() {
        return Ok(Vec::new());
    }
    let args = std::iter::once("remove".to_owned()).chain(dirs.iter().cloned()).collect();
    let (code, out, _) = run_script(docker, store, image, owner, args, true, None).await?;
    if code != 0 {
        return Err(Error::Failed(format!("cannot remove from the layer store (code {code})")));
    }
    Ok(out.lines().map(str::to_owned).collect())
}

/// 32 random bytes from the kernel, hex.
fn random_hex() -> Result<String, Error> {
    use std::io::Read as _;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::Failed(format!("cannot read random bytes: {e}")))?;
    Ok(hex(&b))
}

/// A fresh name for an upload's temporary directory.
pub fn tmp_name() -> Result<String, Error> {
    Ok(format!(".tmp-{}", &random_hex()?[..24]))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// HMAC-SHA256 (RFC 2104) over sha2, which the crate already has.
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |x: u8| block.iter().map(|b| b ^ x).collect::<Vec<u8>>();
    let inner = Sha256::new().chain_update(pad(0x36)).chain_update(msg).finalize();
    Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2 of RFC 4231.
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(hex(&mac), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        // Test case 6: a key longer than the block.
        let mac = hmac_sha256(&[0xaa; 131], b"Test Using Larger Than Block-Size Key - Hash Key First");
        assert_eq!(hex(&mac), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    }

    #[test]
    fn set_names_depend_on_the_secret_and_the_key() {
        let a = Store { volume: "v".into(), secret: b"s1".to_vec() };
        let b = Store { volume: "v".into(), secret: b"s2".to_vec() };
        assert_eq!(a.dir_name("k").len(), 32);
        assert_eq!(a.dir_name("k"), a.dir_name("k"));
        assert_ne!(a.dir_name("k"), b.dir_name("k"));
        assert_ne!(a.dir_name("k"), a.dir_name("k2"));
        assert_eq!(a.site_path("k"), format!("{STORE_DIR}/{}/site", a.dir_name("k")));
    }
}
