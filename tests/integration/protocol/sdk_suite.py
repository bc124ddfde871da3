"""The core suite driven by the official MCP Python SDK (mcp 2.3), which speaks 2026-07-28.

Usage: sdk_suite.py http URL TOKEN LABEL | sdk_suite.py stdio BINARY LABEL (the server's
environment is this process's). Connects with mode "auto" (server/discover, falling back to
initialize only for a legacy server), checks the version the SDK settled on, runs state,
files, a resource read, jobs and snapshots, the per-request log level, and prints
`SDK-SUITE-OK <version>` last. Any failed check raises, and the exit status is non-zero.
"""

import asyncio
import os
import sys

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client


def server_of(argv):
    if argv[1] == "http":
        _, _, url, token, label = argv
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=120)
        return (lambda: streamable_http_client(url, http_client=http)), label
    _, _, binary, label = argv
    params = StdioServerParameters(command=binary, args=["serve"], env=dict(os.environ))
    return (lambda: params), label


async def call(c, tool, args):
    r = await c.call_tool(tool, args)
    return r, (r.structured_content or {})


def check(cond, what):
    if not cond:
        raise AssertionError(what)


async def suite(c, label):
    r, sc = await call(c, "run_python", {"session": "st", "code": "x = 41"})
    check(not r.is_error, f"x = 41: {r}")
    r, sc = await call(c, "run_python", {"session": "st", "code": "x + 1"})
    check(sc.get("result") == "42", f"state kept: {sc}")

    content = f"hello from {label}"
    r, _ = await call(c, "write_file", {"session": "st", "path": "notes/a.txt", "content": content})
    check(not r.is_error, f"write_file: {r}")
    r, sc = await call(c, "read_file", {"session": "st", "path": "notes/a.txt"})
    check(sc.get("content") == content, f"read_file: {sc}")
    r, sc = await call(c, "list_files", {"session": "st", "recursive": True})
    check("a.txt" in str(sc.get("entries")), f"list_files: {sc}")
    read = await c.read_resource("pyberth://sessions/st/files/notes/a.txt")
    check(read.contents[0].text == content, f"resources/read: {read}")

    code = "import time\nprint('started', flush=True)\ntime.sleep(120)"
    r, sc = await call(c, "run_python", {"session": "jb", "code": code, "background": True})
    check(sc.get("status") == "running", f"background: {sc}")
    job, seen = sc["job"], ""
    for _ in range(30):
        r, sc = await call(c, "job_status", {"job": job, "wait_s": 2})
        check(sc.get("status") == "running", f"job_status: {sc}")
        seen += sc.get("stdout", "")
        if "started" in seen:
            break
    check("started" in seen, f"the job's output so far: {seen!r}")
    r, sc = await call(c, "cancel_job", {"job": job})
    check(sc.get("status") == "cancelled", f"cancel_job: {sc}")

    snap = f"snap-{label}"
    r, _ = await call(c, "snapshot_session", {"session": "st", "name": snap})
    check(not r.is_error, f"snapshot_session: {r}")
    r, _ = await call(c, "restore_session", {"snapshot": snap, "session": "st2"})
    check(not r.is_error, f"restore_session: {r}")
    r, sc = await call(c, "run_python", {"session": "st2", "code": "x"})
    check(sc.get("result") == "41", f"restored state: {sc}")


async def main():
    connect, label = server_of(sys.argv)
    heard = []

    async def on_log(params):
        heard.append(params)

    # No level asked: a 2026-07-28 server sends no log message (the SDK does not opt in).
    async with Client(connect(), mode="auto", logging_callback=on_log) as c:
        version = c.protocol_version
        check(version == "2026-07-28", f"the SDK settled on {version}")
        tools = await c.list_tools()
        run = next(t for t in tools.tools if t.name == "run_python")
        check(run.input_schema["properties"]["session"].get("x-mcp-header") == "Session", f"{run.input_schema}")
        await suite(c, label)
        r, sc = await call(c, "run_python", {"session": "st", "code": "print('live-line', flush=True)"})
        check(sc.get("stdout") == "live-line\n", f"{sc}")
        check(heard == [], f"log messages without a level: {heard}")
    # A level of info asked on every request: the output comes as log messages too.
    async with Client(connect(), mode="auto", logging_callback=on_log, log_level="info") as c:
        r, sc = await call(c, "run_python", {"session": "st", "code": "print('live-line', flush=True)"})
        check(not r.is_error, f"{r}")
        for _ in range(50):
            if "live-line" in "".join(str(p.data) for p in heard):
                break
            await asyncio.sleep(0.1)
        said = "".join(p.data.get("text", "") for p in sorted(heard, key=lambda p: p.data.get("seq", 0)))
        check("live-line" in said, f"no log message with level info: {heard}")
    print("SDK-SUITE-OK", version, flush=True)


asyncio.run(main())
