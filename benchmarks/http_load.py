"""An HTTP load driver for the benchmarks: a real ``mstar serve`` process, timed from outside.

    with serve_config(config, workdir) as server:              # a config dict -> a live server
        batch = run_chat_streams(server.url, [chat_body(prompt, 128)] * 64)
        batch.throughput, batch.first_token_s(), batch.inter_token_s()
        posts = run_posts(server.url, "/v1/images/generations", [body] * 4)   # non-streaming JSON

``serve_config`` writes the deployment as a YAML file, starts ``python -m mstar.cli serve``
in its own process group (output in ``workdir/server.log``), waits for ``/health`` and stops
the whole group however the block ends.

The client is a few dozen lines over asyncio streams, one connection per request, not
httpx or aiohttp: at 64 streams a general-purpose client costs the benchmark process as
much CPU as the server spends, and on a small machine the two share the cores. Each
streamed request records when its response's events arrive (``perf_counter``): the first
event is the time to first token (the server sends nothing before the first token), and
every event with content after it is a token's arrival. Events that arrive in one read
share its time. The token count is the server's own (``usage.completion_tokens``, so
stream with ``include_usage``), since a token whose text is held back (half a UTF-8
character) sends no event of its own.

This module imports no part of M*: it drives whatever server the config starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_STARTUP_TIMEOUT_S = 600.0
REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ server
@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def cpu_seconds(self) -> float | None:
        """CPU time the server process (the API server, conductor included) has used so far;
        its worker processes are not counted. None where /proc is missing."""
        return process_cpu_seconds(self.proc.pid)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as err:
            return f"(cannot read {self.log_path}: {err})"


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far, its children not
    counted (Linux /proc; None elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_config(config: dict[str, Any], workdir: str | os.PathLike[str], extra_args: Sequence[str] = (),
                 startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S,
                 env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A healthy ``mstar serve`` of the deployment ``config`` (the YAML keys as a dict) on a
    free local port; ``extra_args``: more ``mstar serve`` options. Stopped when the block ends."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "deployment.yaml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    port = free_port()
    cmd = [sys.executable, "-m", "mstar.cli", "serve", str(config["model"]), "--config", str(config_path),
           "--port", str(port), *extra_args]
    log_path = workdir / "server.log"
    # The server runs this checkout's mstar, as the benchmark does, from a scratch directory.
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}
    child_env.pop("MSTAR_API_KEY", None)  # it would make the server require a bearer token
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
    previous = _exit_on_sigterm()
    try:
        deadline = time.monotonic() + startup_timeout
        while not _healthy(server.url):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} while starting; log tail:\n"
                                   f"{server.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not healthy in {startup_timeout:.0f} s; log tail:\n"
                                   f"{server.log_tail()}")
            time.sleep(0.25)
        yield server
    finally:
        stop_process_group(proc)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm():
    """While a server runs, SIGTERM (``timeout``, a job runner) unwinds this process so the
    server's process group is stopped rather than left running on its own; the previous
    handler, to restore (None off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, leave)


def _healthy(url: str) -> bool:
    try:
        status, _ = asyncio.run(_request(url, "GET", "/health", None, timeout_s=2.0))
    except (OSError, ValueError):  # TimeoutError is an OSError
        return False
    return status == 200


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the group ``proc`` leads (the server shuts down and joins its workers), then
    SIGKILL what is left of it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


