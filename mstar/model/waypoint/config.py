"""Configuration of Waypoint's world DiT and of its TAEHV autoencoder.

``WaypointConfig``'s names are the keys of the checkpoint's ``config.yaml`` as Overworld's
``world_engine`` reads them (an OmegaConf file whose top-level keys are the model's
hyper-parameters). Keys the served model does not use (training dropouts, the AE's hub id) are
ignored; a feature the port does not have (text-prompt cross-attention) is refused by name.
``TAEHVConfig`` describes the tiny video autoencoder (madebyollin/taehv); see ``docs/waypoint.md``
for what of both was and was not checked against a reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class WaypointConfig:
    """Hyper-parameters of the frame-causal world DiT."""

    # Defaults: Waypoint-1.5-1B at 720p as Overworld's quark engine describes it; a checkpoint's
    # config.yaml sets its own.
    d_model: int = 2048
    n_heads: int = 32
    n_kv_heads: int | None = 16  # None: as many as n_heads
    n_layers: int = 24
    mlp_ratio: int = 4
    channels: int = 32  # latent channels (the AE's)
    height: int = 16  # token rows of one frame (latent rows / patch rows)
    width: int = 32  # token columns of one frame
    patch: tuple[int, int] = (2, 2)  # latent cells per token (rows, columns)
    n_frames: int = 512  # the frame context: temporal rotary positions a rollout may use
    n_buttons: int = 256  # keyboard / mouse buttons; a control is mouse (2) + buttons + scroll (1)
    local_window: int = 16  # frames a local layer attends to (the current one included)
    global_window: int = 128  # frames of the past a global layer spans
    global_attn_period: int = 4  # every period-th layer (from the offset) is global
    global_attn_offset: int = -1  # -1: layers 3, 7, 11, ...
    global_pinned_dilation: int = 8  # a global layer keeps only every d-th frame of the past
    ctrl_conditioning_period: int = 3  # every period-th layer fuses the controls in
    noise_conditioning: str = "wan"  # "wan": the per-layer conditioning heads have an input bias
    value_residual: bool = True  # layers mix the first layer's values in (learned lerp)
    gated_attn: bool = False  # a per-head sigmoid gate on the attention output
    ctrl_conditioning: str | None = "mlp_fusion"  # not None: the checkpoint has ctrl_cfg.null_emb
    scheduler_sigmas: list[float] = field(default_factory=lambda: [1.0, 0.9, 0.75, 0.3, 0.0])
    # Not a config.yaml key: set by the loader when the checkpoint holds separate attention and
    # MLP conditioning heads (attn_cond_head / mlp_cond_head, three projections and a bias each)
    # instead of one six-projection cond_head.
    split_cond_heads: bool = False
    tokens_per_frame: int | None = None  # height * width (checked)

    def __post_init__(self) -> None:
        self.patch = tuple(int(p) for p in self.patch)  # type: ignore[assignment]
        if self.tokens_per_frame is None:
            self.tokens_per_frame = self.height * self.width
        if self.tokens_per_frame != self.height * self.width:
            raise ValueError(f"tokens_per_frame {self.tokens_per_frame} != height * width "
                             f"({self.height} * {self.width})")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if self.head_dim % 16:
            raise ValueError(f"the head width {self.head_dim} must be a multiple of 16 (the rotary split "
                             "gives columns and rows an eighth each, time a quarter, in pairs)")
        if self.kv_heads < 1 or self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads {self.n_kv_heads} must divide n_heads {self.n_heads}")
        if self.global_window % self.global_pinned_dilation:
            raise ValueError(f"global_window {self.global_window} is not a multiple of global_pinned_dilation "
                             f"{self.global_pinned_dilation}")
        sigmas = [float(s) for s in self.scheduler_sigmas]
        if len(sigmas) < 2 or sigmas[-1] != 0.0 or any(b >= a for a, b in zip(sigmas, sigmas[1:])):
            raise ValueError(f"scheduler_sigmas must fall strictly to 0.0, got {self.scheduler_sigmas}")
        self.scheduler_sigmas = sigmas
        for key in ("local_window", "global_window", "global_attn_period", "global_pinned_dilation",
                    "ctrl_conditioning_period"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, got {getattr(self, key)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def control_dim(self) -> int:
        return self.n_buttons + 3

    @property
    def num_steps(self) -> int:
        return len(self.scheduler_sigmas) - 1

    def is_global(self, layer: int) -> bool:
        return (layer - self.global_attn_offset) % self.global_attn_period == 0

    def window(self, layer: int) -> tuple[int, int]:
        """Layer ``layer``'s ``(slots, dilation)``: how many kept frames it sees (its own
        included), every how many-th past frame it keeps."""
        if self.is_global(layer):  # global_window frames of the past span, every d-th of them kept
            return self.global_window // self.global_pinned_dilation, self.global_pinned_dilation
        return self.local_window, 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WaypointConfig:
        if data.get("prompt_conditioning") is not None:
            raise ValueError("config.yaml: prompt_conditioning is set (a text-prompted Waypoint-1 model); the "
                             "waypoint family serves the control-only Waypoint-1.5 DiT")
        if data.get("has_audio"):
            raise ValueError("config.yaml: has_audio is set; audio is not supported")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class TAEHVConfig:
    """The tiny video autoencoder: 8x spatial compression (three stride-2 stages) after a
    pixel-unshuffle of ``patch_size``, time compression by the stages whose flag is set."""

    latent_channels: int = 32
    patch_size: int = 2
    encoder_time_downscale: tuple[bool, bool, bool] = (True, True, False)
    decoder_time_upscale: tuple[bool, bool, bool] = (False, True, True)
    decoder_space_upscale: tuple[bool, bool, bool] = (True, True, True)

    def __post_init__(self) -> None:
        for key in ("encoder_time_downscale", "decoder_time_upscale", "decoder_space_upscale"):
            value = tuple(bool(v) for v in getattr(self, key))
            if len(value) != 3:
                raise ValueError(f"{key} needs three flags, got {getattr(self, key)}")
            setattr(self, key, value)
        if self.time_downscale != self.time_upscale:
            raise ValueError(f"the encoder compresses time {self.time_downscale}x but the decoder expands it "
                             f"{self.time_upscale}x")

    @property
    def time_downscale(self) -> int:
        return 2 ** sum(self.encoder_time_downscale)

    @property
    def time_upscale(self) -> int:
        return 2 ** sum(self.decoder_time_upscale)

    @property
    def space_scale(self) -> int:
        """Pixels per latent cell along each side."""
        return 8 * self.patch_size

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TAEHVConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"taehv config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)
