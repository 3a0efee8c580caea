"""LingBot-World's rollout engine: one ``chunk`` op makes a request's next chunk of video.

A chunk is ``chunk_frames`` latent frames: their image condition (4 mask channels, 1 on the
first latent frame only, and the Wan2.1 VAE's latents of the start image followed by black
frames, encoded frame by frame as the rollout goes on), their camera rays, the few-step
sampler through the causal DiT and its rolling KV cache, and the VAE decode of the clean
latents to uint8 frames (the first latent frame makes one video frame, every later one four).

Everything a rollout carries between chunks is one ``Rollout`` (the DiT's KV cache, the
sampler's random stream, the VAE encoder's and decoder's frame caches, the camera's last pose
and step scale), held here by request id while its request runs and dropped by ``release``.
A request with a session also puts it in the session's store (``item.session``), where it
stays between requests: a request that resumes the session takes it from there and its
chunks continue the same video (its ``camera`` poses extending the trajectory so far, its
prompt applying to its own chunks).
Requests run one after another: a rollout's cache is its own, and the model is meant to run
one rollout per GPU.
"""

from __future__ import annotations

import torch

from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.model.lingbot.camera import continue_trajectory, default_intrinsics, plucker_rays
from mstar.model.lingbot.sampler import Rollout, denoise_chunk
from mstar.model.lingbot.transformer import LingbotTransformer
from mstar.model.wan22.vae import DecodeState, FrameCache, WanVAE, frames_uint8

OPS = ("chunk",)


class RolloutVAE:
    """The VAE's per-rollout halves: the condition encoded one latent frame at a time through
    its own frame cache, the latents decoded as they come, going on from the decode so far
    (a ``DecodeState``)."""

    def __init__(self, vae: WanVAE, image: torch.Tensor) -> None:
        self.vae = vae
        self.image = image  # [1, 3, 1, H, W] in [-1, 1]
        self.encode_cache, self.decoded = FrameCache(), DecodeState()
        self.encoded: list[torch.Tensor] = []  # normalised latent frames of the condition video

    def condition(self, frames: int) -> torch.Tensor:
        """The first ``frames`` latent frames of [image, black, black, ...], ``[1, z, frames, h, w]``."""
        vae = self.vae
        step = vae.config.scale_factor_temporal
        while len(self.encoded) < frames:
            pixels = self.image if not self.encoded else torch.zeros_like(self.image).expand(-1, -1, step, -1, -1)
            z = vae.quant_conv(vae.encoder(pixels, self.encode_cache))[:, : vae.config.z_dim]
            self.encoded.append(vae.normalize(z.float()))
        return torch.cat(self.encoded[:frames], dim=2)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents ``[1, z, f, h, w]`` (the next ones) -> ``[3, F, H, W]`` in [-1, 1]."""
        vae = self.vae
        return vae.decode(vae.denormalize(latents).to(vae.post_quant_conv.weight.dtype), state=self.decoded)[0]


class WorldEngine(Engine):
    def __init__(self, dit: LingbotTransformer, vae: WanVAE, device: torch.device) -> None:
        self.dit = dit
        self.vae = vae
        self.device = device
        self.rollouts: dict[str, Rollout] = {}
        self.cameras: dict[str, torch.Tensor] = {}  # request id -> its latent frames' relative poses

    def _start(self, item: EngineItem) -> Rollout:
        text = item.inputs["text"].to(self.device)[None]
        gen = torch.Generator().manual_seed(int(item.params["seed"]))
        rollout = Rollout(self.dit.new_cache(), text, gen)
        image = item.inputs["pixels"].to(self.device, self.vae.post_quant_conv.weight.dtype)[None]
        rollout.extra["vae"] = RolloutVAE(self.vae, image)
        return rollout

    def _open(self, item: EngineItem) -> Rollout:
        """The request's first chunk: a new rollout, or its session's to continue (the request's
        prompt then applies from its first chunk on); its poses made relative to the rollout's
        trajectory so far, which they extend."""
        session = item.session
        if session is not None and session.resume:
            rollout = session.get()
            if rollout is None:
                raise RuntimeError(f"session {session.session_id!r} holds no LingBot-World rollout to resume")
            rollout.text = item.inputs["text"].to(self.device)[None]
        else:
            rollout = self._start(item)
        poses, last = item.inputs["camera"].double(), rollout.extra.get("pose")
        if last is not None and not item.params.get("camera_given", True):
            poses = last.repeat(len(poses), 1, 1)  # a resume without poses: the camera stays where it was
        relative, rollout.extra["scale"] = continue_trajectory(poses, last, rollout.extra.get("scale", 0.0))
        rollout.extra["pose"] = poses[-1].clone()
        self.cameras[item.request_id] = relative.float()
        self.rollouts[item.request_id] = rollout
        if session is not None:
            session.put(rollout)  # kept whole (the caches grow in place): the session's next request continues it
        return rollout

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        outputs = []
        for item in items:
            if item.op not in OPS:
                raise ValueError(f"the LingBot-World engine has no op {item.op!r} (it has {list(OPS)})")
            with torch.inference_mode():
                outputs.append(EngineOutput({"frames": self._chunk(item)}))
        return outputs

    def _chunk(self, item: EngineItem) -> torch.Tensor:
        rollout = self.rollouts.get(item.request_id)
        if rollout is None:
            rollout = self._open(item)
        config = self.dit.config
        vae: RolloutVAE = rollout.extra["vae"]
        c = config.chunk_frames
        first = rollout.cache.frames
        condition = vae.condition(first + c)[:, :, first:]
        _, z, _, h, w = condition.shape
        mask = torch.zeros(1, config.vae_stride[0], c, h, w, device=self.device)
        if first == 0:
            mask[:, :, 0] = 1.0
        poses = self.cameras[item.request_id][item.iteration * c:(item.iteration + 1) * c]  # this request's chunks
        cell = config.vae_stride[1:]
        height, width = h * cell[0], w * cell[1]
        given = item.params.get("intrinsics")
        intrinsics = default_intrinsics(width, height) if given is None else tuple(float(v) for v in given)
        rays = plucker_rays(poses, intrinsics, height, width, cell)[None].to(self.device)
        latents = denoise_chunk(self.dit, rollout, torch.cat([mask, condition], dim=1), rays, (1, z, c, h, w))
        return frames_uint8(vae.decode(latents)).cpu()

    def release(self, request_id: str) -> None:
        """The request is over; a rollout its session keeps stays in the session store."""
        self.rollouts.pop(request_id, None)
        self.cameras.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"rollouts": float(len(self.rollouts))}
