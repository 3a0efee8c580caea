"""Nemotron VoiceChat served with the release's tool-call head and NeMo's logit adjustments:
the tiny deployment of ``test_nemotron_duplex_served.py`` with ``use_function_head`` (channel
weight 1.5), the pad, BOS and EOS boosts, and repetition and presence penalties (deployment
knobs; one call overrides them with a negative presence penalty, which makes it repeat).
Concurrent calls equal their solo runs, text and tool-call tokens alike (each call's previous
tool token and said tokens are its own), and every slot, page and per-call token is freed."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from mstar.config import parse_config
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.e2e.test_nemotron_duplex_served import (  # noqa: F401  (checkpoint: a fixture)
    MODEL,
    _config,
    checkpoint,
    live_call,
    speech,
    tokens_of,
    wait_drained,
)


@pytest.fixture(scope="module")
def tools_served(checkpoint: Path, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("nemotron_duplex_tools")
    for file in checkpoint.iterdir():
        shutil.copy(file, folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"use_function_head": True, "function_channel_weight": 1.5, "inference_pad_boost": -0.5,
               "inference_bos_boost": -5.0, "inference_eos_boost": -0.2}
    (folder / "config.json").write_text(json.dumps(config))
    deployment = _config(folder, max_concurrent_requests=8)
    deployment["model_kwargs"] |= {"repetition_penalty": 1.3, "presence_penalty": 0.2}
    d = start(parse_config(deployment), in_process=True)
    try:
        yield d, create_app(d.backend, served_model_names=[MODEL])
    finally:
        d.close()


def recorded(engine, calls):
    """Run ``calls`` with the nano engine's per-call tool-call tokens recorded."""
    tools: dict[str, list[int]] = {}
    run = engine.run

    def spy(items):
        outputs = run(items)
        for item, out in zip(items, outputs):
            if item.op == "frame":
                tools.setdefault(item.request_id, []).extend(out.outputs["tool_token"].tolist())
        return outputs

    engine.run = spy
    try:
        return asyncio.run(calls()), tools
    finally:
        del engine.run


def test_concurrent_calls_with_tool_calls_and_penalties_equal_solo(tools_served):
    d, app = tools_served
    engine = d.runtime.workers.workers[0].engines["nano_llm"]
    assert engine.tools and engine.function_weight == 1.5
    clips = [speech(0.4 + 0.08 * (i % 3), seed=30 + i) for i in range(6)]
    kwargs = [{"repetition_penalty": 1.0, "presence_penalty": -50.0} if i == 2 else {} for i in range(6)]
    solo, solo_tools = [], []
    for clip, kw in zip(clips, kwargs):
        messages, tools = recorded(engine, lambda c=clip, k=kw: live_call(app, c, kwargs=k))
        solo.append(tokens_of(messages))
        solo_tools += list(tools.values())
        assert len(next(iter(tools.values()))) == len(solo[-1])  # one tool-call token per frame

    async def together():
        return await asyncio.gather(*[live_call(app, c, pause=0.005, kwargs=k) for c, k in zip(clips, kwargs)])

    results, tools = recorded(engine, together)
    for alone, messages in zip(solo, results):
        assert tokens_of(messages) == alone
    assert sorted(tools.values()) == sorted(solo_tools)
    wait_drained(d)
    assert not engine.tool and not engine.last
    # that call's override (a negative presence penalty: it repeats what it said) is its own
    plain = tokens_of(asyncio.run(live_call(app, clips[2])))
    assert plain != solo[2] and len(set(solo[2][1:])) == 1 and len(set(plain)) > 2
    wait_drained(d)
    wait_drained(d)


def test_a_bad_penalty_is_a_400_naming_it(tools_served):
    d, app = tools_served
    messages = asyncio.run(live_call(app, speech(0.16, seed=1), kwargs={"repetition_penalty": 0}))
    assert messages[0]["type"] == "session" and messages[1]["field"] == "repetition_penalty"
    wait_drained(d)
