"""pyberth keeper: the agent outlives the exec stream that reaches it (docs/design.md D12).

`keeper.py attach DIR -- CMD...` is what the server execs. It connects to the keeper's Unix
socket in DIR; when no keeper answers, it first starts one, fully detached (double fork,
setsid, stdio on /dev/null). When CMD is our agent.py, the agent is its own keeper: it loads,
listens on that socket and forks the interpreter, and its forwarder serves the relays with
this file's `serve` (agent.py `keep`). Any other CMD is run on pipes by `keeper.py keep`.
The attach process then becomes a thin relay (it execs the relay binary, relay.rs, on the
socket's fd; relay() here when it cannot): its stdin goes to the agent's stdin, and the agent's stdout and
stderr come back framed over the socket and split again onto its own stdout and stderr, so
the server sees exactly the byte streams of an agent it started itself.

When the exec stream drops (the server restarts, a network blip to a remote engine), only the
relay dies: the keeper and the agent, with the interpreter's variables, threads and open files,
go on. The next attach is a new relay; the keeper sends it the agent's hello line again (so
the server's greeting works), drops the rest of a line the old relay got half of, and goes on.
One relay at a time: a new one replaces the old. With no relay, the keeper stops reading the
agent once a bounded buffer is full, so the agent blocks on its writes while code runs on.
When the agent exits, the keeper exits. It runs as the code's uid, like everything in the
exec: killing the code's processes kills it too, and the next attach starts a fresh one.

Frames, both ways: one byte of kind, four bytes of length (big-endian), the bytes. Kinds:
`0` stdin (relay to keeper), `1` stdout, `2` stderr, `x` the agent's exit status (ASCII);
`d` (relay to keeper, empty) at the relay's stdin end: the keeper finishes the frame it is
sending, puts the frames not begun back for the next relay, sends `D` (empty) and lets go of
that relay, which writes out what it holds and exits 0 (docs/design.md D12, a graceful leave).
Only the standard library; run with `python3 -I -S`.

Past 500 lines because it is one script the image copies whole; the orphan's save (no relay
for the grace, docs/design.md D12) lives in the loop that sees relays come and go.
"""

import collections
import errno
import fcntl
import os
import select
import stat
# The C modules, not their Python wrappers: `socket` and `signal` build enums at import, which
# cost a keeper's start ~15 ms of a ~50 ms start (design D12).
import _signal as signal
import _socket as socket
import struct
import sys
import time

# Bytes buffered per direction before a reader stops reading (backpressure).
LIMIT = 1 << 20
CHUNK = 1 << 16
HEADER = struct.Struct(">cI")
# Longest frame a peer may send; ours are at most CHUNK.
MAX_FRAME = 1 << 20
# How long an attach waits for a keeper it started to listen: as long as the server waits for
# the agent's hello (a burst of new sessions on a small machine takes seconds to start each).
START_TIMEOUT = 30.0
# Seconds without a relay after which the server is taken to be gone for good: the agent
# saves its state into the workspace for the next server (docs/design.md D12, orphans) and
# stops. Set by the server on the container; absent or 0: never.
ORPHAN_ENV = "PYBERTH_ORPHAN_AFTER_S"
# What the keeper sends the agent then: the state where a restore reads it, then the end. The
# leading newline ends any half line a dropped relay left, so the agent skips just that.
ORPHAN_REQUESTS = b'\n{"op":"save_state","id":0,"into":"restore"}\n{"op":"shutdown"}\n'


def orphan_after():
    try:
        return max(0.0, float(os.environ.get(ORPHAN_ENV) or 0))
    except ValueError:
        return 0.0


def share_workspace(top="/workspace"):
    """Makes the workspace readable by PID 1's uid, whose tether copies a tmpfs workspace to
    disk before the container stops (a tmpfs goes with it). Symlinks are left alone."""
    for root, dirs, files in os.walk(top):
        for name, bits in [(d, 0o055) for d in dirs] + [(f, 0o044) for f in files]:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
                if not stat.S_ISLNK(st.st_mode):
                    os.chmod(path, stat.S_IMODE(st.st_mode) | bits)
            except OSError:
                pass


def frame(kind, data):
    return HEADER.pack(kind, len(data)) + bytes(data)


