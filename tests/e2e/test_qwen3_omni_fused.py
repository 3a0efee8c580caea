"""Qwen3-Omni served with ``model_kwargs.fused_kernels``: the thinker's and the talker's MoE
experts run as the Triton kernels (``mstar.layers.triton_moe``, under Triton's interpreter on
the CPU), everything else eagerly. A spoken answer's text ids and codec codes equal ``speak``'s
greedy run of the plain eager parts (fp32, a tiny random whole model), and the served models'
experts are the kernels'.

When Triton was imported before the interpreter was set, ``test_kernels_in_a_fresh_interpreter``
runs the file again in a process of its own (tests/support/triton_interpreter.py). On a GPU
machine the file skips: the kernels' compiled path is tests/layers/test_triton_moe.py's.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.triton_interpreter import DEVICE, REASON, kernels_runnable, rerun_in_fresh_interpreter  # isort: skip

pytest.importorskip("transformers.models.qwen3_omni_moe")

from inprocess import deployed  # noqa: E402

from mstar.contract import ChatSpec, SamplingParams  # noqa: E402
from mstar.graph import ScheduledChunks  # noqa: E402
from mstar.layers import triton_moe  # noqa: E402
from mstar.layers.moe import moe_kernel  # noqa: E402
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniCheckpoint  # noqa: E402
from mstar.model.qwen3_omni.speech import ChatTokens, speak, special_codes  # noqa: E402
from mstar.runtime.launch import Deployment  # noqa: E402
from tests.support.qwen3_omni import AUDIO_TOKEN, CHAT, IMAGE_TOKEN, VIDEO_TOKEN  # noqa: E402
from tests.support.qwen3_omni_dir import (  # noqa: E402
    CHUNK,
    CONTEXT,
    MAX_FRAMES,
    SCHEDULE,
    deployment_config,
    write_checkpoint,
)

RUNNABLE = kernels_runnable(triton_moe) and DEVICE.type == "cpu"
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON if DEVICE.type == "cpu" else "CPU interpreter only")

TOKENS = ChatTokens(im_start=CHAT["im_start_token_id"], im_end=CHAT["im_end_token_id"], user=CHAT["user_token_id"],
                    assistant=CHAT["assistant_token_id"], tts_pad=CHAT["tts_pad_token_id"],
                    tts_bos=CHAT["tts_bos_token_id"], tts_eos=CHAT["tts_eos_token_id"], audio=AUDIO_TOKEN,
                    image=IMAGE_TOKEN, video=VIDEO_TOKEN)
MAX_TOKENS = 4
SPEAKER = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("qwen3_omni_fused"))


@pytest.fixture(scope="module")
def deployment(checkpoint: Path) -> Iterator[Deployment]:
    config = deployment_config(checkpoint)
    config["model_kwargs"] = dict(config["model_kwargs"], fused_kernels=True)
    with deployed(config) as d:
        yield d


@runnable
def test_spoken_answer_with_the_moe_kernels_equals_eager(deployment: Deployment, checkpoint: Path) -> None:
    d = deployment
    engines = d.runtime.workers.workers[0].engines
    served = [engines["thinker"].model, engines["talker"].engine.model]
    assert [moe_kernel(m) for m in served] == ["triton", "triton"]

    cpu = torch.device("cpu")
    ckpt = Qwen3OmniCheckpoint(checkpoint)
    thinker, talker = (ckpt.thinker(cpu, torch.float32, dummy=False, seed=0),
                       ckpt.talker(cpu, torch.float32, dummy=False, seed=0))
    code2wav = ckpt.code2wav(cpu, torch.float32, dummy=False, seed=0)
    assert moe_kernel(thinker) == moe_kernel(talker) == "loop"
    spec = ChatSpec(request_id=f"fused-{uuid.uuid4().hex[:8]}",
                    messages=[{"role": "user", "content": "say something"}],
                    sampling=SamplingParams(temperature=0.0), max_tokens=MAX_TOKENS,
                    output_modalities=["text", "audio"], audio={"voice": SPEAKER, "format": "pcm"})
    ids = d.spec.prepare_chat(spec).inputs["prompt_ids"].tolist()
    want = speak(thinker.text, talker, code2wav, ids, TOKENS, talker.config.speaker_id[SPEAKER], MAX_TOKENS,
                 MAX_FRAMES, suppressed=special_codes(talker))

    codes: list[torch.Tensor] = []
    original = engines["code2wav"].run
    engines["code2wav"].run = lambda items: (codes.extend(i.inputs["codes"] for i in items), original(items))[1]
    try:
        events = asyncio.run(_events(d, spec))
    finally:
        del engines["code2wav"].run
    assert [t for e in events for t in e.token_ids] == want.text_ids
    assert any(e.modality == "audio" and e.data for e in events)
    assert want.codes.shape[1] == MAX_FRAMES  # random weights never draw the codec EOS this early
    frames = torch.cat([c[keep:] for c, (_, _, keep) in zip(codes, _cuts(MAX_FRAMES), strict=True)]).T
    assert torch.equal(frames, want.codes)  # every frame once, in order: the talker's codes


def _cuts(frames: int) -> list[tuple[int, int, int]]:
    """(start, end, left context) of each chunk the codec stream takes of a closed clip."""
    policy, out, covered, taken = ScheduledChunks(tuple(SCHEDULE), CHUNK, CONTEXT), [], 0, 0
    while (chunk := policy.next_chunk(frames, taken, covered, True)) is not None:
        out.append((chunk.start, chunk.end, chunk.keep_start - chunk.start))
        covered, taken = chunk.keep_end, taken + 1
    return out


async def _events(d: Deployment, spec: ChatSpec) -> list:
    out = []
    events = d.backend.chat(spec)
    try:
        async for event in events:
            assert event.error is None, event.error
            out.append(event)
    finally:
        await events.aclose()
    return out


def test_kernels_in_a_fresh_interpreter():
    if RUNNABLE or DEVICE.type == "cuda":
        pytest.skip("the kernels ran in this process, or this is a GPU machine")
    rerun_in_fresh_interpreter(__file__)
