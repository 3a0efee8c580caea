"""S15's three nodes make no host read per call: a tick (one 80 ms agent frame for every live
call) of the encoder, the nano LLM and the talker waits for the device as often at 4 calls as
at 1 (``HostReads``, on the CPU, tiny deployment of ``test_nemotron_duplex_served.py``).

On the H200 a tick took 164 ms at one call and 343 ms at 32, against 24-25 / 61-64 ms for the
reference; reads per call per layer were one cause (35cf578). A count that grows with the calls
fails naming the site. What each node may read once a tick:

- encoder: nothing (the front end's samples are host tensors: ``features.py`` is not counted);
- nano LLM: the engine's read of the sampled tokens (``.cpu()``, then ``tolist`` of that host
  copy) and ``_frames``' ``tolist`` of the engine's outputs, text and tool-call tokens (host
  tensors): one wait;
- talker: ``tolist`` of its input tokens (host tensors) and the tick's PCM read back at once
  (``.cpu()``): one wait.

The LLM runs with the tool-call head, NeMo's boosts and both penalties, so that their paths are
counted too. The blocking uploads of host data (``torch.tensor(..., device=)``: a stream sync on
CUDA) do not grow with the calls either; those left are the attention and Mamba metadata of
``mstar/layers``, a few a step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mstar.engine.base import EngineItem
from tests.e2e.test_nemotron_duplex_served import FRAME, checkpoint, speech  # noqa: F401  (checkpoint: a fixture)
from tests.model.nemotron_duplex.test_duplex_build_dtype import spec_of
from tests.support.host_reads import HostReads

ENCODER, NANO, TALKER = "conformer_encoder", "nano_llm", "eartts_talker"
PARAMS = {
    "sampling": {"temperature": 0.7, "top_p": 0.9, "seed": 5},
    "max_new_tokens": 1 << 30,
    "stop_token_ids": [],
    "text_penalties": {"repetition": 1.3, "presence": 0.2},
    "talker_seed": 11,
}
# Reads of tensors that are host tensors in a GPU run too.
HOST_SIDE = (
    "nemotron_duplex/features.py",  # the front end: the append's samples
    "(_first_id)",  # the engine checks a decode's token (a host tensor the nano engine made)
)
PER_TICK = {ENCODER: 0, NANO: 4, TALKER: 2}  # see the module's docstring


@pytest.fixture(scope="module")
def engines(checkpoint: Path, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("nemotron_duplex_reads")
    for file in checkpoint.iterdir():
        shutil.copy(file, folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "use_function_head": True,
        "function_channel_weight": 1.5,
        "inference_pad_boost": -0.5,
        "inference_eos_boost": -0.2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return spec_of(folder).build_engines({ENCODER, NANO, TALKER}, torch.device("cpu"))


def ticks(engines, calls: int, count: int) -> list[dict[str, HostReads]]:
    """``count`` ticks of ``calls`` primed calls: each node's reads, tick by tick."""
    rids = [f"{calls}-{i}" for i in range(calls)]
    engines[NANO].run([EngineItem(r, "prime", 0, {"prompt_ids": torch.tensor([1, 40, 41, 2])}, PARAMS) for r in rids])
    audio = torch.from_numpy(speech(1.2, seed=1))
    out = []
    for t in range(count):
        seen = {node: HostReads(ignore=HOST_SIDE) for node in (ENCODER, NANO, TALKER)}
        items = [
            EngineItem(
                r, "", t, {"audio": audio[t * FRAME : (t + 1) * FRAME]}, PARAMS, chunk=SimpleNamespace(last=False)
            )
            for r in rids
        ]
        with seen[ENCODER]:
            frames = [o.outputs["frames"] for o in engines[ENCODER].run(items)]
        items = [EngineItem(r, "frame", t, {"frame": f}, PARAMS) for r, f in zip(rids, frames)]
        with seen[NANO]:
            tokens = [o.outputs["token"] for o in engines[NANO].run(items)]
        items = [
            EngineItem(r, "", t, {"token": k}, PARAMS, chunk=SimpleNamespace(last=False)) for r, k in zip(rids, tokens)
        ]
        with seen[TALKER]:
            engines[TALKER].run(items)
        out.append(seen)
    for r in rids:
        for engine in engines.values():
            engine.release(r)
    return out


def test_a_tick_reads_the_device_as_often_at_four_calls_as_at_one(engines):
    one, four = ticks(engines, 1, 2), ticks(engines, 4, 2)
    for node, bound in PER_TICK.items():  # the second tick: the first opens the talker's sessions
        a, b = one[1][node], four[1][node]
        assert b.count() == a.count() == bound, f"{node}: 1 call\n{a.report()}\n4 calls\n{b.report()}"
        assert len(b.uploads) == len(a.uploads), f"{node}: 1 call\n{a.report()}\n4 calls\n{b.report()}"
        assert not [u for u in b.uploads if "/layers/" not in u.site], b.report()
    # A call's first tick reads its warm-up's text mask once (TextTable: the reference skips an
    # all-masked text): once in a call's life, not per tick.
    talker = four[0][TALKER]
    assert talker.count() == PER_TICK[TALKER] + 4, talker.report()
    assert {r.site.split(":")[0] for r in talker.reads if r.what == "item"} == {"mstar/model/eartts/talker.py"}
    assert engines[TALKER].talker.slots_used == 0 and not engines[ENCODER].fronts