class Frames:
    """Incremental decoder of frames."""

    def __init__(self):
        self.buf = bytearray()

    def push(self, data):
        self.buf += data

    def pop(self):
        if len(self.buf) < HEADER.size:
            return None
        kind, size = HEADER.unpack_from(self.buf)
        if size > MAX_FRAME:
            raise ValueError("frame too long")
        end = HEADER.size + size
        if len(self.buf) < end:
            return None
        data = bytes(self.buf[HEADER.size:end])
        del self.buf[:end]
        return kind, data


def write_some(fd, buf):
    """Writes what a non-blocking fd takes now; False when the reader is gone."""
    try:
        n = os.write(fd, buf[:CHUNK])
    except BlockingIOError:
        return True
    except OSError:
        return False
    del buf[:n]
    return True


def read_some(fd):
    """Bytes from a non-blocking fd: b"" at end of file, None when nothing is there now."""
    try:
        return os.read(fd, CHUNK)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def private_dir(path):
    """DIR, made 0700 and checked to be ours: never one planted by anyone else."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SystemExit("keeper: %s is not a private directory of this uid" % path)


class PipeSource:
    """The agent as a program of its own: its stdout and stderr, as they come."""

    def __init__(self, out_r, err_r):
        self.reading = {out_r: b"1", err_r: b"2"}
        for fd in self.reading:
            os.set_blocking(fd, False)

    def fds(self):
        return list(self.reading)

    def read(self, fd):
        """(kind, bytes) pairs of what FD holds now."""
        data = read_some(fd)
        if data is None:
            return ()
        kind = self.reading[fd]
        if not data:
            del self.reading[fd]
            return ()
        return ((kind, data),)

    def done(self):
        return not self.reading


def listen(sock_path):
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(4)
    listener.setblocking(False)
    return listener


def keeper(sock_path, argv, ready):
    """Body of the detached keeper of any agent command: runs it on pipes, serves relays."""
    listener = listen(sock_path)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(in_r, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 65536)
            # Python ignores these; the agent and the code's own children get the defaults
            # an exec gives them.
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    os.write(ready, b"1")
    os.close(ready)
    serve(sock_path, listener, PipeSource(out_r, err_r), pid, in_w)


def serve(sock_path, listener, source, pid, in_w):
    """Serves one relay at a time for the agent PID: what SOURCE reads of it (kind `1`, its
    event stream; `2`, its diagnostics) goes to the relay, the relay's stdin to IN_W."""
    os.set_blocking(in_w, False)
    relay = None
    incoming = Frames()
    # Frames for the current relay, each [kind, frame, bytes of it sent]; kind `h` is the hello.
    # Kept as frames so that what a dropped relay never took goes to the next one.
    queue = collections.deque()
    queued = 0  # bytes of the queue not sent
    out_buf = bytearray()  # the agent's stdout not yet framed
    err_buf = bytearray()
    to_agent = bytearray()
    hello = None
    head = bytearray()  # stdout before the hello line ended
    mid_line = False  # the last stdout byte a relay took was not a line end
    skip_line = False  # drop stdout up to the next line end (a new relay after a half line)
    alone_for = orphan_after()
    alone_since = time.monotonic()  # when the last relay left (or the keeper started)
    orphaned = False  # the save and the end were sent
    # The relay asked to go (`d`): b"line" while the end of a line it has the start of is
    # awaited, b"D" once its `D` is queued; nothing else is queued for it meanwhile.
    detaching = None

    def enqueue(kind, data):
        nonlocal queued
        f = frame(b"1" if kind == b"h" else kind, data)
        queue.append([kind, f, 0])
        queued += len(f)

    def drop_relay():
        """Forgets the relay; output it never took goes back to the buffers for the next."""
        nonlocal relay, alone_since, detaching
        if relay is not None:
            relay.close()
            alone_since = time.monotonic()
        relay = None
        detaching = None
        incoming.buf.clear()
        put_back(list(queue))
        queue.clear()

    def detach():
        """The relay's `d`: the frame it is being sent is finished, the others wait for the
        next relay, and `D` tells it that nothing more comes; it is dropped once sent."""
        nonlocal detaching
        begun = 1 if queue and queue[0][2] else 0
        put_back(list(queue)[begun:])
        while len(queue) > begun:
            queue.pop()
        # A line the relay has the start of is finished first: the server reads whole
        # lines, and the next relay would skip the rest of it.
        half = queue[0][1][-1:] != b"\n" if begun and queue[0][0] == b"1" else mid_line
        if half:
            detaching = b"line"
            finish_detach()
        else:
            detaching = b"D"
            enqueue(b"D", b"")

    def finish_detach():
        """Queues the end of the relay's half line once it is here (or the agent ended), then `D`."""
        nonlocal detaching
        end = out_buf.find(b"\n")
        if end < 0 and not source.done():
            return
        if end >= 0:
            enqueue(b"1", bytes(out_buf[: end + 1]))
            del out_buf[: end + 1]
        detaching = b"D"
        enqueue(b"D", b"")

    def put_back(frames):
        """Output of FRAMES the relay did not take goes back to the front of the buffers."""
        nonlocal queued, mid_line
        back = {b"1": bytearray(), b"2": bytearray()}
        for kind, f, sent in frames:
            queued -= len(f) - sent
            if kind not in back:
                continue
            taken = max(0, sent - HEADER.size)
            payload = f[HEADER.size:]
            back[kind] += payload[taken:]
            if kind == b"1" and taken:
                mid_line = payload[taken - 1:taken] != b"\n"
        out_buf[:0] = back[b"1"]
        err_buf[:0] = back[b"2"]

    def frame_buffered():
        """Frames buffered output for the relay, a chunk of each stream at a time."""
        if relay is None or detaching or queued >= CHUNK:
            return
        if out_buf:
            piece = bytes(out_buf[:CHUNK])
            del out_buf[:CHUNK]
            enqueue(b"1", piece)
        if err_buf:
            piece = bytes(err_buf[:CHUNK])
            del err_buf[:CHUNK]
            enqueue(b"2", piece)

    def send_some():
        """Sends what the relay takes now of the first frame queued; False when it is gone."""
        nonlocal queued, mid_line
        first = queue[0]
        try:
            n = relay.send(first[1][first[2]:first[2] + CHUNK])
        except BlockingIOError:
            return True
        except OSError:
            return False
        first[2] += n
        queued -= n
        if first[2] == len(first[1]):
            queue.popleft()
            if first[0] == b"1":
                mid_line = first[1][-1:] != b"\n"
        return True

    def skip_to_line_end():
        nonlocal skip_line
        i = out_buf.find(b"\n")
        if i < 0:
            out_buf.clear()
            skip_line = True
        else:
            del out_buf[: i + 1]
            skip_line = False

    while True:
        if orphaned and relay is None:
            # Nobody will read it: the next server restores the saved state instead.
            out_buf.clear()
            err_buf.clear()
        agent_done = source.done() and not out_buf and not err_buf
        if agent_done and (relay is None or not queue):
            status = None
            for _ in range(40):
                try:
                    done, code = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    status = os.waitstatus_to_exitcode(code)
                    # Killed by signal N: 128 + N, as a shell (and the server's OOM check,
                    # which looks for 137) reports it, not the 256 - N of exiting with -N.
                    if status < 0:
                        status = 128 - status
                    break
                time.sleep(0.05)
            if relay is not None:
                relay.setblocking(True)
                try:
                    relay.sendall(frame(b"x", str(status if status is not None else 1).encode()))
                except OSError:
                    pass
            try:
                os.unlink(sock_path)
            except OSError:
                pass
            if orphaned:
                share_workspace()
            os._exit(0)

        frame_buffered()

        rlist = [listener]
        wlist = []
        held = len(out_buf) + len(err_buf) + queued
        if held < LIMIT:
            rlist += source.fds()
        if relay is not None:
            if len(to_agent) < LIMIT:
                rlist.append(relay)
            if queue:
                wlist.append(relay)
        if to_agent and in_w is not None:
            wlist.append(in_w)
        timeout = None
        if relay is None and alone_for and not orphaned:
            timeout = max(0.0, alone_since + alone_for - time.monotonic())
        readable, writable, _ = select.select(rlist, wlist, [], timeout)
        if relay is None and alone_for and not orphaned and time.monotonic() - alone_since >= alone_for:
            # No server for the grace: the state goes to disk and the agent ends (the
            # server's tether stops the container a little later).
            orphaned = True
            if in_w is not None:
                to_agent += ORPHAN_REQUESTS

        if listener in readable:
            try:
                fd, _ = listener._accept()
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd)
            except OSError:
                conn = None
            if conn is not None:
                drop_relay()
                relay = conn
                relay.setblocking(False)
                # Little in flight to a relay: a killed one loses what the socket held.
                try:
                    relay.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * CHUNK)
                except OSError:
                    pass
                if hello is not None:
                    enqueue(b"h", hello)
                if mid_line:
                    mid_line = False
                    skip_to_line_end()
        for fd in source.fds():
            if fd not in readable:
                continue
            for kind, data in source.read(fd):
                if kind == b"2":
                    err_buf += data
                    continue
                if hello is None:
                    head += data
                    i = head.find(b"\n")
                    if i < 0 and len(head) < LIMIT:
                        continue
                    hello = bytes(head[: i + 1]) if i >= 0 else bytes(head)
                    out_buf += head[len(hello):]
                    head.clear()
                    if relay is not None:
                        enqueue(b"h", hello)
                    continue
                out_buf += data
                if skip_line:
                    skip_to_line_end()
                if detaching == b"line":
                    finish_detach()
        if relay is not None and relay in readable:
            try:
                data = relay.recv(CHUNK)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                drop_relay()
            elif data:
                incoming.push(data)
                try:
                    while True:
                        got = incoming.pop()
                        if got is None:
                            break
                        if got[0] == b"0" and in_w is not None:
                            to_agent += got[1]
                        elif got[0] == b"d" and detaching is None:
                            detach()
                except ValueError:
                    drop_relay()
        # Written now, not after one more select: a warm run's request and each of its
        # events cross this loop, and an iteration costs tens of microseconds. Both ends are
        # non-blocking; what they do not take waits for the next select.
        if relay is not None:
            frame_buffered()
            if queue and not send_some():
                drop_relay()
            elif detaching == b"D" and not queue:
                # Its `D` is sent: what was not sent stays queued for the next relay.
                drop_relay()
        if in_w is not None and to_agent:
            if not write_some(in_w, to_agent):
                os.close(in_w)
                in_w = None
                to_agent.clear()


