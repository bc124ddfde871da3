"""pyberth in-sandbox agent.

Started by the server as one long-lived `docker exec` per session. It reads requests as
newline-delimited JSON on its stdin and writes events as newline-delimited JSON on its stdout.
User code never touches those two streams: the agent keeps a private copy of fd 0, points
fd 0 at /dev/null and fds 1 and 2 at pipes. A forwarder process (see `Forwarder`) owns the
event stream and sends whatever arrives on the pipes, so output of child processes is
captured too, and output written just before the interpreter dies is not lost. In the
sandbox that process is the keeper (`keep`): it forked the interpreter and serves the
event stream to relays on a Unix socket (keeper.py, docs/design.md D12).

Standard library only: the same file runs on every base image.
Why this file passes 500 lines: the image copies it whole as the one agent, and code mode's
`tools` module (ToolBridge, make_tools_module) lives here so the reader thread can route answers.
"""

import ast
import binascii
import builtins
import collections
import errno
import gc
import json
import linecache
import os
import resource
import select
import io
import site
import stat
import sys
import threading
import time
import types

# The C module, not its Python wrapper (which builds enums at import). What runs before the
# hello is on the path of every new session: importlib, queue, traceback and base64 are left
# out or loaded when first needed (about 20 ms of a 50 ms start, design D12).
import _frozen_importlib
import _signal as signal

PROTOCOL_VERSION = 2
CHUNK = 65536  # bytes per output event; keeps every line far below the server's line cap
MAX_TEXT = 65536  # cap for repr, tracebacks and variable listings sent back
AGENT_FILE = os.path.abspath(__file__)
# Packages an image itself carries, and the layer store: one read-only directory per set,
# each put on the path when the session asks for it (`attach`).
LAYER_SITE = "/opt/pyberth/site"
LAYER_STORE = "/opt/pyberth/layers"
# The code's working directory, /workspace in the sandbox. PYBERTH_WORKSPACE exists only so
# that the server's protocol tests can run this file as a local process in a temporary
# directory; the sandbox never sets it. Resolved, since workspace_path compares real paths.
WORKSPACE = os.path.realpath(os.environ.get("PYBERTH_WORKSPACE", "/workspace"))
MAX_IMAGES = 10  # figures returned per run
MAX_IMAGE_BYTES = 4 << 20
MAX_RUN_IMAGES = 16  # images of any kind per run: the server keeps no more (session/extras.rs)
REPR_SECONDS = 0.5  # time one variable's repr may take in a listing
VARS_SECONDS = 3.0  # time a whole listing may spend on reprs, far below the server's 20 s
PACK_CHUNK = 512 << 10  # archive bytes per `file` event of a `pack` answer
MAX_DEPTH = 64  # deepest path a `pack` walks, as the server's transfers
# Longest a run waits for the forwarder to take the previous run's done (Agent.settle):
# instant unless the forwarder is stopped or a keeper with no relay holds back its reads.
SETTLE_SECONDS = 5.0


class PathError(Exception):
    """A workspace path the caller may not use."""


class ReprTimeout(BaseException):
    """A repr in a variable listing took too long. A BaseException, so that a repr's own
    `except Exception` does not swallow it."""


def open_regular(full, rel, flags, mode=0o644):
    """Opens a workspace file only if it is a regular file. Never blocks on what the code
    made: a FIFO, a socket or a device is refused before anything waits on it (O_NONBLOCK
    makes the open itself return at once; a FIFO without a reader fails it with ENXIO)."""
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise PathError("%s is not a regular file" % rel)
    try:
        fd = os.open(full, flags | os.O_NONBLOCK | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ELOOP, errno.EISDIR):
            raise PathError("%s is not a regular file" % rel)
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PathError("%s is not a regular file" % rel)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def workspace_path(rel, must_exist=True):
    """Resolves a relative path inside the workspace. Symlinks made by the code are followed
    only as far as they stay inside the workspace."""
    full = os.path.realpath(os.path.join(WORKSPACE, rel))
    if full != WORKSPACE and not full.startswith(WORKSPACE + "/"):
        raise PathError("%s leads outside the workspace" % rel)
    if must_exist and not os.path.lexists(full):
        raise PathError("%s does not exist" % rel)
    return full


class PackSink:
    """Where `pack` writes its tar: sent on as `file` events with `more`, PACK_CHUNK bytes each."""

    def __init__(self, channel, req_id):
        self.channel = channel
        self.id = req_id
        self.buf = bytearray()

    chunk = PACK_CHUNK

    def write(self, data):
        self.buf += data
        while len(self.buf) >= self.chunk:
            self.send(bytes(self.buf[:self.chunk]))
            del self.buf[:self.chunk]
        return len(data)

    def send(self, data):
        self.channel.send({"ev": "file", "id": self.id, "more": True, "b": b64(data)})

    def close(self):
        if self.buf:
            self.send(bytes(self.buf))
            self.buf = bytearray()


def tar_cost(arcname, size=0, linkname=""):
    """Bytes an entry takes in a GNU tar: its header, its content padded to 512, and the extra
    blocks of a long name or link target."""
    cost = 512 + -(-size // 512) * 512
    for name in (arcname, linkname):
        n = len(name.encode("utf-8", "surrogateescape"))
        if n >= 100:
            cost += 512 + -(-(n + 1) // 512) * 512
    return cost


class ExactReader:
    """Exactly `size` bytes of an open file, as its tar header promised: zeros if the file
    shrank meanwhile, cut if it grew."""

    def __init__(self, fd, size):
        self.fd = fd
        self.left = size

    def read(self, n=-1):
        n = self.left if n is None or n < 0 else min(n, self.left)
        chunks, got = [], 0
        while got < n:
            data = os.read(self.fd, n - got)
            if not data:
                chunks.append(b"\0" * (n - got))
                break
            chunks.append(data)
            got += len(data)
        self.left -= n
        return b"".join(chunks)


def add_site_dir(path):
    """Puts a package dir (with its .pth files) ahead of those already there, and of the
    system's. Child interpreters (run_file, subprocess) find it through PYTHONPATH."""
    if path in sys.path:
        return
    before = list(sys.path)
    site.addsitedir(path)
    added = [p for p in sys.path if p not in before]
    for p in added:
        sys.path.remove(p)
    sys.path[1:1] = added
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p != path]
    os.environ["PYTHONPATH"] = ":".join([path] + paths)
    stdlib("importlib").invalidate_caches()


def add_site_dirs():
    """The image's own package dir, if it has one."""
    os.environ["PYTHONPATH"] = LAYER_SITE
    if os.path.isdir(LAYER_SITE):
        add_site_dir(LAYER_SITE)


def attach_layers(paths):
    """The `attach` request: puts each set's directory of the layer store on the path, the
    last asked for first. Only `site` directories right under the store: the server names
    them, and a session cannot list the store to find others. Returns those not found."""
    missing = []
    for path in paths if isinstance(paths, list) else []:
        parts = path.split("/") if isinstance(path, str) else []
        if (
            len(parts) != 6
            or "/".join(parts[:4]) != LAYER_STORE
            or parts[5] != "site"
            or parts[4] in ("", ".", "..")
            or not os.path.isdir(path)
        ):
            missing.append(str(path)[:200])
            continue
        add_site_dir(path)
    return missing


def stdlib(name):
    """Imports a standard module on first use, never from the workspace (sys.path[0] is the
    working directory). Lazy because importlib.metadata alone holds 5 MiB in every idle
    session, and subprocess 2 MiB."""
    module = sys.modules.get(name)
    if module is not None and not in_workspace(module):
        return module
    # A workspace file of that name the code imported (a queue.py, say) stays the code's; the
    # agent gets the standard one.
    shadow = sys.modules.pop(name, None)
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p not in ("", ".", WORKSPACE)]
    try:
        # What importlib.import_module calls, without loading importlib (nor going through a
        # builtins.__import__ the code or a library replaced).
        return _frozen_importlib._gcd_import(name)
    finally:
        sys.path[:] = saved
        if shadow is not None:
            sys.modules[name] = shadow


