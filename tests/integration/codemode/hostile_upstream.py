"""A hostile upstream MCP server for pyberth's code-mode tests: it hangs, crashes, answers
50 MB, and notes when a call of it is cancelled. Built on the `mcp` package of the test venv."""

import asyncio
import os
import sys

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

RO = ToolAnnotations(read_only_hint=True)
MARKS = os.environ.get("MARKS", "/tmp")
server = MCPServer("hostile", subscriptions=False)


def mark(name):
    with open(os.path.join(MARKS, name), "a") as f:
        f.write("x\n")


@server.tool(name="echo", description="Returns its argument.", annotations=RO)
def echo(text: str) -> str:
    return text


@server.tool(name="hang", description="Never answers; notes its cancellation.", annotations=RO)
async def hang() -> str:
    mark("hang-started")
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        mark("hang-cancelled")
        raise
    return "never"


@server.tool(name="slow", description="Answers after `seconds`; notes its start and cancellation.", annotations=RO)
async def slow(seconds: float) -> str:
    mark("slow-started")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        mark("slow-cancelled")
        raise
    return "slept %s" % seconds


@server.tool(name="crash", description="Kills its own server.", annotations=RO)
def crash() -> str:
    mark("crashed")
    os._exit(3)


@server.tool(name="huge", description="Answers 50 MB.", annotations=RO)
def huge() -> str:
    return "x" * (50 << 20)


@server.tool(name="secret", description="Says whether its token is set, never the token.", annotations=RO)
def secret() -> str:
    return "token set: %s" % bool(os.environ.get("UPSTREAM_TOKEN"))


def serve_http():
    """Streamable HTTP on a port of 127.0.0.1 it picks itself (and prints first, so no other
    test can take it in between), answering only requests that carry the header
    `Authorization: Bearer $EXPECT_TOKEN`."""
    import socket

    import uvicorn

    app = server.streamable_http_app()
    want = ("Bearer " + os.environ["EXPECT_TOKEN"]).encode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != want:
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"no token"})
            return
        await app(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(guarded, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "http":
        serve_http()
    else:
        asyncio.run(server.run_stdio_async())
