"""The duplex model's talker node, ``eartts_talker``: each agent text token to that frame's
speech, in the step that receives it.

A stream consumer of ``agent_text`` (the nano LLM's one token per 80 ms frame). Each call is
a session of the EarTTS ``TalkerEngine`` (``mstar/model/eartts``): opened at its first token
with the speaker warm-up (``Warmup.for_speaker``, the configured speaker's latent) and the
call's seed, it holds two streams of the talker's paged KV (the CFG pair) and one slot of the
``codec_state`` pool. A chunk's tokens advance the call one frame each, the calls of a plan
sharing one backbone pass per frame position; each frame's codes are decoded by the causal
codec inside the same step, so the chunk's PCM (22.05 kHz, 1764 samples a frame, the first
frame's six fewer) leaves with the step. The stream's last chunk (the nano's frames ended)
closes the session: the codec's last six samples are flushed with that chunk's PCM, and the
pages and slot are freed. ``release`` (the call ended any other way: a hang-up, an error)
frees them without a flush.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.model.eartts.checkpoint import EarTTS, load_checkpoint
from mstar.model.eartts.config import EarTTSConfig
from mstar.model.eartts.engine import TalkerEngine, Warmup


def prompt_frames(config: EarTTSConfig) -> int:
    """Frames of the speaker prompt in a session's warm-up (3 s of 80 ms: 37)."""
    return int(config.audio_prompt_duration / config.frame_length + 1e-9)


def warmup_positions(config: EarTTSConfig) -> int:
    """KV positions per stream a session's warm-up takes before its first frame."""
    return prompt_frames(config)


def dummy_talker(config: EarTTSConfig, vocab: int, seed: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> EarTTS:
    """The talker with ``load_format: dummy`` weights: random weights, text table and a
    speaker latent (``default``) of the warm-up's length; the silence frame is code 0. Built
    and drawn on ``device`` in ``dtype`` (``building``: no float32 copy of a bf16 talker)."""
    from mstar.model.weights import building, init_dummy_weights

    device = torch.device(device)
    with building(device, dtype):
        model = EarTTS(config, text_vocab=vocab)
    init_dummy_weights(model, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = config.talker.hidden_size
    on = torch.randn(vocab, hidden, generator=gen, device=device, dtype=dtype)
    model.talker.text.replace(on, 0.1 * torch.randn(vocab, hidden, generator=gen, device=device, dtype=dtype))
    model.speakers = {"default": torch.randn(1, prompt_frames(config), hidden, generator=gen, device=device,
                                             dtype=dtype)}
    return model


def checkpoint_talker(config: EarTTSConfig, folder: Path, vocab: dict[str, int], text_vocab: int = 0, *,
                      device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> EarTTS:
    """The talker from a VoiceChat checkpoint folder's safetensors (``tts_model.*``, the layout
    ``mstar.model.eartts.checkpoint`` maps, coverage checked both ways; the other nodes'
    tensors, ``stt_model.*``, are not read here), its text table run from the checkpoint's
    text encoder over the tokenizer's ``vocab``. The table has at least ``text_vocab`` rows
    (the LLM's padded vocabulary: ids the tokenizer lacks embed as nothing). Built on
    ``device`` in ``dtype`` (``building``), each tensor cast as it is copied in."""
    from mstar.model.weights import building, iter_safetensors

    with building(device, dtype):
        model = EarTTS(config, text_vocab=len(vocab) + 1)
    load_checkpoint(model, ((n, t) for n, t in iter_safetensors(folder) if n.startswith("tts_model.")),
                    vocab=vocab)
    if not model.speakers:
        raise ValueError(f"{folder}: no speaker latent (tts_model.audio_prompt_latents.*)")
    table = model.talker.text
    missing = text_vocab - table.on.shape[0]
    if missing > 0:
        table.replace(*(torch.cat([t, t.new_zeros(missing, t.shape[1])]) for t in (table.on, table.off)))
    return model


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor | None:
    """A call's PCM of a step (None: it said nothing); one frame as it is (no copy a call)."""
    if not pieces:
        return None
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class TalkerNode(Engine):
    """Node ``eartts_talker``: ``token`` (a chunk's agent text tokens) -> ``audio`` (their PCM)."""

    def __init__(self, talker: TalkerEngine, warmup: Warmup) -> None:
        self.talker = talker
        self.warmup = warmup

    @torch.no_grad()
    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        given = [item.inputs["token"].reshape(-1) for item in items]  # host tensors: read at once
        flat = iter(torch.cat(given).tolist())
        tokens = {item.request_id: [next(flat) for _ in range(ids.numel())] for item, ids in zip(items, given)}
        for item in items:
            if item.request_id not in self.talker.sessions:
                self.talker.open(item.request_id, self.warmup, seed=int(item.params["talker_seed"]))
        pcm: dict[str, list[torch.Tensor]] = {rid: [] for rid in tokens}
        for j in range(max(len(t) for t in tokens.values())):
            frames = self.talker.step({rid: ids[j] for rid, ids in tokens.items() if len(ids) > j})
            for rid, frame in frames.items():
                pcm[rid].append(frame.pcm)
        for item in items:
            if item.chunk is not None and item.chunk.last:
                pcm[item.request_id].append(self.talker.close(item.request_id))
        # Every call's PCM leaves in one read back (the step's one wait for the device), then is split.
        parts = [_joined(pcm[item.request_id]) for item in items]
        spoken = [p for p in parts if p is not None]
        host = iter(torch.cat(spoken).float().cpu().split([p.shape[0] for p in spoken]) if spoken else ())
        return [EngineOutput({"audio": next(host)}) if p is not None else EngineOutput({}) for p in parts]

    def release(self, request_id: str) -> None:
        if request_id in self.talker.sessions:
            self.talker.close(request_id)

    def stats(self) -> dict[str, float]:
        return {"talker_pages_used": float(self.talker.pages_used), "codec_slots_used": float(self.talker.slots_used)}