def in_workspace(module):
    """Whether MODULE was loaded from a file in the workspace."""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False
    try:
        return os.path.realpath(path).startswith(WORKSPACE + os.sep)
    except (OSError, ValueError):
        return True


def distributions():
    """Installed distributions visible to the code, first on the path wins."""
    seen = {}
    # Not the workspace (sys.path[0]): what the code put there is no installed package, and a
    # FIFO named like metadata would hang the listing.
    path = [p for p in sys.path if p not in ("", ".", WORKSPACE)]
    for dist in stdlib("importlib.metadata").distributions(path=path):
        name = dist.metadata["Name"] or ""
        key = name.lower().replace("_", "-").replace(".", "-")
        if key and key not in seen:
            seen[key] = {"name": name, "version": dist.version}
    return sorted(seen.values(), key=lambda d: d["name"].lower())


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


class Requests:
    """The requests the reader thread takes for the main loop, first in first out (queue's
    Queue without loading queue and _queue before the hello)."""

    def __init__(self):
        self.items = collections.deque()
        self.ready = threading.Condition(threading.Lock())

    def put(self, msg):
        with self.ready:
            self.items.append(msg)
            self.ready.notify()

    def get(self):
        with self.ready:
            while not self.items:
                self.ready.wait()
            return self.items.popleft()


def clean(text, limit=MAX_TEXT):
    """Text safe for JSON and for the server's UTF-8 decoder, capped."""
    if len(text) > limit:
        text = text[:limit] + "... [%d characters truncated]" % (len(text) - limit)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Channel:
    """Sends events to the forwarder, which alone writes the event stream."""

    def __init__(self, fd):
        self.fd = fd
        self.lock = threading.Lock()

    def send(self, event):
        data = (json.dumps(event, separators=(",", ":")) + "\n").encode("utf-8")
        with self.lock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]


class KeptFd:
    """An fd of the agent's that the code, sharing the process, may close or reuse: checked
    to be the file it was (fstat) before each use, so a number the code took over is never
    read; None from then on."""

    def __init__(self, fd):
        st = os.fstat(fd)
        self.kept = (fd, (st.st_dev, st.st_ino))

    def fd(self):
        if self.kept is None:
            return None
        try:
            st = os.fstat(self.kept[0])
            if (st.st_dev, st.st_ino) == self.kept[1]:
                return self.kept[0]
        except OSError:
            pass
        self.kept = None
        return None


def write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class Forwarder:
    """Makes the event stream of the agent's own messages and the code's stdout and stderr.

    Output is tagged with the id of the run that was current when it arrived, and everything
    the code wrote before a message was sent goes out before that message. It lives in a
    process of its own (the agent's fork, or the keeper that forked the agent: `keep`), so
    output the code wrote just before killing the interpreter (os._exit, a fatal signal, the
    OOM killer) still reaches the server: when the agent's message pipe closes, the output
    pipes are drained and only then does the stream end.
    """

    def __init__(self, msg_r, streams, took_w):
        self.msg_r = msg_r
        self.streams = streams
        # A byte for every done taken, to the agent, which starts no run before it has it.
        self.took_w = took_w
        for fd in list(streams) + [msg_r, took_w]:
            os.set_blocking(fd, False)
        self.run_id = None
        self.pending = b""

    def forward(self, fd):
        """An event line of what the code's pipe FD holds now: None when nothing is there,
        b"" when it ended."""
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return None
        if not data:
            return b""
        event = {"ev": "out", "id": self.run_id, "s": self.streams[fd]}
        try:
            event["t"] = data.decode("utf-8")
        except UnicodeDecodeError:
            # Invalid UTF-8, or a character split by the chunk boundary: the bytes travel as
            # base64 and the server reassembles the stream byte for byte.
            event["b"] = b64(data)
        return (json.dumps(event, separators=(",", ":")) + "\n").encode("utf-8")

    def drain(self):
        """Event lines of what the code's pipes hold now."""
        lines = []
        # Bounded, so a background process that never stops printing cannot stall us.
        for _ in range(64):
            got = [line for line in [self.forward(fd) for fd in self.streams] if line]
            if not got:
                break
            lines += got
        return lines

    def messages(self):
        """Event lines for what the message pipe holds now; None once the agent is gone."""
        try:
            chunk = os.read(self.msg_r, 1 << 20)
        except BlockingIOError:
            return []
        if chunk == b"":
            return None
        self.pending += chunk
        lines = []
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            if line.startswith(b'{"ev":"file","id":'):
                kind = "file"  # a piece of an archive, up to megabytes: not parsed again
            else:
                try:
                    kind = json.loads(line).get("ev")
                except ValueError:
                    continue
            if kind == "begin":
                self.run_id = json.loads(line).get("id")
                continue
            if kind != "ack":
                # Everything the code wrote before this message was sent goes out first.
                # Not before an ack: the begin right behind it may not have been read yet,
                # and the run's first output would go out without its id.
                lines += self.drain()
            lines.append(line + b"\n")
            if kind == "done":
                self.run_id = None
                try:
                    os.write(self.took_w, b"d")
                except OSError:
                    pass  # the agent is gone, or its pipe full of bytes it never waited for
        return lines


def forwarder(events_fd, msg_r, streams, took_w):
    """Body of the forwarder process the agent forks when it runs without a keeper of its
    own making (the protocol tests; `keep` below is the sandbox's): the event stream's only
    writer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fw = Forwarder(msg_r, streams, took_w)
    while True:
        readable, _, _ = select.select([msg_r] + list(streams), [], [])
        if msg_r in readable:
            lines = fw.messages()
            if lines is None:
                write_all(events_fd, b"".join(fw.drain()))
                os._exit(0)
            write_all(events_fd, b"".join(lines))
        for fd in streams:
            if fd in readable:
                write_all(events_fd, fw.forward(fd) or b"")


class KeptSource:
    """What the keeper serves (keeper.py `serve`): the event stream the forwarder makes
    (kind `1`) and the agent's own diagnostics (kind `2`)."""

    def __init__(self, fw, diag_r):
        self.fw = fw
        self.diag_r = diag_r
        os.set_blocking(diag_r, False)
        self.open = [fw.msg_r, diag_r] + list(fw.streams)

    def fds(self):
        # A copy: the keeper iterates it while reads close pipes.
        return list(self.open)

    def read(self, fd):
        if fd not in self.open:
            # Ended meanwhile: the agent's end drained it already.
            return ()
        if fd == self.diag_r:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                return ()
            if not data:
                self.open.remove(fd)
            return ((b"2", data),) if data else ()
        if fd == self.fw.msg_r:
            lines = self.fw.messages()
            if lines is None:
                # The agent is gone: the code's last output, then the end (pipes a child of
                # the code still holds are not waited for).
                lines = self.fw.drain()
                self.open = []
            return [(b"1", line) for line in lines]
        line = self.fw.forward(fd)
        if line == b"":
            self.open.remove(fd)
        return ((b"1", line),) if line else ()

    def done(self):
        return not self.open


