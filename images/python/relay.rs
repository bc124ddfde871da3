//! pyberth relay (docs/design.md D12): the long-lived end of the exec the server holds.
//!
//! `relay attach DIR -- CMD...` is what the server execs: when a keeper listens on DIR's socket
//! it relays to it at once; when none answers and CMD is our agent, it starts the agent as its
//! own keeper (under keeper.py's lock) and relays to it; otherwise it becomes `keeper.py
//! attach`, which starts one and execs `relay FD` with the socket's fd. `relay FD` relays on
//! that socket. Stdin goes to the keeper in frames of kind `0`; frames `1` and `2` go to stdout
//! and stderr; frame `x` is the agent's exit status, ours once the output is written. At
//! stdin's end (the server leaves in order) it asks the keeper to let go, frame `d`, and
//! forwards what comes until the keeper's `D` (or its end): then it exits 0, all written.
//! Frames: one byte of kind, four bytes of length (big-endian), the bytes.
//!
//! Why not perl or Python: this process lives as long as a session is attached, and it is on
//! the path of every call and of every reattach. A static binary of the standard library
//! starts in about a millisecond (perl: ~15 ms of CPU) and idles in a few hundred KiB (perl:
//! 0.9 MiB private, plus its library in the container's page cache). The server's build
//! compiles this one file with `rustc` (build.rs) and carries the binary into the image.
//! Linux only; the few libc calls std has no word for are declared below.

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio, exit};

const LIMIT: usize = 1 << 20;
const CHUNK: usize = 1 << 16;
/// Longest frame the keeper may send; its are at most CHUNK.
const MAX_FRAME: usize = 1 << 20;
/// How long an attach waits for a keeper it started to listen (keeper.py START_TIMEOUT): as
/// long as the server waits for the hello, so a loaded machine starts sessions late, not never.
const START_TIMEOUT_MS: i32 = 30_000;
const KEEPER: &str = "/opt/pyberth/keeper.py";
/// How the agent keeps itself (keeper.py BOOT, with the agent's directory for `{}`).
const AGENT_BOOT: &str = "import sys; sys.path[:] = ['{}'] + [p for p in sys.path if p]; import agent; \
     del sys.path[0]; del sys.modules['agent']; agent.main(sys.argv[1:])";

#[repr(C)]
struct PollFd {
    fd: i32,
    events: i16,
    revents: i16,
}

const POLLIN: i16 = 0x1;
const POLLOUT: i16 = 0x4;
const POLLERR: i16 = 0x8;
const POLLHUP: i16 = 0x10;
const F_SETFD: i32 = 2;
const F_GETFL: i32 = 3;
const F_SETFL: i32 = 4;
/// The same on x86_64 and aarch64 (and every Linux but alpha, sparc, parisc).
const O_NONBLOCK: i32 = 0o4000;
#[cfg(target_arch = "x86_64")]
const O_NOFOLLOW: i32 = 0o400_000;
#[cfg(target_arch = "aarch64")]
const O_NOFOLLOW: i32 = 0o100_000;
// build.rs compiles this file only for these two (elsewhere keeper.py relays).
#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
compile_error!("the relay is for x86_64 and aarch64 Linux");

unsafe extern "C" {
    fn poll(fds: *mut PollFd, n: std::ffi::c_ulong, timeout: i32) -> i32;
    fn fcntl(fd: i32, cmd: i32, ...) -> i32;
    fn getuid() -> u32;
    fn setsid() -> i32;
}

fn set_nonblocking(fd: RawFd) {
    // SAFETY: fcntl on an fd number: at worst EBADF, which is ignored.
    unsafe {
        let flags = fcntl(fd, F_GETFL, 0);
        if flags >= 0 {
            fcntl(fd, F_SETFL, flags | O_NONBLOCK);
        }
    }
}

fn frame(out: &mut Vec<u8>, kind: u8, data: &[u8]) {
    out.push(kind);
    out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(data);
}

/// PATH's socket, connected; or None, and whether nobody listens there (no socket, or none
/// behind it): only then is a keeper started in its place; any other failure is keeper.py's.
fn reach(path: &Path) -> (Option<UnixStream>, bool) {
    match UnixStream::connect(path) {
        Ok(s) => (Some(s), false),
        Err(e) => (None, matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused)),
    }
}

/// DIR is a directory of this uid that nobody else may enter (never one planted by another).
fn private(dir: &Path) -> bool {
    // SAFETY: getuid cannot fail.
    let me = unsafe { getuid() };
    std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir() && m.uid() == me && m.mode() & 0o077 == 0)
}

/// The directory of our agent when `last` is `/…/agent.py` of plain characters.
fn agent_home(last: &OsStr) -> Option<&str> {
    let s = std::str::from_utf8(last.as_bytes()).ok()?;
    let home = s.strip_suffix("/agent.py")?;
    let plain = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    (home.starts_with('/') && home.chars().all(plain)).then_some(home)
}

