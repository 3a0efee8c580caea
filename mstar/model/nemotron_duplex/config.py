"""Configuration of Nemotron VoiceChat's input side: the streamed encoder and the nano LLM.

Read from the checkpoint folder's ``config.json``: ``encoder`` (the FastConformer's fields,
``FastConformerConfig``; always the causal layout at lookahead 0, each frame over itself and
the ``left_context`` frames before it, 70 by default), ``llm`` (a transformers Nemotron-H
``config.json``), ``n_mels`` (128), ``agent_pad_token_id`` (the agent's "no text" token,
the previous token of its first frame and never shown as text; default the LLM's pad, else 0)
``user_channel_weight`` (the user channel's scale, the audio frames' and the system prompt's,
NeMo's ``duplex_user_channel_weight``; default 1), ``text_channel_weight`` (the scale of the
previous agent token's embedding, NeMo's ``duplex_text_channel_weight``; default 1) and
``speech_generation`` (the EarTTS talker and
its codec, VoiceChat's ``model.speech_generation``: ``EarTTSConfig``; None when absent, and
then the deployment refuses to start).

The release's tool-call channel: ``use_function_head`` (default false: no head, no channel,
the layout above) builds the ``function_head`` (``stt_model.function_head.weight``) and adds to
every position the embedding of the previous tool-call token (the pad at the prompt's
positions and the first frame, then the head's greedy pick of the step before) times
``function_channel_weight`` (NeMo's ``duplex_function_channel_weight``, default 1).
``inference_pad_boost``, ``inference_bos_boost`` and ``inference_eos_boost`` (NeMo's names,
default 0: off) are added to the agent text's logits of the pad, BOS and EOS at every step, as
NeMo's ``DuplexSTTModel.forward`` adds them at inference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mstar.model.eartts.config import EarTTSConfig
from mstar.model.fastconformer.config import FastConformerConfig
from mstar.model.nemotron_h.config import NemotronHConfig

FRAME_SAMPLES = 1280  # one encoder frame: 80 ms at 16 kHz (8 mel hops of 160)
LEFT_CONTEXT = 70


@dataclass
class DuplexConfig:
    encoder: FastConformerConfig
    llm: NemotronHConfig
    n_mels: int = 128
    agent_pad_token_id: int = 0
    user_channel_weight: float = 1.0
    text_channel_weight: float = 1.0
    talker: EarTTSConfig | None = None
    eos_token_id: int | None = None  # the agent's end of text (the talker speaks silence before it)
    bos_token_id: int | None = None  # the agent's start of text (``inference_bos_boost``'s token)
    use_function_head: bool = False
    function_channel_weight: float = 1.0
    inference_pad_boost: float = 0.0
    inference_bos_boost: float = 0.0
    inference_eos_boost: float = 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DuplexConfig:
        if "encoder" not in d or "llm" not in d:
            raise ValueError("config.json needs an 'encoder' and an 'llm' section")
        encoder = dict(d["encoder"])
        encoder.update(causal=True, default_lookahead=0)
        encoder.setdefault("left_context", LEFT_CONTEXT)
        n_mels = int(d.get("n_mels", encoder.get("num_mel_bins", 128)))
        encoder["num_mel_bins"] = n_mels
        llm = NemotronHConfig.from_hf_dict(d["llm"])
        pad = d.get("agent_pad_token_id", d["llm"].get("pad_token_id"))
        weight = float(d.get("user_channel_weight", 1.0))
        text_weight = float(d.get("text_channel_weight", 1.0))
        speech = d.get("speech_generation", d.get("model", {}).get("speech_generation"))
        talker = EarTTSConfig.from_speech_generation(speech) if speech else None
        eos = d["llm"].get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        bos = d["llm"].get("bos_token_id")
        boosts = {name: float(d.get(name) or 0.0)
                  for name in ("inference_pad_boost", "inference_bos_boost", "inference_eos_boost")}
        return cls(FastConformerConfig(**encoder), llm, n_mels, int(pad or 0), weight, text_weight, talker,
                   None if eos is None else int(eos), None if bos is None else int(bos),
                   use_function_head=bool(d.get("use_function_head", False)),
                   function_channel_weight=float(d.get("function_channel_weight", 1.0)), **boosts)

    @classmethod
    def from_dir(cls, path: Path) -> DuplexConfig:
        file = path / "config.json"
        if not file.is_file():
            raise ValueError(f"model_path {path}: no config.json")
        return cls.from_dict(json.loads(file.read_text()))