def load_keeper():
    """keeper.py, beside this file, as a module of its own (not importable by the code)."""
    # Imported from its directory, then out of sys.path and sys.modules again (as agent.py
    # itself, keeper.py BOOT): the compiled file the image made is used; importlib.util
    # would cost a new session's start ~6 ms.
    sys.path.insert(0, os.path.dirname(AGENT_FILE))
    try:
        sys.modules.pop("keeper", None)
        import keeper
    finally:
        del sys.path[0]
        sys.modules.pop("keeper", None)
    return keeper


def keep(ready, sock_path):
    """The agent as its own keeper (docs/design.md D12): this process listens on SOCK_PATH,
    forks the interpreter, and serves relays the event stream its forwarder makes. So a
    session idles as one interpreter and its fork, which share what was loaded before it.
    Returns only in the forked interpreter: the pipes its Agent writes."""
    # A session of its own, and nothing open but the ready pipe, as keeper.py's start_keeper
    # leaves its keeper (the relay starts us without either).
    try:
        os.setsid()
    except OSError:
        pass
    os.closerange(3, ready)
    os.closerange(ready + 1, 65536)
    keeper = load_keeper()
    listener = keeper.listen(sock_path)
    in_r, in_w = os.pipe()
    diag_r, diag_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    msg_r, msg_w = os.pipe()
    took_r, took_w = os.pipe()
    # Objects that exist now are never scanned by the collector again, so neither process
    # writes to their pages and they stay shared after the fork.
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            os.dup2(in_r, 0)
            os.dup2(diag_w, 2)
            for fd in (in_r, in_w, diag_r, diag_w, out_r, err_r, msg_r, took_w, ready):
                os.close(fd)
            # The code sees the command line of an agent, not the keeper's.
            sys.argv[:] = [AGENT_FILE]
        except BaseException:
            os._exit(127)
        return out_w, err_w, msg_w, took_r
    try:
        for fd in (in_r, diag_w, out_w, err_w, msg_w, took_r):
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.write(ready, b"1")
        os.close(ready)
        streams = {out_r: "stdout", err_r: "stderr"}
        source = KeptSource(Forwarder(msg_r, streams, took_w), diag_r)
        keeper.serve(sock_path, listener, source, pid, in_w)
    finally:
        os._exit(1)


def format_exception(exc, compiling=False):
    """Traceback of a user exception without the agent's own frames. A cell that does not
    compile has no frames of its own: the parser's (ast.py) would only mislead."""
    try:
        # Loaded at the first error, not before every session's hello (~7 ms).
        traceback = stdlib("traceback")
        te = traceback.TracebackException.from_exception(exc, capture_locals=False)
        te.stack = traceback.StackSummary.from_list(
            [] if compiling else [frame for frame in te.stack if frame.filename != AGENT_FILE]
        )
        text = "".join(te.format())
    except Exception:
        # Formatting failed (memory, a broken exception): the error is still said.
        text = "%s (its traceback could not be formatted)\n" % type(exc).__name__
    return {
        "type": type(exc).__name__,
        "message": clean(str(exc), 4096),
        "traceback": clean(text),
    }


class ProcSelf:
    """The interpreter's own /proc files behind each run's peak memory, opened once: opening
    one costs 0.1-0.4 ms in a container (most of a warm run), a read or write on an open fd a
    few microseconds. The code shares the process and may close or reuse any fd number, so
    each fd is checked to be the file it was (fstat) before every use and opened again when
    not: a number the code took over is never read or written, nor closed (it is the code's)."""

    def __init__(self):
        self.open = {}  # name: KeptFd

    def fd(self, name, flags):
        kept = self.open.get(name)
        fd = kept.fd() if kept is not None else None
        if fd is None:
            fd = os.open("/proc/self/" + name, flags | os.O_CLOEXEC)
            self.open[name] = KeptFd(fd)
        return fd

    def peak_kb(self):
        """Peak resident memory of the agent since the last reset, in KiB (0: unknown)."""
        try:
            status = os.pread(self.fd("status", os.O_RDONLY), 16384, 0)
            at = status.index(b"VmHWM:") + 6
            return int(status[at:status.index(b"kB", at)])
        except (OSError, ValueError):
            return 0

    def reset_peak(self):
        """Writing 5 to clear_refs resets VmHWM (Linux >= 4.0), so each run gets its own peak."""
        try:
            os.write(self.fd("clear_refs", os.O_WRONLY), b"5")
        except OSError:
            pass


def cpu_seconds():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ToolError(Exception):
    """A bridged tool call failed: the tool reported an error, or the server refused or
    could not make the call (not on the allow-list, budget spent, too large, timed out)."""


class ToolBridge:
    """Code mode: calls of upstream MCP tools, sent to the server as `tool_call` events and
    answered by `tool_result` requests. The server decides everything; this only waits."""

    def __init__(self, agent):
        self.agent = agent
        self.lock = threading.Lock()
        self.next_call = 0
        self.waiting = {}
        self.catalogue = None  # (run id, tools, unavailable)

    def deliver(self, msg):
        with self.lock:
            slot = self.waiting.get(msg.get("call"))
        if slot is not None:
            slot[1] = msg
            slot[0].set()

    def request(self, op, tool=None, args=None):
        with self.agent.state_lock:
            run_id = self.agent.current
        if run_id is None:
            raise ToolError("tools can be called only while a run is going")
        event = threading.Event()
        with self.lock:
            self.next_call += 1
            call = self.next_call
            slot = [event, None]
            self.waiting[call] = slot
        try:
            msg = {"ev": "tool_call", "id": run_id, "call": call, "op": op}
            if tool is not None:
                msg["tool"] = tool
                msg["args"] = args or {}
            self.agent.channel.send(msg)
            while not event.wait(1.0):
                pass
        finally:
            with self.lock:
                self.waiting.pop(call, None)
        reply = slot[1] or {}
        if reply.get("error") is not None or "result" not in reply:
            raise ToolError(str(reply.get("error") or "no answer"))
        return reply["result"]

    def tools(self):
        with self.agent.state_lock:
            run_id = self.agent.current
        if self.catalogue is None or self.catalogue[0] != run_id:
            listing = self.request("list") or {}
            self.catalogue = (run_id, listing.get("tools") or [], listing.get("unavailable") or [])
        return self.catalogue


JSON_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool", "array": "list", "object": "dict"}


def tool_function(bridge, info):
    """A Python function for one upstream tool, its signature and docstring from its schema."""
    import inspect

    server, name = str(info.get("server")), str(info.get("tool"))
    schema = info.get("input_schema") or {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = [r for r in schema.get("required") or [] if r in props]
    params, lines = [], []
    for key in required + [k for k in props if k not in required]:
        if not (isinstance(key, str) and key.isidentifier()):
            continue
        spec = props.get(key) if isinstance(props.get(key), dict) else {}
        default = inspect.Parameter.empty if key in required else None
        params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default))
        kind = JSON_TYPES.get(spec.get("type"), spec.get("type") or "any")
        text = str(spec.get("description") or "").strip()
        lines.append("    %s (%s%s): %s" % (key, kind, "" if key in required else ", optional", text))
    signature = inspect.Signature(params)

    def call(**kwargs):
        args = {k: v for k, v in kwargs.items() if v is not None}
        return bridge.request("call", "%s.%s" % (server, name), args)

    call.__name__ = call.__qualname__ = name
    call.__signature__ = signature
    doc = str(info.get("description") or "").strip()
    if lines:
        doc += "\n\nArgs:\n" + "\n".join(lines)
    if not info.get("callable", True):
        doc += "\n\nNot callable here: not marked read-only, and the operator has not allowed it by name."
    call.__doc__ = doc + "\n\nReturns the tool's structured content as Python data, or its text; raises tools.ToolError."
    return call