def start_keeper(sock_path, argv):
    """Starts a keeper fully detached and waits until it listens."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            # Nothing of the relay's stays open in the keeper (its lock, its exec pipes).
            os.closerange(3, ready_w)
            os.closerange(ready_w + 1, 65536)
            # A command line of its own, so `ps` (and anyone killing relays) tells it apart.
            os.set_inheritable(ready_w, True)
            if os.path.basename(argv[-1]) == "agent.py":
                # Our agent keeps itself: its forwarder process serves the relays, so a
                # session holds one interpreter and its fork (agent.py, `keep`). Imported,
                # not run as a script, so the code the image compiled is loaded (the hash
                # of the source checked): compiling 1500 lines at start leaves ~3 MiB.
                boot = BOOT % os.path.dirname(argv[-1])
                os.execvp(argv[0], argv[:-1] + ["-c", boot, "keep", str(ready_w), sock_path])
            me = os.path.abspath(__file__)
            os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", me, "keep", str(ready_w), sock_path, "--"] + argv)
        finally:
            os._exit(1)
    os.close(ready_w)
    os.waitpid(pid, 0)
    ready = select.select([ready_r], [], [], START_TIMEOUT)[0]
    ok = ready and os.read(ready_r, 1) == b"1"
    os.close(ready_r)
    if not ok:
        raise SystemExit("keeper: the keeper did not start")


# How start_keeper runs the agent as its own keeper: from its directory, as a module `agent`
# that then leaves sys.path and sys.modules (the code's own agent.py stays importable). No
# '' (the workspace) on the path while the agent loads: Pythons before 3.11 put it there for -c.
BOOT = (
    "import sys; sys.path[:] = [%r] + [p for p in sys.path if p]; import agent; del sys.path[0]; "
    "del sys.modules['agent']; "
    "agent.main(sys.argv[1:])"
)


def connect(sock_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
    except OSError:
        s.close()
        return None
    return s


def relay(sock):
    """Copies stdin to the keeper and the keeper's frames to stdout and stderr until either
    side ends; exits with the agent's status when the keeper reports it."""
    sock.setblocking(False)
    for fd in (0, 1, 2):
        os.set_blocking(fd, False)
    to_sock = bytearray()
    to_fd = {1: bytearray(), 2: bytearray()}
    incoming = Frames()
    stdin_open = True
    detaching = False
    status = None
    while True:
        pending_out = len(to_fd[1]) + len(to_fd[2])
        if status is not None and not pending_out:
            os._exit(status)
        rlist, wlist = [], []
        if stdin_open and len(to_sock) < LIMIT:
            rlist.append(0)
        # Little held here: what a killed relay held is lost, what the keeper holds is not.
        if status is None and pending_out < CHUNK:
            rlist.append(sock)
        if to_sock:
            wlist.append(sock)
        wlist += [fd for fd, buf in to_fd.items() if buf]
        readable, writable, _ = select.select(rlist, wlist, [])
        if 0 in readable:
            data = read_some(0)
            if data == b"":
                # The server closed its end (or it broke): the keeper finishes the frame it
                # sends, then lets go of us; what it did not send waits for the next relay.
                # The agent stays with the keeper.
                stdin_open = False
                detaching = True
                to_sock += frame(b"d", b"")
            elif data:
                to_sock += frame(b"0", data)
        if sock in readable:
            try:
                data = sock.recv(CHUNK)
            except BlockingIOError:
                data = None
            except OSError:
                data = b""
            if data == b"":
                # The keeper is gone (killed, or replaced us with a newer relay).
                if status is None:
                    status = 0 if detaching else 1
                continue
            if data:
                incoming.push(data)
                while True:
                    got = incoming.pop()
                    if got is None:
                        break
                    kind, payload = got
                    if kind == b"1":
                        to_fd[1] += payload
                    elif kind == b"2":
                        to_fd[2] += payload
                    elif kind == b"x":
                        try:
                            status = int(payload) & 0xFF
                        except ValueError:
                            status = 1
                    elif kind == b"D" and status is None:
                        # The keeper let go of us: nothing more comes.
                        status = 0
        if sock in writable:
            try:
                n = sock.send(to_sock[:CHUNK])
                del to_sock[:n]
            except BlockingIOError:
                pass
            except OSError:
                # The keeper is gone: during a detach, nothing more comes, the rest is written.
                if not detaching:
                    os._exit(1)
                to_sock.clear()
        for fd, buf in to_fd.items():
            if fd in writable and not write_some(fd, buf):
                # The server's end of the stream is gone.
                os._exit(0)


