"""nemotron_duplex built in its target dtype, on the CPU with the tiny checkpoint folder of
``test_nemotron_duplex_served.py`` (dummy weights): ``weights.building`` sets and restores
torch's default device and dtype; a bf16 build registers no float32 parameter in the nano
LLM or the talker (the modules are made in bf16, not made in float32 and cast), while the
Mamba-2 states stay float32; ``encoder_dtype: bfloat16`` runs the FastConformer in bf16 with
frames close to the float32 encoder's, and a served call works with it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.model.registry import model_class
from mstar.model.weights import building
from mstar.runtime.launch import start
from mstar.server.app import create_app
from tests.e2e.test_nemotron_duplex_served import (  # noqa: F401  (checkpoint: a fixture)
    FRAME,
    MODEL,
    _config,
    checkpoint,
    speech,
    wait_drained,
)
from tests.e2e.test_nemotron_duplex_talker_served import audio_of, speaking_call, tokens_of
from tests.support.registrations import Registrations

ENCODER, NANO, TALKER = "conformer_encoder", "nano_llm", "eartts_talker"


def spec_of(folder: Path, **overrides):
    return model_class(MODEL)(parse_config(_config(folder, **overrides)))


def test_building_sets_the_default_device_and_dtype_and_restores_them():
    before = torch.get_default_dtype()
    with building("meta", torch.bfloat16):
        layer = nn.Linear(4, 4)
        assert torch.get_default_dtype() == torch.bfloat16 and torch.empty(1).is_meta
        assert torch.arange(3).dtype == torch.int64  # integer tensors stay integers
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.is_meta
    assert torch.get_default_dtype() == before and torch.empty(1).device.type == "cpu"
    with pytest.raises(RuntimeError, match="mid-build"), building("cpu", torch.float16):
        raise RuntimeError("mid-build")
    assert torch.get_default_dtype() == before and torch.empty(1).device.type == "cpu"
    with pytest.raises(ValueError, match="not a floating-point dtype"), building("cpu", torch.int64):
        pass
    assert torch.get_default_dtype() == before
    torch.manual_seed(0)
    plain = nn.Linear(8, 8)
    torch.manual_seed(0)
    with building("cpu", torch.float32):
        built = nn.Linear(8, 8)
    assert torch.equal(plain.weight, built.weight) and torch.equal(plain.bias, built.bias)


def test_a_bf16_build_never_makes_a_float32_parameter_of_the_llm_or_the_talker(checkpoint):  # noqa: F811
    spec = spec_of(checkpoint, dtype="bfloat16")
    with Registrations() as seen:
        engines = spec.build_engines({ENCODER, NANO, TALKER}, torch.device("cpu"))
    llm, talker = engines[NANO].model, engines[TALKER].talker.model
    encoder = engines[ENCODER].model
    assert torch.get_default_dtype() == torch.float32
    for model in (llm, talker):
        made = seen.of(model, "params")
        assert len(made) == len(list(model.parameters())) > 0  # the hooks saw every parameter made
        assert {d for _, d in made} == {torch.bfloat16}, [m for m in made if m[1] != torch.bfloat16]
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    floats = [(n, d) for n, d in seen.of(llm, "buffers") + seen.of(talker, "buffers") if d.is_floating_point]
    assert set(floats) == {("TextTable.on", torch.bfloat16), ("TextTable.off", torch.bfloat16),
                           ("EarTTSTalker.rvq_embs", torch.bfloat16),
                           ("EarTTSTalker.audio_prompt_projection_W", torch.bfloat16),
                           ("_Latent2Wav.window", torch.float32)}  # the codec's window is float32 on purpose
    # the encoder (encoder_dtype float32 by default) is made in float32: the hooks do see it
    assert {d for _, d in seen.of(encoder, "params")} == {torch.float32}
    forward = engines[NANO].inner.forward
    assert {t.dtype for t in forward.ssm_states} == {torch.float32}  # the Mamba-2 states stay float32
    assert {t.dtype for t in forward.conv_states} == {torch.bfloat16}
    assert engines[TALKER].talker.model.speakers["default"].dtype == torch.bfloat16


def test_the_float32_build_is_unchanged_by_building(checkpoint):  # noqa: F811
    """A float32 build's dummy LLM and talker equal the plain construction's, value for value."""
    from mstar.model.nemotron_duplex.config import DuplexConfig
    from mstar.model.nemotron_duplex.talker import dummy_talker
    from mstar.model.nemotron_h.modeling import NemotronHForCausalLM
    from mstar.model.weights import init_dummy_weights

    engines = spec_of(checkpoint).build_engines({NANO, TALKER}, torch.device("cpu"))
    config = DuplexConfig.from_dir(checkpoint)
    llm = NemotronHForCausalLM(config.llm)
    init_dummy_weights(llm, seed=3 + 1)
    for name, value in llm.state_dict().items():
        assert torch.equal(engines[NANO].model.state_dict()[name], value), name
    built = engines[TALKER].talker.model
    talker = dummy_talker(config.talker, config.llm.vocab_size, 3 + 2)
    assert built.talker.schedule == talker.talker.schedule
    for name, value in talker.state_dict().items():
        assert torch.equal(built.state_dict()[name], value), name
    assert torch.equal(built.talker.text.on, talker.talker.text.on)
    assert torch.equal(built.speakers["default"], talker.speakers["default"])


def encode(engine, clips: list[torch.Tensor], append: int = FRAME) -> list[torch.Tensor]:
    """Each clip's encoder frames (LLM embeddings), the calls run together append by append."""
    out: list[list[torch.Tensor]] = [[] for _ in clips]
    steps = max(-(-c.shape[0] // append) for c in clips)
    for j in range(steps):
        items, owners = [], []
        for i, clip in enumerate(clips):
            part = clip[j * append:(j + 1) * append]
            if part.numel():
                last = (j + 1) * append >= clip.shape[0]
                items.append(EngineItem(f"call{i}", "", j, {"audio": part}, {}, chunk=SimpleNamespace(last=last)))
                owners.append(i)
        for i, result in zip(owners, engine.run(items)):
            if "frames" in result.outputs:
                out[i].append(result.outputs["frames"])
    for i in range(len(clips)):
        engine.release(f"call{i}")
    return [torch.cat(frames) for frames in out]


def test_bf16_encoder_frames_are_close_to_float32(checkpoint):  # noqa: F811
    """The same weights (float32, then rounded to bf16 as a bf16 build loads them) over the
    same calls. bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3): every matmul
    output, norm and residual sum is rounded to it, so over the two conformer layers and the
    projection the frames' error is a few roundoffs relative to their scale (measured, torch
    2.13 on the CPU: 7.3e-3 and 7.4e-3 relative in norm, 9.4e-3 and 1.1e-2 of the frames'
    largest magnitude at most); the bounds are about 4 and 8 roundoffs, and the error stays
    far below the frames' own spread."""
    full = spec_of(checkpoint).build_engines({ENCODER}, torch.device("cpu"))[ENCODER]
    half = spec_of(checkpoint, model_kwargs=_config(checkpoint)["model_kwargs"] | {"encoder_dtype": "bfloat16"}
                   ).build_engines({ENCODER}, torch.device("cpu"))[ENCODER]
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights with no zero bias and unit norm: every term counts
        for p in full.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    half.model.load_state_dict(full.model.state_dict())  # copied in, rounded to bf16
    clips = [torch.from_numpy(speech(seconds, seed=i)) for i, seconds in enumerate((1.2, 0.72))]
    want = encode(full, clips)
    got = encode(half, clips)
    assert half.pool.num_used == 0 and not half.fronts
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape == (b.shape[0], 32) and b.shape[0] > 5
        error = a.float() - b
        relative = float(error.norm() / b.norm())
        worst = float(error.abs().max() / b.abs().max())
        print(f"bf16 encoder: relative {relative:.2e}, worst {worst:.2e}")
        assert relative < 1.5e-2 and worst < 3e-2
        assert float(b.std()) > 50 * float(error.abs().mean())  # the frames differ far more than the error


def test_a_served_call_runs_with_the_bf16_encoder(checkpoint):  # noqa: F811
    knobs = _config(checkpoint)["model_kwargs"] | {"encoder_dtype": "bfloat16"}
    d = start(parse_config(_config(checkpoint, model_kwargs=knobs)), in_process=True)
    try:
        encoder = d.runtime.workers.workers[0].engines[ENCODER].model
        assert {p.dtype for p in encoder.parameters()} == {torch.bfloat16}
        app = create_app(d.backend, served_model_names=[MODEL])
        audio = speech(0.8, seed=1)  # 10 appends of 80 ms: 11 agent frames
        messages = asyncio.run(speaking_call(app, audio, seed=7))
        assert messages[-1]["type"] == "done"
        assert len(tokens_of(messages)) == 10 + 1
        pcm = np.concatenate(audio_of(messages))
        assert pcm.shape == (11 * 1764,) and np.isfinite(pcm).all()
        wait_drained(d)
    finally:
        d.close()