class ToolServer:
    """One upstream server's tools, as attributes."""

    def __init__(self, name, functions):
        self._name = name
        self.__dict__.update(functions)

    def __repr__(self):
        return "<tools.%s: %s>" % (self._name, ", ".join(sorted(k for k in self.__dict__ if not k.startswith("_"))))

    def __getattr__(self, attr):
        raise AttributeError("tools.%s has no tool %r you may call; tools.search() lists them" % (self._name, attr))


def make_tools_module(bridge):
    module = types.ModuleType("tools")
    module.__doc__ = (
        "Upstream MCP tools the operator lets this session call (code mode).\n\n"
        "    import tools\n    tools.search('time')            # what may I call?\n"
        "    help(tools.time.get_current_time)\n    tools.time.get_current_time(timezone='UTC')\n"
    )
    module.ToolError = ToolError

    def servers():
        _, listed, _ = bridge.tools()
        grouped = {}
        for info in listed:
            grouped.setdefault(str(info.get("server")), {})[str(info.get("tool"))] = tool_function(bridge, info)
        return grouped

    def search(query="", limit=20):
        """Tools whose name or description hold every word of `query`: 'server.tool: summary' lines."""
        _, listed, unavailable = bridge.tools()
        words = str(query).lower().split()
        found = []
        for info in listed:
            text = ("%s.%s %s" % (info.get("server"), info.get("tool"), info.get("description") or "")).lower()
            if all(w in text for w in words):
                summary = (str(info.get("description") or "").strip().splitlines() or [""])[0][:120]
                found.append("%s.%s: %s" % (info.get("server"), info.get("tool"), summary))
        for server, why in unavailable:
            found.append("%s: unavailable (%s)" % (server, why))
        return found[:limit]

    def describe(name):
        """The signature, docstring and input schema of 'server.tool'."""
        import inspect

        server, _, tool = str(name).partition(".")
        fn = servers().get(server, {}).get(tool)
        if fn is None:
            raise ToolError("%s is not a tool this session may see; tools.search() lists them" % name)
        return "%s.%s%s\n\n%s" % (server, tool, inspect.signature(fn), fn.__doc__)

    def call(name, **args):
        """Calls 'server.tool' with keyword arguments."""
        return bridge.request("call", str(name), args)

    def module_getattr(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        grouped = servers()
        if attr in grouped:
            return ToolServer(attr, grouped[attr])
        raise AttributeError("no upstream %r this session may call; tools.search() lists what it may" % attr)

    module.search, module.describe, module.call = search, describe, call
    module.servers = lambda: sorted(servers())
    module.__getattr__ = module_getattr
    return module


def fork_forwarder():
    """Forks the forwarder (before any thread exists); returns the write ends of the code's
    stdout and stderr and of the message pipe. The child keeps the real stdout (the event
    stream); the agent keeps only the write end of the message pipe, and the read end of
    the pipe on which the forwarder says it took a done."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    msg_r, msg_w = os.pipe()
    took_r, took_w = os.pipe()
    # Objects that exist now are never scanned by the collector again, so neither process
    # writes to their pages and they stay shared after the fork.
    gc.freeze()
    if os.fork() == 0:
        try:
            gc.disable()
            for fd in (0, out_w, err_w, msg_w, took_r):
                os.close(fd)
            forwarder(1, msg_r, {out_r: "stdout", err_r: "stderr"}, took_w)
        finally:
            os._exit(1)
    for fd in (msg_r, out_r, err_r, took_w):
        os.close(fd)
    return out_w, err_w, msg_w, took_r


class Agent:
    def __init__(self, pipes=None):
        """PIPES: the code's stdout and stderr and the message pipe, write ends, when a
        keeper reads them (`keep`); without, the agent forks a forwarder of its own."""
        self.out_w, self.err_w, msg_w, took_r = pipes or fork_forwarder()
        os.set_blocking(took_r, False)
        self.took = KeptFd(took_r)
        self.owed = 0  # dones sent that the forwarder has not said it took
        # Private, non-inheritable copies (os.dup sets O_CLOEXEC) of the request stream and
        # of stderr for the agent's own diagnostics.
        self.cmd_fd = os.dup(0)
        self.channel = Channel(msg_w)
        self.diag = os.fdopen(os.dup(2), "w", buffering=1)
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        self.proc = ProcSelf()
        self.restore_fds()
        self.requests = Requests()
        self.state_lock = threading.Lock()
        self.current = None
        self.cells = 0
        self.main_ident = threading.get_ident()
        # Source of each function and class a cell defined, by name, for snapshots (Durable).
        self.definitions = {}
        module = types.ModuleType("__main__")
        module.__builtins__ = builtins
        builtins.display = self.display
        sys.modules["__main__"] = module
        self.namespace = module.__dict__
        self.stdout, self.stderr = sys.stdout, sys.stderr
        # Like a REPL: modules in the working directory (the workspace) are importable.
        sys.path.insert(0, "")
        add_site_dirs()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.bridge = ToolBridge(self)
        sys.modules["tools"] = make_tools_module(self.bridge)

    def restore_fds(self):
        """Puts fds 0, 1, 2 back in place, in case the last run closed or moved them."""
        os.dup2(self.devnull, 0)
        os.dup2(self.out_w, 1)
        os.dup2(self.err_w, 2)

    def read_requests(self):
        with os.fdopen(self.cmd_fd, "rb") as stream:
            for line in stream:
                try:
                    msg = json.loads(line)
                except ValueError:
                    print("agent: unreadable request", file=self.diag)
                    continue
                if msg.get("op") == "interrupt":
                    self.interrupt(msg.get("id"))
                elif msg.get("op") == "tool_result":
                    self.bridge.deliver(msg)
                else:
                    self.requests.put(msg)
        self.requests.put({"op": "shutdown"})

    def interrupt(self, run_id):
        with self.state_lock:
            if run_id is not None and run_id == self.current:
                # Aimed at the main thread so that a blocking call there returns EINTR.
                signal.pthread_kill(self.main_ident, signal.SIGINT)

    def serve(self):
        threading.Thread(target=self.read_requests, name="pyberth-requests", daemon=True).start()
        version = "%d.%d.%d" % sys.version_info[:3]
        self.channel.send(
            {"ev": "hello", "protocol": PROTOCOL_VERSION, "python": version, "pid": os.getpid()}
        )
        while True:
            try:
                msg = self.requests.get()
                op = msg.get("op")
                if op != "shutdown":
                    # The main loop is free and took the request: said first, so the server
                    # knows no earlier run's code still holds the interpreter.
                    self.channel.send({"ev": "ack", "id": msg.get("id")})
                if op == "run":
                    self.run(msg)
                elif op == "vars":
                    self.channel.send({"ev": "vars", "id": msg.get("id"), "vars": self.variables()})
                elif op in ("write", "read", "list", "delete", "pack"):
                    try:
                        reply = getattr(self, "file_" + op)(msg)
                        reply.update({"ev": "file", "id": msg.get("id")})
                    except (PathError, OSError, ValueError) as exc:
                        message = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                        reply = {"ev": "failed", "id": msg.get("id"), "message": clean(message, 500)}
                    self.channel.send(reply)
                elif op == "attach":
                    missing = attach_layers(msg.get("paths"))
                    self.channel.send({"ev": "attached", "id": msg.get("id"), "missing": missing})
                elif op == "packages":
                    self.channel.send({"ev": "packages", "id": msg.get("id"), "packages": distributions()})
                elif op in ("snapshot", "save_state", "restore"):
                    Durable(self).serve(msg)
                elif op == "shutdown":
                    return
                else:
                    self.channel.send({"ev": "failed", "id": msg.get("id"), "message": "unknown op"})
            except KeyboardInterrupt:
                # An interrupt that raced the end of a run: the run has already answered.
                continue

    def run(self, msg):
        run_id = msg.get("id")
        code = msg.get("code", "")
        self.settle()
        self.channel.send({"ev": "begin", "id": run_id})
        self.restore_fds()
        started = time.monotonic()
        cpu_start = cpu_seconds()
        self.proc.reset_peak()
        children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        # Environment for this run only; the previous values come back afterwards.
        saved = {k: os.environ.get(k) for k in msg.get("env") or {}}
        os.environ.update(msg.get("env") or {})
        with self.state_lock:
            self.current = run_id
        try:
            if msg.get("cmd"):
                outcome = self.execute_command([str(a) for a in msg["cmd"]], msg["cmd"][0])
            elif msg.get("file") is not None:
                outcome = self.execute_file(msg["file"], msg.get("args") or [])
            else:
                outcome = self.execute(code)
        except KeyboardInterrupt:
            outcome = {"status": "interrupted", "error": None}
        finally:
            with self.state_lock:
                self.current = None
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.send_figures(run_id)
        # From here on no interrupt is sent for this run; flush what the code left buffered.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        sys.stdout, sys.stderr = self.stdout, self.stderr
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        outcome.update(
            {
                "ev": "done",
                "id": run_id,
                "wall_ms": (time.monotonic() - started) * 1000.0,
                "cpu_ms": (cpu_seconds() - cpu_start) * 1000.0,
                "peak_kb": self.run_peak_kb(children_peak),
            }
        )
        self.channel.send(outcome)
        self.owed += 1

    def settle(self):
        """Waits until the forwarder has taken every done sent (docs/agent-protocol.md §6):
        it drains the output pipes at a done, so this run's first output written before then
        would go out under the previous run's id. Bounded: code that steals the forwarder's
        bytes or its fd only delays its own next run."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while self.owed > 0:
            fd = self.took.fd()
            if fd is None:
                break
            try:
                got = os.read(fd, 64)
            except BlockingIOError:
                left = deadline - time.monotonic()
                try:
                    if left <= 0 or not select.select([fd], [], [], left)[0]:
                        break
                except KeyboardInterrupt:
                    pass  # an interrupt that raced the end of the last run: not this one's
                except OSError:
                    break
                continue
            except KeyboardInterrupt:
                continue
            except OSError:
                break
            if not got:
                self.owed = 0  # the forwarder is gone: so is the stream
                break
            self.owed = max(0, self.owed - len(got))

    def run_peak_kb(self, children_before):
        """The run's peak memory: the interpreter's, or a child's if one peaked higher during
        the run (children's peaks are known only once they have been waited for)."""
        peak = self.proc.peak_kb()
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if children > children_before:
            peak = max(peak, children)
        return peak

    def execute_file(self, rel, args):
        """Runs a workspace script as __main__ in a fresh interpreter process."""
        try:
            path = workspace_path(rel)
        except PathError as exc:
            return {"status": "error", "error": {"type": "FileNotFoundError", "message": str(exc), "traceback": ""}}
        return self.execute_command([sys.executable, "-u", "-B", path] + [str(a) for a in args], rel)

    def execute_command(self, argv, label):
        """Runs a process in the workspace; its exit status is the run's (128+N for signal N)."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            try:
                proc = stdlib("subprocess").Popen(argv, cwd=WORKSPACE)
            except OSError as exc:
                # The shell's conventions: 127 not found, 126 found but not runnable.
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                message = "cannot run %s: %s" % (label, exc.strerror or exc)
                return {"status": "error", "exit_code": code, "error": {"type": type(exc).__name__, "message": message, "traceback": ""}}
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                # Pass the interrupt on; the server kills everything if it is ignored.
                proc.send_signal(signal.SIGINT)
                proc.wait()
                return {"status": "interrupted", "error": None}
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if code == 0:
            return {"status": "ok", "error": None, "exit_code": 0}
        message = "%s exited with status %d" % (label, code)
        if code < 0:
            message = "%s was killed by signal %d" % (label, -code)
            code = 128 - code
        return {"status": "error", "exit_code": code, "error": {"type": "ExitStatus", "message": message, "traceback": ""}}

    def send_figures(self, run_id):
        """Sends every open matplotlib figure as a PNG, then closes them."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            numbers = pyplot.get_fignums()
            for n in numbers[:MAX_IMAGES]:
                buf = io.BytesIO()
                pyplot.figure(n).savefig(buf, format="png")
                self.send_image(run_id, buf.getvalue())
            if len(numbers) > MAX_IMAGES:
                self.send_notice(run_id, "%d figures not returned (limit %d per run)" % (len(numbers) - MAX_IMAGES, MAX_IMAGES))
            pyplot.close("all")
        except Exception as exc:  # a broken figure is reported, never fatal
            self.send_notice(run_id, "figures could not be rendered: %s" % clean(repr(exc), 300))

    def send_image(self, run_id, png):
        count = getattr(self, "image_count", None)
        sent = count[1] if count and count[0] == run_id else 0
        if sent >= MAX_RUN_IMAGES:
            if sent == MAX_RUN_IMAGES:
                self.send_notice(run_id, "more than %d images in one run: the rest are not returned" % MAX_RUN_IMAGES)
                self.image_count = (run_id, sent + 1)
            return
        self.image_count = (run_id, sent + 1)
        if len(png) > MAX_IMAGE_BYTES:
            self.send_notice(run_id, "an image of %d bytes was not returned (limit %d)" % (len(png), MAX_IMAGE_BYTES))
            return
        self.channel.send({"ev": "image", "id": run_id, "mime": "image/png", "b": b64(png)})

    def send_notice(self, run_id, text):
        self.channel.send({"ev": "notice", "id": run_id, "text": text})

    def display(self, *objects):
        """Shows objects as images in the run's result: matplotlib figures and anything with
        _repr_png_ (PIL images and the like); others are printed."""
        run_id = self.current
        for obj in objects:
            png = None
            if hasattr(obj, "savefig"):
                buf = io.BytesIO()
                obj.savefig(buf, format="png")
                png = buf.getvalue()
            elif hasattr(obj, "_repr_png_"):
                png = obj._repr_png_()
            if png:
                self.send_image(run_id, png)
            else:
                print(repr(obj))

    def file_write(self, msg):
        rel = msg["path"]
        parent = workspace_path(os.path.dirname(rel) or ".", must_exist=False)
        os.makedirs(parent, exist_ok=True)
        workspace_path(os.path.dirname(rel) or ".")  # the parent, once made, is still inside
        full = os.path.join(parent, os.path.basename(rel))
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if msg.get("append") else os.O_TRUNC)
        data = binascii.a2b_base64(msg.get("b", ""))
        fd = open_regular(full, rel, flags)
        try:
            write_all(fd, data)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return {"size": size}

    def file_read(self, msg):
        full = workspace_path(msg["path"])
        fd = open_regular(full, msg["path"], os.O_RDONLY)
        try:
            st = os.fstat(fd)
            offset = max(0, int(msg.get("offset") or 0))
            os.lseek(fd, offset, os.SEEK_SET)
            want = int(msg.get("length"))
            chunks = []
            while want > 0:
                data = os.read(fd, min(want, 1 << 20))
                if not data:
                    break
                chunks.append(data)
                want -= len(data)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        return {"size": st.st_size, "b": b64(data)}

    def file_list(self, msg):
        root = workspace_path(msg.get("path") or ".")
        if not os.path.isdir(root):
            raise PathError("%s is not a directory" % msg.get("path"))
        limit = int(msg.get("limit") or 1000)
        entries = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                st = os.lstat(full)
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
                entries.append({
                    "path": os.path.relpath(full, WORKSPACE),
                    "size": st.st_size,
                    "allocated": st.st_blocks * 512,
                    "kind": kind,
                })
                if len(entries) >= limit:
                    return {"entries": entries, "truncated": True}
            if not msg.get("recursive"):
                break
        return {"entries": entries, "truncated": False}

    def file_delete(self, msg):
        rel = msg["path"]
        parent = workspace_path(os.path.dirname(rel) or ".")
        full = os.path.join(parent, os.path.basename(rel))
        if full == WORKSPACE:
            raise PathError("the workspace itself cannot be deleted")
        if os.path.isdir(full) and not os.path.islink(full):
            import shutil

            shutil.rmtree(full)
        else:
            os.unlink(full)
        return {"size": 0}

    def file_pack(self, msg):
        """Packs a workspace file or directory as a tar, streamed as `file` events with
        `more`. Everything is opened as the code's uid, relative to a directory fd: the parents
        of the path are resolved and must stay inside the workspace, the path itself and
        everything below are never followed, links stay links (the server drops them), and
        FIFOs, sockets and devices are left out."""
        rel = msg.get("path") or "."
        limits = {
            "bytes": msg.get("max_bytes"),
            "entries": int(msg.get("max_entries") or 100000),
            "newer": msg.get("newer"),
            "seen": 0,
            "size": 0,
        }
        tarfile = stdlib("tarfile")
        if rel == ".":
            dir_fd, name = os.open(WORKSPACE, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), None
        else:
            parent = workspace_path(os.path.dirname(rel) or ".")
            dir_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            name = os.path.basename(rel)
        sink = PackSink(self.channel, msg.get("id"))
        try:
            tar = tarfile.open(fileobj=sink, mode="w|", format=tarfile.GNU_FORMAT)
            if name is None:
                self.pack_dir(tarfile, tar, dir_fd, "", limits)
            else:
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    raise PathError("%s does not exist" % rel)
                if stat.S_ISLNK(st.st_mode):
                    raise PathError("%s is a symbolic link: links are never followed" % rel)
                self.pack_one(tarfile, tar, dir_fd, name, rel, st, limits)
            tar.close()
            sink.close()
        except ValueError:
            # Over a bound (raised before the entry over it was added): the archive of what
            # was packed goes out whole first, so the server's own bounds on what it reads
            # (and their messages) come first.
            tar.close()
            sink.close()
            raise
        finally:
            os.close(dir_fd)
        return {"size": limits["size"]}

    def pack_dir(self, tarfile, tar, dir_fd, arcname, limits):
        for name in sorted(os.listdir(dir_fd)):
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            self.pack_one(tarfile, tar, dir_fd, name, arcname + "/" + name if arcname else name, st, limits)

    def pack_one(self, tarfile, tar, dir_fd, name, arcname, st, limits):
        if arcname.count("/") + 1 > MAX_DEPTH:
            raise ValueError("%s is nested more than %d directories deep" % (arcname, MAX_DEPTH))
        mode = st.st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            return
        if stat.S_ISREG(mode) and limits["newer"] is not None and int(st.st_mtime) < limits["newer"]:
            return
        limits["seen"] += 1
        if limits["seen"] > limits["entries"]:
            raise ValueError("more than %d entries to pack" % limits["entries"])
        try:
            linkname = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(mode) else ""
        except OSError:
            return  # removed or replaced meanwhile
        self.pack_cost(limits, tar_cost(arcname, st.st_size if stat.S_ISREG(mode) else 0, linkname))
        info = tarfile.TarInfo(arcname)
        info.mtime = int(st.st_mtime)
        info.mode = stat.S_IMODE(st.st_mode)
        info.uid, info.gid = st.st_uid, st.st_gid
        if stat.S_ISLNK(mode):
            info.type = tarfile.SYMTYPE
            info.linkname = linkname
            tar.addfile(info)
            return
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        if stat.S_ISDIR(mode):
            flags |= os.O_DIRECTORY
        try:
            fd = os.open(name, flags, dir_fd=dir_fd)
        except (FileNotFoundError, NotADirectoryError):
            return  # removed or replaced meanwhile
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return  # replaced by a link meanwhile: never followed
            raise
        if stat.S_ISDIR(mode):
            try:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                self.pack_dir(tarfile, tar, fd, arcname, limits)
            finally:
                os.close(fd)
            return
        try:
            checked = st
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return  # replaced by something else meanwhile
            if st.st_size > checked.st_size:
                self.pack_cost(limits, tar_cost("", st.st_size) - tar_cost("", checked.st_size))
            info.size = st.st_size
            tar.addfile(info, ExactReader(fd, st.st_size))
        finally:
            os.close(fd)

    @staticmethod
    def pack_cost(limits, cost):
        """Counts an entry's bytes against the archive's bound, before it is added."""
        limits["size"] += cost
        if limits["bytes"] is not None and limits["size"] > limits["bytes"]:
            raise ValueError("the archive would be larger than %d MiB" % (limits["bytes"] >> 20))

    def execute(self, code):
        self.cells += 1
        filename = "<cell %d>" % self.cells
        # Registered so that tracebacks show the user's source lines.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            body = compile(tree, filename, "exec")
            tail = compile(last, filename, "eval") if last is not None else None
        except (SyntaxError, ValueError, OverflowError, RecursionError) as exc:
            return {"status": "error", "error": format_exception(exc, compiling=True)}
        Durable.record(self, tree, code, self.cells)
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            exec(body, self.namespace)
            value = eval(tail, self.namespace) if tail is not None else None
        except KeyboardInterrupt:
            return {"status": "interrupted", "error": None}
        except SystemExit as exc:
            # Notebook semantics: sys.exit() ends the cell, never the session.
            code = exc.code
            ok = code is None or code == 0
            return {
                "status": "ok" if ok else "error",
                "exit_code": code if isinstance(code, int) or code is None else 1,
                "error": None if ok else format_exception(exc),
            }
        except BaseException as exc:
            return {"status": "error", "error": format_exception(exc)}
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        result = None
        if value is not None:
            self.namespace["_"] = value
            try:
                result = clean(repr(value))
            except BaseException as exc:  # a broken __repr__ is the user's error, not ours
                result = "<repr failed: %s>" % clean(type(exc).__name__)
        return {"status": "ok", "result": result, "error": None}

    def variables(self):
        """The user's variables, each repr bounded in size (reprlib) and in time: a repr that
        takes over REPR_SECONDS is interrupted by SIGALRM and shown as unavailable, and once
        the listing has spent VARS_SECONDS the rest are not asked. Everything the code
        defined (names, types, reprs) is touched only while the timer runs."""
        listing = []
        deadline = time.monotonic() + VARS_SECONDS
        shorten = stdlib("reprlib").Repr()
        shorten.maxstring = shorten.maxother = 200
        armed = [False]

        def alarm(signum, frame):
            if armed[0]:
                raise ReprTimeout()

        previous = signal.signal(signal.SIGALRM, alarm)
        try:
            for name, value in list(self.namespace.items()):
                if type(name) is not str or name.startswith("_"):
                    continue
                entry = {"name": clean(name, 200), "type": "?", "repr": "<repr failed>"}
                left = deadline - time.monotonic()
                try:
                    armed[0] = True
                    # Again every 50 ms after the first, for a repr that catches it.
                    signal.setitimer(signal.ITIMER_REAL, max(0.01, min(REPR_SECONDS, left)), 0.05)
                    try:
                        if isinstance(value, types.ModuleType):
                            continue
                        entry["type"] = clean(type(value).__name__, 200)
                        if left > 0:
                            entry["repr"] = clean(shorten.repr(value), 200)
                        else:
                            entry["repr"] = "<unavailable: the listing ran out of time>"
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                        armed[0] = False
                except ReprTimeout:
                    entry["repr"] = "<unavailable: its repr took over %.1f s>" % REPR_SECONDS
                except BaseException:
                    pass  # a broken repr (or type name) is the code's, not ours
                listing.append(entry)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        return listing