def attach(path, argv):
    private_dir(path)
    sock_path = os.path.join(path, "sock")
    # One attach at a time decides whether a keeper must be started.
    lock = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    sock = connect(sock_path)
    if sock is None:
        start_keeper(sock_path, argv)
        sock = connect(sock_path)
    os.close(lock)
    if sock is None:
        raise SystemExit("keeper: cannot reach the keeper at %s" % sock_path)
    exec_relay(sock)
    relay(sock)


# The relay as a static binary (relay.rs): the one process of a session that is not needed
# while it idles, so not a second Python interpreter (~4.7 MiB private each). relay() stays
# for images without it.
RELAY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay")


def exec_relay(sock):
    """Becomes the relay on SOCK's fd; returns only when that cannot be done."""
    if not os.access(RELAY, os.X_OK):
        return
    fd = sock.fileno()
    try:
        os.set_inheritable(fd, True)
        os.execve(RELAY, [RELAY, str(fd)], {})
    except OSError:
        os.set_inheritable(fd, False)


def main():
    args = sys.argv[1:]
    if len(args) >= 5 and args[0] == "keep" and args[3] == "--":
        # The detached keeper, exec'd by start_keeper: its ready fd, its socket, the agent.
        try:
            keeper(args[2], args[4:], int(args[1]))
        finally:
            os._exit(1)
    if len(args) < 4 or args[0] != "attach" or args[2] != "--":
        raise SystemExit("usage: keeper.py attach DIR -- CMD...")
    attach(args[1], args[3:])


if __name__ == "__main__":
    main()