# ------------------------------------------------------------------------------ client
def chat_body(prompt: str, max_tokens: int, *, ignore_eos: bool = True, model: str | None = None,
              **extra: Any) -> dict[str, Any]:
    """A streaming greedy ``/v1/chat/completions`` body of one user message."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, **extra}
    if model is not None:
        body["model"] = model
    return body


@dataclass
class StreamTiming:
    """One streamed request: when it was sent, when each event with content arrived."""

    sent: float = 0.0
    first_event: float | None = None  # the first event of the stream: the first token is out
    token_times: list[float] = field(default_factory=list)  # arrivals of events with content
    completion_tokens: int = 0  # the server's count (usage), else the events with content
    finish_reason: str | None = None
    error: str | None = None
    done: float = 0.0

    @property
    def first_token_s(self) -> float:
        return (self.first_event or self.done) - self.sent


@dataclass
class StreamBatch:
    """N streams sent together: when, and what each got."""

    start: float
    streams: list[StreamTiming]

    @property
    def tokens(self) -> int:
        return sum(s.completion_tokens for s in self.streams)

    @property
    def wall_s(self) -> float:
        return max(s.token_times[-1] if s.token_times else s.done for s in self.streams) - self.start

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s

    def inter_token_s(self) -> list[float]:
        return [b - a for s in self.streams for a, b in zip(s.token_times, s.token_times[1:])]

    def first_token_s(self) -> list[float]:
        return [s.first_token_s for s in self.streams]

    def errors(self) -> list[str]:
        return [f"stream {i}: {s.error}" for i, s in enumerate(self.streams) if s.error]


def run_chat_streams(url: str, bodies: Sequence[dict[str, Any]], path: str = "/v1/chat/completions",
                     timeout_s: float = 900.0) -> StreamBatch:
    """Send every body at once as a streaming request; wait for all of them to end."""
    return asyncio.run(_stream_all(url, path, bodies, timeout_s))


async def _stream_all(url: str, path: str, bodies: Sequence[dict[str, Any]], timeout_s: float) -> StreamBatch:
    payloads = [json.dumps(body).encode() for body in bodies]
    streams = [StreamTiming() for _ in bodies]
    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*[_stream_one(url, path, p, s) for p, s in zip(payloads, streams)]),
                           timeout_s)
    return StreamBatch(start, streams)


async def _stream_one(url: str, path: str, payload: bytes, timing: StreamTiming) -> None:
    timing.sent = time.perf_counter()
    counted = 0
    usage = None
    buffer = b""

    def on_data(data: bytes, now: float) -> None:
        nonlocal buffer, counted, usage
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if timing.first_event is None:
                timing.first_event = now
            if payload == b"[DONE]":
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                timing.error = str(chunk["error"])
                continue
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or ():
                if choice.get("delta", {}).get("content"):
                    timing.token_times.append(now)
                    counted += 1
                timing.finish_reason = choice.get("finish_reason") or timing.finish_reason

    try:
        status, body = await _request(url, "POST", path, payload, on_data=on_data)
        if status != 200:
            timing.error = f"HTTP {status}: {body[:500].decode(errors='replace')}"
    except (OSError, asyncio.IncompleteReadError, ValueError) as err:
        timing.error = f"{type(err).__name__}: {err}"
    timing.done = time.perf_counter()
    timing.completion_tokens = usage if usage is not None else counted


@dataclass
class PostTiming:
    """One non-streaming request: its status, body and seconds from sending to the whole body."""

    status: int
    body: bytes
    seconds: float

    def json(self) -> Any:
        return json.loads(self.body)


def run_posts(url: str, path: str, bodies: Sequence[dict[str, Any]], timeout_s: float = 900.0) -> list[PostTiming]:
    """Send every JSON body at once as a plain POST (e.g. image requests); time each."""

    async def one(body: dict[str, Any]) -> PostTiming:
        t0 = time.perf_counter()
        status, data = await _request(url, "POST", path, json.dumps(body).encode())
        return PostTiming(status, data, time.perf_counter() - t0)

    async def every() -> list[PostTiming]:
        return list(await asyncio.wait_for(asyncio.gather(*map(one, bodies)), timeout_s))

    return asyncio.run(every())


# ----------------------------------------------------------------------- HTTP/1.1 wire
async def _request(url: str, method: str, path: str, payload: bytes | None, *, on_data=None,
                   timeout_s: float | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request on its own connection. With ``on_data(bytes, arrival_time)`` the
    body is handed over as it arrives (and the returned body holds only a non-200 answer)."""
    parts = urlsplit(url)
    connect = asyncio.open_connection(parts.hostname, parts.port or 80)
    reader, writer = await (asyncio.wait_for(connect, timeout_s) if timeout_s else connect)
    try:
        head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n"
        if payload is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        writer.write(head.encode() + b"\r\n" + (payload or b""))
        read = _read_response(reader, on_data)
        return await (asyncio.wait_for(read, timeout_s) if timeout_s else read)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader, on_data) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    deliver = on_data if status == 200 else None
    body = bytearray()

    def take(data: bytes) -> None:
        if deliver is not None:
            deliver(data, time.perf_counter())
        else:
            body.extend(data)

    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            take((await reader.readexactly(size + 2))[:-2])
    elif "content-length" in headers:
        take(await reader.readexactly(int(headers["content-length"])))
    else:
        take(await reader.read())
    return status, bytes(body)


# --------------------------------------------------------------------------- checkpoints
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def use_plain_chat_template(model_dir: str | os.PathLike[str]) -> None:
    """Give a checkpoint's tokenizer a chat template that is the messages' text and nothing
    else, so that a chat request's prompt is exactly its text's tokens (the benchmarks' tiny
    tokenizers have no template of their own)."""
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = PLAIN_CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2))
