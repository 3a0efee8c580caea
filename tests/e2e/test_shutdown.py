"""End to end: stopping a real ``mstar serve smollm2`` (a worker process) the way a terminal's
Ctrl-C (SIGINT) or a process manager (SIGTERM) does, by signalling its whole process group.

The server must exit with status 0 within ``STOP_WITHIN_S``, its workers with it, and its
log must say nothing of workers dying or restarting: the workers leave the signal to the
server, which stops them once the requests under way are done.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from live_server import launch_server

STOP_WITHIN_S = 10.0
NOT_IN_THE_LOG = ("failed", "restart", "killed by", "is gone", "Traceback", "giving up", "leaked")


def _group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_stops_the_server_quietly(tmp_path: Path, signum: int) -> None:
    with launch_server("smollm2", tmp_path) as server:
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        os.killpg(server.proc.pid, signum)
        code = server.proc.wait(timeout=STOP_WITHIN_S)
        assert _group_gone(server.proc.pid, timeout=5.0), "a worker outlived the server"
    log = server.log_path.read_text(errors="replace")
    assert code == 0, log[-4000:]
    assert "stopped" in log.splitlines()[-1]
    noise = [line for line in log.splitlines() if any(word in line for word in NOT_IN_THE_LOG)]
    assert not noise, log[-4000:]
