"""OmniVoice's two nodes: the canvas (one unmasking step for many requests in one forward) and
the codec (codes -> post-processed waveform).

``canvas`` op ``step``: every item is one request at its own step (``item.iteration``); the
items, up to ``max_batch_size`` at a time, run as one packed backbone forward (two rows each,
``canvas.packed_logits``), and each request reveals its step's share of cells.
A request's noise at step ``s`` comes from a generator seeded with ``(seed, s)``, so its codes
do not depend on what it was batched with or when it was admitted.

``codec`` op ``decode``: the target codes of a finished canvas -> samples (one request at a
time, so that a request's audio is bit-identical alone or among others), then the reference's
level and edges: scaled back to the reference clip's loudness when that was below 0.1 RMS (the
clip was raised to 0.1 before encoding), or to a 0.5 peak without a clip; 0.1 s linear fades
and 0.1 s of silence at each end.
"""

from __future__ import annotations

import torch

from mstar.engine.base import EngineItem
from mstar.model.omnivoice.backbone import OmniVoiceBackbone
from mstar.model.omnivoice.canvas import CanvasPrompt, packed_logits
from mstar.model.omnivoice.modeling import Codec
from mstar.model.omnivoice.schedule import UnmaskKnobs, unmask_counts, unmask_step

__all__ = ["canvas_fn", "codec_fn", "finish_audio", "step_generator", "unmask_params"]

_STEP_SEED_STRIDE = 1_000_003
EDGE_SECONDS = 0.1


def unmask_params(knobs: UnmaskKnobs, rows: int, target_len: int) -> dict:
    """A request's walk parameters for the canvas node (and the loop's ``num_steps``)."""
    return {"num_steps": knobs.num_step, "counts": unmask_counts(rows * target_len, knobs.num_step, knobs.t_shift),
            "guidance_scale": knobs.guidance_scale, "layer_penalty_factor": knobs.layer_penalty_factor,
            "position_temperature": knobs.position_temperature, "class_temperature": knobs.class_temperature,
            "t_shift": knobs.t_shift}


def _knobs(params: dict) -> UnmaskKnobs:
    return UnmaskKnobs(num_step=params["num_steps"], guidance_scale=params["guidance_scale"],
                       t_shift=params["t_shift"], layer_penalty_factor=params["layer_penalty_factor"],
                       position_temperature=params["position_temperature"],
                       class_temperature=params["class_temperature"])


def step_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed * _STEP_SEED_STRIDE + step)


def canvas_fn(backbone: OmniVoiceBackbone, max_batch_size: int):
    device = next(backbone.parameters()).device
    mask_id = backbone.config.audio_mask_id

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        out = []
        for start in range(0, len(items), max_batch_size):
            out += _steps(items[start:start + max_batch_size])
        return out

    def _steps(items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        prompts = [CanvasPrompt(item.inputs["canvas"].to(device), int(item.params["audio_start"]),
                                int(item.params["target_len"])) for item in items]
        out = []
        for item, prompt, (cond, uncond) in zip(items, prompts, packed_logits(backbone, prompts)):
            count = item.params["counts"][item.iteration]
            generator = step_generator(int(item.params["seed"]), item.iteration, device)
            row = prompt.ids.clone()
            target = row[:, row.shape[1] - prompt.target_len:]
            target.copy_(unmask_step(target, cond, uncond, count, _knobs(item.params), mask_id, generator))
            out.append({"canvas": row.cpu()})
        return out

    return run


def finish_audio(wave: torch.Tensor, ref_rms: float | None, sample_rate: int) -> torch.Tensor:
    """The reference's level and edges (see the module doc) on ``wave`` ``[samples]``."""
    if ref_rms is not None and ref_rms < 0.1:
        wave = wave * (ref_rms / 0.1)
    elif ref_rms is None:
        peak = float(wave.abs().max()) if wave.numel() else 0.0
        if peak > 1e-6:
            wave = wave / peak * 0.5
    edge = int(EDGE_SECONDS * sample_rate)
    fade = min(edge, wave.shape[-1] // 2)
    if fade > 0:
        wave = wave.clone()
        wave[:fade] *= torch.linspace(0, 1, fade, dtype=wave.dtype, device=wave.device)
        wave[-fade:] *= torch.linspace(1, 0, fade, dtype=wave.dtype, device=wave.device)
    silence = wave.new_zeros(edge)
    return torch.cat([silence, wave, silence])


def codec_fn(codec: Codec):
    device = next(codec.parameters()).device
    rate = codec.config.sample_rate

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        out = []
        for item in items:  # one at a time: a batched convolution may round differently
            length = int(item.params["target_len"])
            wave = codec.decode(item.inputs["canvas"][None, :, -length:].to(device))[0].float().cpu()
            out.append({"audio": finish_audio(wave, item.params.get("ref_rms"), rate)})
        return out

    return run