fn plain_word(w: &OsStr) -> bool {
    !w.is_empty() && w.as_bytes().iter().all(|&b| b.is_ascii_alphanumeric() || b"_./-".contains(&b))
}

/// Starts our agent as its own keeper (agent.py `keep`): a session of its own, stdio on
/// /dev/null, nothing of ours open but the ready pipe; waits until it
/// listens, and reaches it.
fn start_agent(sock_path: &Path, home: &str, cmd: &[OsString]) -> Option<UnixStream> {
    let (mut ready_r, ready_w) = std::io::pipe().ok()?;
    let fd = ready_w.as_raw_fd();
    let (program, rest) = cmd.split_first()?;
    let middle = &rest[..rest.len().saturating_sub(1)];
    let mut c = Command::new(program);
    c.args(middle)
        .arg("-c")
        .arg(AGENT_BOOT.replace("{}", home))
        .arg("keep")
        .arg(fd.to_string())
        .arg(sock_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: only async-signal-safe calls between fork and exec. A session of its own at once,
    // out of the exec's; std's fds are close-on-exec, the ready pipe is passed.
    unsafe {
        c.pre_exec(move || {
            setsid();
            fcntl(fd, F_SETFD, 0);
            Ok(())
        });
    }
    // Not waited for: it outlives us (the container's init reaps it).
    drop(c.spawn().ok()?);
    drop(ready_w);
    let mut p = [PollFd { fd: ready_r.as_raw_fd(), events: POLLIN, revents: 0 }];
    // SAFETY: one valid pollfd.
    let n = unsafe { poll(p.as_mut_ptr(), 1, START_TIMEOUT_MS) };
    let mut got = [0u8; 1];
    if n != 1 || ready_r.read(&mut got).ok() != Some(1) || got[0] != b'1' {
        return None;
    }
    reach(sock_path).0
}

/// The keeper's socket in DIR, connected; when no keeper answers there, our agent started as
/// keeper.py attach would start it, under the same lock; any other command, or a DIR that is
/// not private, is keeper.py attach's (it starts the keeper, or says what is wrong).
fn attach(args: &[OsString]) -> UnixStream {
    let [dir, sep, cmd @ ..] = args else { exit(2) };
    if sep != "--" || cmd.is_empty() {
        exit(2);
    }
    let dir = Path::new(dir);
    let sock_path = dir.join("sock");
    let fits = sock_path.as_os_str().len() < 108;
    if fits
        && private(dir)
        && let (Some(s), _) = reach(&sock_path)
    {
        return s;
    }
    let home = cmd.last().and_then(|l| agent_home(l));
    if let Some(home) = home.filter(|_| fits && plain_word(&cmd[0])) {
        let _ = std::fs::DirBuilder::new().mode(0o700).create(dir);
        // Checked before anything is made in it: never a lock in a directory planted by another.
        let lock = private(dir)
            .then(|| {
                let mut o = OpenOptions::new();
                o.read(true).write(true).create(true).mode(0o600).custom_flags(O_NOFOLLOW);
                o.open(dir.join("lock")).ok()
            })
            .flatten();
        if let Some(lock) = lock
            && lock.lock().is_ok()
        {
            let (s, nobody) = reach(&sock_path);
            let starting = s.is_none() && nobody;
            let s = if starting { start_agent(&sock_path, home, cmd) } else { s };
            drop(lock);
            if let Some(s) = s {
                return s;
            }
            if starting {
                eprintln!("keeper: the keeper did not start");
                exit(1);
            }
        }
    }
    let _ = Command::new("python3").args(["-I", "-S", "-B", KEEPER, "attach"]).arg(dir).arg("--").args(cmd).exec();
    exit(1)
}

/// Copies stdin to the keeper and the keeper's frames to stdout and stderr until either side
/// ends; exits with the agent's status when the keeper reports it.
fn relay(mut sock: UnixStream) -> ! {
    for fd in [0, 1, 2] {
        set_nonblocking(fd);
    }
    if sock.set_nonblocking(true).is_err() {
        exit(1);
    }
    // SAFETY: the process's own stdio, never closed here (ManuallyDrop).
    let own = |fd: RawFd| ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    let (mut stdin, mut outs) = (own(0), [own(1), own(2)]);
    let (mut to_sock, mut incoming) = (Vec::new(), Vec::new());
    let mut to_fd: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    let mut status: Option<i32> = None;
    let (mut stdin_open, mut detaching) = (true, false);
    let mut buf = vec![0u8; CHUNK];
    loop {
        let pending_out = to_fd[0].len() + to_fd[1].len();
        if let Some(code) = status
            && pending_out == 0
        {
            exit(code);
        }
        let want_in = stdin_open && to_sock.len() < LIMIT;
        // Little held here: what a killed relay held is lost, what the keeper holds is not.
        let want_sock = if status.is_none() && pending_out < CHUNK { POLLIN } else { 0 }
            | if to_sock.is_empty() { 0 } else { POLLOUT };
        let mut fds = [
            PollFd { fd: if want_in { 0 } else { -1 }, events: POLLIN, revents: 0 },
            PollFd { fd: if want_sock != 0 { sock.as_raw_fd() } else { -1 }, events: want_sock, revents: 0 },
            PollFd { fd: if to_fd[0].is_empty() { -1 } else { 1 }, events: POLLOUT, revents: 0 },
            PollFd { fd: if to_fd[1].is_empty() { -1 } else { 2 }, events: POLLOUT, revents: 0 },
        ];
        // SAFETY: four valid pollfds (a negative fd is skipped).
        if unsafe { poll(fds.as_mut_ptr(), 4, -1) } < 0 {
            if std::io::Error::last_os_error().kind() == ErrorKind::Interrupted {
                continue;
            }
            exit(1);
        }
        let ready = |p: &PollFd, ev: i16| p.fd >= 0 && p.revents & (ev | POLLERR | POLLHUP) != 0;
        if ready(&fds[0], POLLIN) {
            match stdin.read(&mut buf) {
                Ok(n) if n > 0 => frame(&mut to_sock, b'0', &buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                // The server closed its end (or it broke): the keeper finishes the frame it
                // sends, then lets go of us; what it did not send waits for the next relay.
                _ => {
                    stdin_open = false;
                    detaching = true;
                    frame(&mut to_sock, b'd', b"");
                }
            }
        }
        if want_sock & POLLIN != 0 && ready(&fds[1], POLLIN) {
            match sock.read(&mut buf) {
                Ok(n) if n > 0 => {
                    incoming.extend_from_slice(&buf[..n]);
                    take_frames(&mut incoming, &mut to_fd, &mut status);
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                // The keeper is gone (killed, or replaced us with a newer relay).
                _ => {
                    status.get_or_insert(if detaching { 0 } else { 1 });
                    continue;
                }
            }
        }
        // Written now, not after one more poll (both ends are non-blocking: what they do not
        // take waits for the next one).
        if !to_sock.is_empty() {
            let end = to_sock.len().min(CHUNK);
            match sock.write(&to_sock[..end]) {
                Ok(n) => drop(to_sock.drain(..n)),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                // The keeper is gone: during a detach, or after the agent's status, nothing
                // more comes; the rest is written.
                Err(_) if detaching || status.is_some() => to_sock.clear(),
                Err(_) => exit(1),
            }
        }
        for (out, pending) in outs.iter_mut().zip(to_fd.iter_mut()) {
            if pending.is_empty() {
                continue;
            }
            let end = pending.len().min(CHUNK);
            match out.write(&pending[..end]) {
                Ok(n) => drop(pending.drain(..n)),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                // The server's end of the stream is gone.
                Err(_) => exit(0),
            }
        }
    }
}

/// Moves the whole frames of `incoming` to stdout's and stderr's buffers, or into `status`.
fn take_frames(incoming: &mut Vec<u8>, to_fd: &mut [Vec<u8>; 2], status: &mut Option<i32>) {
    let mut at = 0;
    while incoming.len() - at >= 5 {
        let kind = incoming[at];
        let mut size = [0u8; 4];
        size.copy_from_slice(&incoming[at + 1..at + 5]);
        let size = u32::from_be_bytes(size) as usize;
        if size > MAX_FRAME {
            exit(1);
        }
        if incoming.len() - at < 5 + size {
            break;
        }
        let payload = &incoming[at + 5..at + 5 + size];
        match kind {
            b'1' => to_fd[0].extend_from_slice(payload),
            b'2' => to_fd[1].extend_from_slice(payload),
            b'x' => {
                let text = std::str::from_utf8(payload).unwrap_or("").trim();
                *status = Some(text.parse::<i64>().map_or(1, |n| (n & 0xFF) as i32));
            }
            // The keeper let go of us: nothing more comes.
            b'D' => {
                status.get_or_insert(0);
            }
            _ => {}
        }
        at += 5 + size;
    }
    incoming.drain(..at);
}

fn main() {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let sock = match args.split_first() {
        Some((first, rest)) if first == "attach" => attach(rest),
        Some((fd, [])) => {
            let fd: RawFd = fd.to_str().and_then(|s| s.parse().ok()).filter(|&n| n > 2 && n < 10_000).unwrap_or(-1);
            if fd < 0 {
                exit(1);
            }
            // SAFETY: the socket keeper.py attach passed us by number.
            unsafe { UnixStream::from_raw_fd(fd) }
        }
        _ => exit(2),
    };
    relay(sock)
}
