"""pyberth in-sandbox agent.

Started by the server as one long-lived `docker exec` per session. It reads requests as
newline-delimited JSON on its stdin and writes events as newline-delimited JSON on its stdout.
User code never touches those two streams: the agent keeps a private copy of fd 0, points
fd 0 at /dev/null and fds 1 and 2 at pipes. A forwarder process (see `forwarder`) owns the
real stdout and sends whatever arrives on the pipes, so output of child processes is
captured too, and output written just before the interpreter dies is not lost.

Standard library only: the same file runs on every base image.
"""

import ast
import base64
import builtins
import importlib
import importlib.metadata
import json
import linecache
import os
import queue
import select
import signal
import site
import sys
import threading
import time
import traceback
import types

PROTOCOL_VERSION = 1
CHUNK = 65536  # bytes per output event; keeps every line far below the server's line cap
MAX_TEXT = 65536  # cap for repr, tracebacks and variable listings sent back
AGENT_FILE = os.path.abspath(__file__)
# Packages of the session's dependency layer, and those installed into the live session.
LAYER_SITE = "/opt/pyberth/site"
LIVE_SITE = "/opt/pyberth/live/site"


def add_site_dirs():
    """Puts package dirs (with their .pth files) ahead of the system's, live first."""
    for path in (LAYER_SITE, LIVE_SITE):
        if os.path.isdir(path) and path not in sys.path:
            before = list(sys.path)
            site.addsitedir(path)
            added = [p for p in sys.path if p not in before]
            for p in added:
                sys.path.remove(p)
            sys.path[1:1] = added
    importlib.invalidate_caches()


def distributions():
    """Installed distributions visible to the code, first on the path wins."""
    seen = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        key = name.lower().replace("_", "-").replace(".", "-")
        if key and key not in seen:
            seen[key] = {"name": name, "version": dist.version}
    return sorted(seen.values(), key=lambda d: d["name"].lower())


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


def write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def forwarder(events_fd, msg_r, streams):
    """Body of the forwarder process, forked before anything else runs.

    It reads the user's stdout and stderr pipes and the agent's own messages, and is the only
    writer of the event stream. Because it is a separate process, output the code wrote just
    before killing the interpreter (os._exit, a fatal signal, the OOM killer) still reaches
    the server: when the agent's message pipe closes, the forwarder drains the output pipes
    and only then exits, which ends the exec's stream.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for fd in list(streams) + [msg_r]:
        os.set_blocking(fd, False)
    run_id = None
    pending = b""

    def forward(fd):
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return False
        if not data:
            return False
        event = {"ev": "out", "id": run_id, "s": streams[fd]}
        try:
            event["t"] = data.decode("utf-8")
        except UnicodeDecodeError:
            # Invalid UTF-8, or a character split by the chunk boundary: the bytes travel as
            # base64 and the server reassembles the stream byte for byte.
            event["b"] = base64.b64encode(data).decode("ascii")
        write_all(events_fd, (json.dumps(event, separators=(",", ":")) + "\n").encode("utf-8"))
        return True

    def drain():
        # Bounded, so a background process that never stops printing cannot stall us.
        for _ in range(64):
            if not any([forward(fd) for fd in streams]):
                return

    while True:
        readable, _, _ = select.select([msg_r] + list(streams), [], [])
        if msg_r in readable:
            try:
                chunk = os.read(msg_r, 1 << 20)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                drain()
                os._exit(0)
            pending += chunk or b""
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    kind = json.loads(line).get("ev")
                except ValueError:
                    continue
                if kind == "begin":
                    run_id = json.loads(line).get("id")
                    continue
                # Everything the code wrote before this message was sent goes out first.
                drain()
                write_all(events_fd, line + b"\n")
                if kind == "done":
                    run_id = None
        for fd in streams:
            if fd in readable:
                forward(fd)


def format_exception(exc):
    """Traceback of a user exception without the agent's own frames."""
    te = traceback.TracebackException.from_exception(exc, capture_locals=False)
    te.stack = traceback.StackSummary.from_list(
        [frame for frame in te.stack if frame.filename != AGENT_FILE]
    )
    return {
        "type": type(exc).__name__,
        "message": clean(str(exc), 4096),
        "traceback": clean("".join(te.format())),
    }


def cpu_seconds():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Agent:
    def __init__(self):
        self.out_r, self.out_w = os.pipe()
        self.err_r, self.err_w = os.pipe()
        msg_r, msg_w = os.pipe()
        # Fork before any thread exists. The child keeps the real stdout (the event stream);
        # the agent keeps only the write end of the message pipe.
        if os.fork() == 0:
            try:
                for fd in (0, self.out_w, self.err_w, msg_w):
                    os.close(fd)
                forwarder(1, msg_r, {self.out_r: "stdout", self.err_r: "stderr"})
            finally:
                os._exit(1)
        os.close(msg_r)
        os.close(self.out_r)
        os.close(self.err_r)
        # Private, non-inheritable copies (os.dup sets O_CLOEXEC) of the request stream and
        # of stderr for the agent's own diagnostics.
        self.cmd_fd = os.dup(0)
        self.channel = Channel(msg_w)
        self.diag = os.fdopen(os.dup(2), "w", buffering=1)
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        self.restore_fds()
        self.requests = queue.Queue()
        self.state_lock = threading.Lock()
        self.current = None
        self.cells = 0
        self.main_ident = threading.get_ident()
        module = types.ModuleType("__main__")
        module.__builtins__ = builtins
        sys.modules["__main__"] = module
        self.namespace = module.__dict__
        self.stdout, self.stderr = sys.stdout, sys.stderr
        # Like a REPL: modules in the working directory (the workspace) are importable.
        sys.path.insert(0, "")
        add_site_dirs()
        signal.signal(signal.SIGINT, signal.SIG_IGN)

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
                if op == "run":
                    self.run(msg)
                elif op == "vars":
                    self.channel.send({"ev": "vars", "id": msg.get("id"), "vars": self.variables()})
                elif op == "refresh":
                    add_site_dirs()
                    self.channel.send({"ev": "refreshed", "id": msg.get("id")})
                elif op == "packages":
                    self.channel.send({"ev": "packages", "id": msg.get("id"), "packages": distributions()})
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
        self.channel.send({"ev": "begin", "id": run_id})
        self.restore_fds()
        started = time.monotonic()
        cpu_start = cpu_seconds()
        with self.state_lock:
            self.current = run_id
        try:
            outcome = self.execute(code)
        except KeyboardInterrupt:
            outcome = {"status": "interrupted", "error": None}
        finally:
            with self.state_lock:
                self.current = None
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
            }
        )
        self.channel.send(outcome)

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
            return {"status": "error", "error": format_exception(exc)}
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
        listing = []
        for name, value in list(self.namespace.items()):
            if name.startswith("_") or isinstance(value, types.ModuleType):
                continue
            try:
                text = repr(value)
            except BaseException:
                text = "<repr failed>"
            listing.append({"name": name, "type": type(value).__name__, "repr": clean(text, 200)})
        return listing


if __name__ == "__main__":
    Agent().serve()