SNAPSHOT_VERSION = 1
SNAPSHOT_CHUNK = 4 << 20  # archive bytes per piece of a snapshot: 5.6 MB lines, far below the 16 MiB cap
RESTORE_DIR = ".pyberth-restore"  # where the server puts a snapshot's state for `restore`
SAVE_DIR = ".pyberth-snapshot"  # where `save_state` writes the state for the server's packer
NOTHING_SAVED = "nothing saved"  # what a restore `if_saved` answers when no state is there
MAX_LOST = 1000  # names listed as not saved or not restored


def workspace_bytes(limit):
    """Bytes of the workspace's regular files, counted until past `limit` (links not
    followed)."""
    total = 0
    for root, dirs, files in os.walk(WORKSPACE):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
                if total >= limit:
                    return total
    return total


class NullSink:
    """A file that only counts: pickling into it tells whether a value pickles."""

    def write(self, data):
        return len(data)


class Durable:
    """Snapshots of the interpreter (`snapshot`) and their restoration (`restore`).

    Saved, in this order of restoration: modules bound to names (re-imported by name);
    functions and classes imported from elsewhere (pickled, by reference); the source of
    every function and class a cell defined (pickle stores those by reference to
    `__main__`, so their definitions are executed again before anything is unpickled that
    refers to them); every other global, pickled together so that objects shared between
    names stay shared. What does not pickle (open files, sockets, threads, locks, lambdas,
    closures, objects that refuse) is listed by name with the reason, never dropped silently.
    Standard library `pickle` only: the agent runs on every base image, and a serializer
    imported into the code's interpreter would clash with the code's own copy."""

    def __init__(self, agent):
        self.agent = agent

    @staticmethod
    def record(agent, tree, code, cell):
        """Keeps the source of each function and class the cell defines at its top level
        (also inside if/try/with/for/while), with its decorators, by name."""
        lines = code.splitlines(True)

        def walk(body):
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                    end = getattr(node, "end_lineno", None) or len(lines)
                    source = "".join(lines[first - 1:end])
                    indent = len(source) - len(source.lstrip(" \t"))
                    if indent:
                        source = "".join(line[indent:] if line[:indent].isspace() else line for line in lines[first - 1:end])
                    agent.definitions[node.name] = (cell, first, source)
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        walk(inner)

        try:
            walk(tree.body)
        except Exception:  # never let bookkeeping fail a run
            pass

    def serve(self, msg):
        op = msg.get("op")
        try:
            if op == "snapshot":
                reply = self.snapshot(msg)
                reply.update({"ev": "file", "id": msg.get("id")})
            elif op == "save_state":
                reply = self.save_state(msg)
                reply.update({"ev": "saved", "id": msg.get("id")})
            else:
                reply = self.restore(msg)
                reply.update({"ev": "restored", "id": msg.get("id")})
        except Exception as exc:  # MemoryError included: the agent goes on, the request fails
            if isinstance(exc, OSError) and exc.strerror:
                message = exc.strerror
            elif isinstance(exc, (PathError, ValueError)):
                message = str(exc)
            else:
                message = "%s: %s" % (type(exc).__name__, exc)
            reply = {"ev": "failed", "id": msg.get("id"), "message": clean(message, 500)}
        self.agent.channel.send(reply)

    # -- snapshot --------------------------------------------------------------------------

    def state(self, outs=None):
        """The interpreter's state as (meta, outs): meta says what was saved and lost; the
        pickles go into `outs` (file objects by name; in memory when not given)."""
        pickle = stdlib("pickle")
        namespace = self.agent.namespace
        modules, defs, imported, values, lost = {}, [], {}, {}, []

        def lose(name, why):
            if len(lost) < MAX_LOST:
                lost.append({"name": clean(name, 200), "why": clean(why, 300)})

        for name, value in list(namespace.items()):
            if type(name) is not str or (name.startswith("__") and name.endswith("__")):
                continue
            if isinstance(value, types.ModuleType):
                modname = getattr(value, "__name__", None)
                if isinstance(modname, str) and sys.modules.get(modname) is value:
                    modules[name] = modname
                else:
                    lose(name, "a module that cannot be imported again by name")
                continue
            is_def = isinstance(value, (type, types.FunctionType))
            module = getattr(value, "__module__", None) if is_def else None
            if is_def and module == "__main__":
                qual = getattr(value, "__qualname__", "")
                known = self.agent.definitions.get(name)
                if qual == "<lambda>":
                    lose(name, "a lambda: its source is not kept; define it with def to keep it")
                elif qual != name or known is None:
                    lose(name, "defined inside other code (%s): only top-level definitions of cells are kept" % qual)
                else:
                    defs.append((known[0], known[1], name, known[2]))
                continue
            if is_def or isinstance(value, (types.BuiltinFunctionType,)):
                imported[name] = value
            else:
                values[name] = value

        def dump(group, kind, out):
            """Pickles a group whole into `out`; when that fails, finds and lists the names
            that refuse, and pickles the rest."""
            def whole(group):
                out.seek(0)
                out.truncate()
                pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(group)

            try:
                return whole(group)
            except Exception:
                pass
            kept = {}
            for name, value in group.items():
                try:
                    pickle.Pickler(NullSink(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
                    kept[name] = value
                except Exception as exc:
                    lose(name, "%s: %s" % (type(exc).__name__, str(exc)[:200]))
            try:
                return whole(kept)
            except Exception as exc:  # the group fails though each name alone pickles
                for name in kept:
                    lose(name, "%s could not be saved together: %s" % (kind, str(exc)[:200]))
                return whole({})

        outs = outs or {"imported.pkl": io.BytesIO(), "values.pkl": io.BytesIO()}
        dump(imported, "imported names", outs["imported.pkl"])
        dump(values, "variables", outs["values.pkl"])
        defs.sort()
        lost_names = {entry["name"] for entry in lost}
        saved = sorted(set(modules) | {d[2] for d in defs} | (set(imported) | set(values)) - lost_names)
        meta = {
            "version": SNAPSHOT_VERSION,
            "python": "%d.%d.%d" % sys.version_info[:3],
            "cells": self.agent.cells,
            "modules": modules,
            "defs": [[cell, line, name, source] for cell, line, name, source in defs],
            "saved": saved,
            "lost": lost,
        }
        return meta, outs

    def snapshot(self, msg):
        """A tar of the state (state/meta.json first, then the pickles) and of the whole
        workspace (workspace/...), packed as `pack` packs, sent as `file` pieces."""
        tarfile = stdlib("tarfile")
        limits = {
            "bytes": msg.get("max_bytes"),
            "entries": int(msg.get("max_entries") or 100000),
            "newer": None,
            "seen": 0,
            "size": 0,
        }
        meta, outs = self.state()
        blobs = [(name, f.getvalue()) for name, f in sorted(outs.items())]
        outs = None
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode("utf-8")
        sink = PackSink(self.agent.channel, msg.get("id"))
        sink.chunk = SNAPSHOT_CHUNK
        dir_fd = os.open(WORKSPACE, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        tar = tarfile.open(fileobj=sink, mode="w|", format=tarfile.GNU_FORMAT)
        try:
            now = int(time.time())
            for name, data in [("meta.json", meta_bytes)] + blobs:
                Agent.pack_cost(limits, tar_cost("state/" + name, len(data)))
                info = tarfile.TarInfo("state/" + name)
                info.size, info.mtime, info.mode = len(data), now, 0o600
                tar.addfile(info, io.BytesIO(data))
            blobs = None  # the pickles may be large: freed before the workspace is packed
            info = tarfile.TarInfo("workspace")
            info.type, info.mtime, info.mode = tarfile.DIRTYPE, now, 0o755
            tar.addfile(info)
            self.agent.pack_dir(tarfile, tar, dir_fd, "workspace", limits)
        finally:
            os.close(dir_fd)
            tar.close()
            sink.close()
        return {"size": limits["size"]}

    def save_state(self, msg):
        """Writes the state into SAVE_DIR of the workspace (meta.json last), for the server's
        packer container to copy from the workspace volume into the snapshot's, volume to
        volume, as this uid: the bytes never cross the agent's stream. Answers what was saved
        and lost. The server deletes the directory when its packer is done."""
        shutil = stdlib("shutil")
        # `into: restore`: the keeper's save for a next server, which restores it in place.
        base = os.path.join(WORKSPACE, RESTORE_DIR if msg.get("into") == "restore" else SAVE_DIR)
        if os.path.lexists(base):
            if os.path.isdir(base) and not os.path.islink(base):
                shutil.rmtree(base)
            else:
                os.unlink(base)
        os.mkdir(base, 0o700)
        dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            outs = {}
            try:
                for name in ("imported.pkl", "values.pkl"):
                    outs[name] = os.fdopen(os.open(name, flags, 0o600, dir_fd=dir_fd), "w+b", buffering=1 << 20)
                meta, outs = self.state(outs)
                size = 0
                for f in outs.values():
                    f.flush()
                    size += f.tell()
            finally:
                for f in outs.values():
                    f.close()
            meta_bytes = json.dumps(meta, separators=(",", ":")).encode("utf-8")
            limit = msg.get("max_bytes")
            if limit is not None and size + len(meta_bytes) > int(limit):
                raise ValueError("the snapshot would be larger than %d bytes" % int(limit))
            with os.fdopen(os.open("meta.json", flags, 0o600, dir_fd=dir_fd), "wb") as f:
                f.write(meta_bytes)
        except BaseException:
            shutil.rmtree(base, ignore_errors=True)
            raise
        finally:
            os.close(dir_fd)
        size += len(meta_bytes)
        reply = {"saved": meta["saved"][:MAX_LOST], "lost": meta["lost"], "size": size}
        small = msg.get("small_below")
        if small is not None and size + workspace_bytes(int(small) - size) < int(small):
            # Small enough for the stream, which costs no container: said, and not kept.
            shutil.rmtree(base, ignore_errors=True)
            reply["small"] = True
        return reply

    # -- restore ---------------------------------------------------------------------------

    def restore(self, msg):
        """Restores the state the server unpacked into RESTORE_DIR, then removes it: modules,
        imported names, definitions (again after the variables when they needed one), then
        the variables. Answers what came back and what did not, with why."""
        pickle = stdlib("pickle")
        shutil = stdlib("shutil")
        namespace = self.agent.namespace
        if msg.get("if_saved") and not os.path.lexists(os.path.join(WORKSPACE, RESTORE_DIR)):
            raise ValueError(NOTHING_SAVED)
        base = workspace_path(RESTORE_DIR)
        restored, lost = [], []

        def lose(name, why):
            if len(lost) < MAX_LOST:
                lost.append({"name": clean(str(name), 200), "why": clean(why, 300)})

        def read(name):
            """The file, open (it stays readable once the directory is removed)."""
            rel = RESTORE_DIR + "/" + name
            fd = open_regular(workspace_path(rel), rel, os.O_RDONLY)
            return os.fdopen(fd, "rb", buffering=1 << 20)

        opened = []
        try:
            with read("meta.json") as f:
                meta = json.loads(f.read().decode("utf-8"))
            if not isinstance(meta, dict) or meta.get("version") != SNAPSHOT_VERSION:
                raise ValueError("the snapshot's state is of an unknown version")
            imported_blob = read("imported.pkl")
            opened.append(imported_blob)
            values_blob = read("values.pkl")
            opened.append(values_blob)
        except BaseException:
            for f in opened:
                f.close()
            raise
        finally:
            shutil.rmtree(base, ignore_errors=True)
        try:
            return self.load_state(namespace, meta, imported_blob, values_blob, restored, lost, lose)
        finally:
            for f in opened:
                f.close()

    def load_state(self, namespace, meta, imported_blob, values_blob, restored, lost, lose):
        """Loads the state (the pickles as open files: pickle reads large buffers straight
        into the objects they make, no copy of the whole file in memory)."""
        pickle = stdlib("pickle")
        for name, modname in sorted((meta.get("modules") or {}).items()):
            try:
                namespace[name] = stdlib("importlib").import_module(modname)
                restored.append(name)
            except BaseException as exc:
                lose(name, "import %s failed: %s: %s" % (modname, type(exc).__name__, str(exc)[:200]))

        def load(blob, kind):
            try:
                blob.seek(0)
                group = pickle.load(blob)
                if not isinstance(group, dict):
                    raise ValueError("not a mapping")
                return group, None
            except BaseException as exc:
                return None, "%s could not be unpickled: %s: %s" % (kind, type(exc).__name__, str(exc)[:200])

        imported, why = load(imported_blob, "imported names")
        if imported is None:
            raise ValueError("the snapshot's state is damaged (%s)" % why)
        for name, value in imported.items():
            namespace[name] = value
            restored.append(name)
        cells = int(meta.get("cells") or 0)
        pending = []
        for entry in meta.get("defs") or []:
            pending.append(entry)
        waiting = []

        def define(entry):
            cell, line, name, source = entry
            filename = "<cell %d>" % int(cell)
            padded = "\n" * (int(line) - 1) + source
            linecache.cache[filename] = (len(padded), None, padded.splitlines(True), filename)
            exec(compile(padded, filename, "exec"), namespace)

        for entry in pending:
            try:
                define(entry)
                restored.append(entry[2])
                self.agent.definitions[entry[2]] = (entry[0], entry[1], entry[3])
            except BaseException as exc:
                waiting.append((entry, exc))
        values, why = load(values_blob, "variables")
        if values is None and not waiting:
            raise ValueError("the snapshot's state is damaged (%s)" % why)
        retry = []
        for entry, _ in waiting:
            try:
                if values is not None:
                    namespace.update(values)
                define(entry)
                restored.append(entry[2])
                self.agent.definitions[entry[2]] = (entry[0], entry[1], entry[3])
            except BaseException as exc:
                retry.append(entry)
                lose(entry[2], "its definition failed again: %s: %s" % (type(exc).__name__, str(exc)[:200]))
        if values is None and waiting:
            values, why = load(values_blob, "variables")
        if values is None:
            for name in meta.get("saved") or []:
                if name not in namespace:
                    lose(name, why)
        else:
            namespace.update(values)
            restored.extend(values)
        for entry in meta.get("lost") or []:
            if isinstance(entry, dict):
                lose(entry.get("name", "?"), "not saved: %s" % entry.get("why", "?"))
        self.agent.cells = max(self.agent.cells, cells)
        return {"restored": sorted(set(str(n) for n in restored))[:MAX_LOST], "lost": lost}


def main(args):
    """`keep READY SOCKET`: started by keeper.py attach, to serve that socket (keeper.py BOOT);
    no arguments: an agent on this process's stdin and stdout."""
    kept = keep(int(args[1]), args[2]) if len(args) == 3 and args[0] == "keep" else None
    Agent(kept).serve()


if __name__ == "__main__":
    main(sys.argv[1:])
