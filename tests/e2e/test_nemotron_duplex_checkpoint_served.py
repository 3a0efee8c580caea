"""Nemotron VoiceChat served from a folder in the released checkpoint's layout (the tiny
folder of ``test_nemotron_duplex_served.py`` plus a ``model.safetensors`` of ``stt_model.*``
and ``tts_model.*`` tensors, the RNN-T and tool-call heads beside them), ``load_format:
safetensors``: the weights are the dummy deployment's (the same seeds), saved under NeMo's
names, so every engine's parameters equal the folder's and a call's text equals the dummy
deployment's token for token."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mstar.config import parse_config
from mstar.model.nemotron_duplex.config import DuplexConfig
from mstar.model.nemotron_duplex.modeling import SpeechEncoder
from mstar.model.nemotron_duplex.talker import dummy_talker
from mstar.model.nemotron_h.modeling import NemotronHForCausalLM
from mstar.model.weights import init_dummy_weights
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
from tests.model.nemotron_duplex.test_duplex_input_checkpoint import SKIPPED, nemo_names

SEED = 3  # _config's model_kwargs.seed


def released_state(config: DuplexConfig) -> dict[str, torch.Tensor]:
    """The dummy deployment's weights under the VoiceChat checkpoint's names."""
    encoder = SpeechEncoder(config)
    init_dummy_weights(encoder, seed=SEED)
    llm = NemotronHForCausalLM(config.llm)
    init_dummy_weights(llm, seed=SEED + 1)
    state = nemo_names(encoder)
    for name, tensor in llm.state_dict().items():
        if name == "backbone.embeddings.weight":
            state["stt_model.embed_tokens.weight"] = tensor
        elif name.startswith("backbone."):
            state["stt_model.llm." + name[len("backbone."):]] = tensor
        else:
            state["stt_model." + name] = tensor
    talker = dummy_talker(config.talker, config.llm.vocab_size, SEED + 2)
    for name, tensor in talker.state_dict().items():
        part, rest = name.split(".", 1)
        state[{"talker": "tts_model.tts_model.", "codec": "tts_model.audio_codec."}[part] + rest] = tensor
    state["tts_model.audio_prompt_latents.default"] = talker.speakers["default"]
    state["tts_model.codec_silence_tokens"] = talker.silence_codes
    return state | {k: v for k, v in SKIPPED.items() if not k.startswith("tts_model.")}


@pytest.fixture(scope="module")
def released(checkpoint: Path, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:  # noqa: F811
    folder = tmp_path_factory.mktemp("voicechat_layout")
    for file in checkpoint.iterdir():
        shutil.copy(file, folder)
    state = released_state(DuplexConfig.from_dir(folder))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder, state


def call(config: dict) -> tuple[list[int], dict]:
    d = start(parse_config(config), in_process=True)
    try:
        app = create_app(d.backend, served_model_names=[MODEL])
        messages = asyncio.run(live_call(app, speech(0.8, seed=5), text="be kind"))
        wait_drained(d)
        engines = d.runtime.workers.workers[0].engines
        params = {"encoder": dict(engines["conformer_encoder"].model.named_parameters()),
                  "llm": dict(engines["nano_llm"].model.named_parameters())}
        return tokens_of(messages), params
    finally:
        d.close()


def test_the_released_layout_serves_the_dummy_deployments_text(released, checkpoint):  # noqa: F811
    folder, state = released
    tokens, params = call(_config(folder, load_format="safetensors"))
    assert len(tokens) == 10 + 1
    assert torch.equal(params["llm"]["lm_head.weight"], state["stt_model.lm_head.weight"])
    assert torch.equal(params["llm"]["backbone.embeddings.weight"], state["stt_model.embed_tokens.weight"])
    assert torch.equal(params["encoder"]["proj.weight"], state["stt_model.perception.proj.weight"])
    assert torch.equal(params["encoder"]["encoder.subsampling.conv_in.weight"],
                       state["stt_model.perception.encoder.pre_encode.conv.0.weight"])
    dummy, _ = call(_config(checkpoint))
    assert tokens == dummy
