"""LTX-2.5's engines: the text node (Gemma 4 + connectors), the DiT as a denoise engine over the
video and audio tokens together, the video VAE decoder and the audio decoder (audio VAE +
vocoder).

Denoise engine op ``step`` [video, audio, text, audio_text -> video, audio]: one distilled
step for every ready request; requests with the same token counts share a DiT forward, each at
its own step. A request's sigmas come from its video token count (``LtxSchedule``), the recipe's
eight by default; they are kept per request until ``release``.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

import torch

from mstar.config import DeploymentConfig
from mstar.diffusion.flow_match import FlowMatchEuler
from mstar.engine.base import Engine, EngineItem, EngineOutput, StatelessEngine
from mstar.model.diffusers_checkpoint import Loader
from mstar.model.ltx2_5.audio_vae import LtxAudioVae
from mstar.model.ltx2_5.checkpoint import NAME_MAPS, LtxCheckpoint
from mstar.model.ltx2_5.connectors import LtxTextConnectors
from mstar.model.ltx2_5.denoise import DISTILLED_SIGMAS, LtxSchedule, unpack_video
from mstar.model.ltx2_5.gemma import GemmaTextModel
from mstar.model.ltx2_5.text import LtxTextEncoder
from mstar.model.ltx2_5.transformer import LtxTransformer
from mstar.model.ltx2_5.video_vae import LtxVideoVae
from mstar.model.ltx2_5.vocoder import build_vocoder

# folder -> seed offset of its dummy weights
SEEDS = {"text_encoder": 1, "connectors": 2, "transformer": 3, "vae": 4, "audio_vae": 5, "vocoder": 6}


def build_component(ckpt: LtxCheckpoint, folder: str, load: Loader) -> torch.nn.Module:
    """Component ``folder`` built from its config and loaded (or dummy) by ``load``."""
    make = {
        "text_encoder": lambda: GemmaTextModel(ckpt.text_config()),
        "connectors": lambda: LtxTextConnectors(ckpt.connectors_config()),
        "transformer": lambda: LtxTransformer(ckpt.transformer_config()),
        "vae": lambda: LtxVideoVae(ckpt.vae_config()),
        "audio_vae": lambda: LtxAudioVae(ckpt.audio_vae_config()),
        "vocoder": lambda: build_vocoder(ckpt.vocoder_config()),
    }[folder]
    options = {"name_map": NAME_MAPS[folder]} if folder in NAME_MAPS else {}
    return load(make, folder, SEEDS[folder], **options)


class LtxDenoiseEngine(Engine):
    """The distilled no-guidance step of many requests (see the module docstring)."""

    def __init__(self, dit: LtxTransformer, schedule: LtxSchedule, device: torch.device, dtype: torch.dtype,
                 predict_scope: Callable = torch.inference_mode) -> None:
        self.dit, self.schedule, self.device, self.dtype = dit, schedule, device, dtype
        self.scope = predict_scope
        self.sigmas: dict[str, torch.Tensor] = {}
        self.forward_rows: deque[int] = deque(maxlen=1024)  # rows of each recent forward (batch log)

    def _sigmas(self, item: EngineItem) -> torch.Tensor:
        if item.request_id not in self.sigmas:
            chosen = tuple(item.params.get("sigmas", DISTILLED_SIGMAS))
            self.sigmas[item.request_id] = self.schedule.sigmas(item.inputs["video"].shape[0], chosen)
        return self.sigmas[item.request_id]

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        for item in items:
            if item.op != "step":
                raise ValueError(f"the LTX denoise engine has no op {item.op!r} (it has ['step'])")
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            key = (tuple(item.inputs["video"].shape), tuple(item.inputs["audio"].shape),
                   tuple(item.inputs["text"].shape), tuple(item.params["grid"]), float(item.params["fps"]))
            groups[key].append(i)
        out: list[EngineOutput | None] = [None] * len(items)
        with self.scope():
            for (_, _, _, grid, fps), rows in groups.items():
                batch = [items[i] for i in rows]
                self.forward_rows.append(len(batch))
                sig = [self._sigmas(item) for item in batch]
                now = torch.stack([s[item.iteration] for s, item in zip(sig, batch)]).to(self.device)
                nxt = torch.stack([s[item.iteration + 1] for s, item in zip(sig, batch)]).to(self.device)

                video, audio, text, audio_text = (
                    torch.stack([item.inputs[port] for item in batch]).to(self.device)
                    for port in ("video", "audio", "text", "audio_text"))
                video, audio = video.float(), audio.float()
                v_video, v_audio = self.dit(video.to(self.dtype), audio.to(self.dtype), text.to(self.dtype),
                                            audio_text.to(self.dtype), now * 1000, grid=grid, fps=fps)
                video = FlowMatchEuler.step(video, v_video.float(), now, nxt)
                audio = FlowMatchEuler.step(audio, v_audio.float(), now, nxt)
                for j, i in enumerate(rows):
                    out[i] = EngineOutput({"video": video[j], "audio": audio[j]})
        return out  # type: ignore[return-value]

    def release(self, request_id: str) -> None:
        self.sigmas.pop(request_id, None)


def frames_uint8(video: torch.Tensor) -> torch.Tensor:
    """Decoded ``[3, F, H, W]`` in [-1, 1] -> ``uint8 [F, H, W, 3]`` (the pipeline's rounding)."""
    return ((video.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0)


def ltx_engines(ckpt: LtxCheckpoint, config: DeploymentConfig, seed: int, nodes: set[str],
                device: torch.device) -> dict[str, Engine]:
    load = ckpt.loader(config, seed, device)
    dtype = config.torch_dtype()
    engines: dict[str, Engine] = {}
    if "text_encoder" in nodes:
        encoder = LtxTextEncoder(build_component(ckpt, "text_encoder", load),
                                 build_component(ckpt, "connectors", load))

        def encode(op, items):
            ids = torch.stack([i.inputs["prompt_ids"] for i in items]).to(device)
            mask = torch.stack([i.inputs["prompt_mask"] for i in items]).to(device)
            video, audio, _ = encoder(ids, mask)
            return [{"text": v, "audio_text": a} for v, a in zip(video, audio)]

        engines["text_encoder"] = StatelessEngine(encode)
    if "dit" in nodes:
        engines["dit"] = LtxDenoiseEngine(build_component(ckpt, "transformer", load), ckpt.schedule(), device, dtype)
    if "vae_decoder" in nodes:
        vae = build_component(ckpt, "vae", load)

        def decode_video(op, items):
            out = []
            for item in items:  # one request a forward: sizes differ and the decode is memory-bound
                latents = unpack_video(item.inputs["video"][None].to(device, dtype), tuple(item.params["grid"]))
                out.append({"frames": frames_uint8(vae.decode(latents)[0]).cpu()})
            return out

        engines["vae_decoder"] = StatelessEngine(decode_video)
    if "audio_decoder" in nodes:
        audio_vae, vocoder = build_component(ckpt, "audio_vae", load), build_component(ckpt, "vocoder", load)

        def decode_audio(op, items):
            return [{"waveform": vocoder(audio_vae.decode(item.inputs["audio"][None].to(device, dtype)))[0]
                     .float().cpu()} for item in items]

        engines["audio_decoder"] = StatelessEngine(decode_audio)
    return engines
