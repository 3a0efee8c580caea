"""Pi0.5 (``lerobot/pi05_base``): camera images, the robot's state and a task -> an action chunk.

One node, ``policy`` (``mstar.model.pi05.engine``), and one walk, ``act``::

    prefill [pixels, prompt_ids -> prefix]        images and prompt into the paged KV cache
    Loop(step [actions, prefix -> actions])       num_steps Euler steps, noise at t=1 -> t=0
    finish [actions -> action]                    cut to the robot's width, unnormalised; emitted

The front end does what lerobot's processor pipeline does: each image resized with padding to
the tower's square and scaled to [-1, 1]; the state normalised with the embodiment's statistics
and discretised into 256 bins inside the prompt ``Task: ..., State: ...;\\nAction: ``; the noise
drawn from the request's seed. ``/generate`` with ``output_modalities=["action"]`` answers the
chunk ``float32 [chunk_size, action_dim]``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.media.images import ImageError, decode_image
from mstar.model.decoding import kv_pages
from mstar.model.pi05.checkpoint import Embodiment, Pi05Checkpoint, read_embodiment
from mstar.model.pi05.knobs import Pi05Knobs, Pi05Request
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest


@register
class Pi05(ModelSpec):
    key = "pi05"
    tasks = frozenset()  # /generate only
    generate_modalities = (frozenset({"text", "image"}), frozenset({"action"}))
    default_weights = "lerobot/pi05_base"
    Knobs = Pi05Knobs
    knobs: Pi05Knobs

    def graph(self) -> Graph:
        policy = Node("policy", "denoise", inputs=("pixels", "prompt_ids", "actions", "prefix"),
                      outputs=("prefix", "actions", "action"), ops=("prefill", "step", "finish"))
        act = Walk("act", Sequential(
            Step("policy", "prefill", reads=("pixels", "prompt_ids"), writes="prefix"),
            Loop(Step("policy", "step", reads=("actions", "prefix"), writes="actions"), max_iters="num_steps"),
            Step("policy", "finish", reads="actions", writes="action", emit=Emit("action", "action")),
        ), inputs=("pixels", "prompt_ids", "actions"))
        return Graph.build([policy], [act])

    def checkpoint(self) -> Pi05Checkpoint:
        return Pi05Checkpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def default_capacity(self) -> dict[str, int]:
        return {"kv_pages": self.config.resources.kv_cache.max_num_pages}

    # -------------------------------------------------------------- frontend
    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.model_config = ckpt.config()
        self.tokenizer = ckpt.tokenizer(self.knobs.tokenizer)
        self.action_chunk = self.model_config.chunk_size  # /generate's rows of an action
        self.embodiment("")  # a bad statistics directory fails startup, not a request

    def embodiment(self, name: str) -> Embodiment:
        """The statistics of ``name`` ("" the checkpoint's own), read once."""
        known = self.__dict__.setdefault("_embodiments", {})
        if name not in known:
            if name and name not in self.knobs.embodiments:
                raise RequestError("embodiment", f"unknown embodiment {name!r}; known: "
                                                 f"{sorted(self.knobs.embodiments)}")
            from mstar.model.weights import resolve_model_path

            known[name] = (read_embodiment(resolve_model_path(self.knobs.embodiments[name],
                                                              cache_dir=self.config.cache_dir))
                           if name else self.checkpoint().embodiment())
        return known[name]

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if list(spec.output_modalities) != ["action"]:
            raise RequestError("output_modalities", f"model {self.key!r} outputs [\"action\"] only")
        options = Pi05Request.parse(spec.model_kwargs)
        config = self.model_config
        cameras = len(config.cameras)
        if not 1 <= len(spec.files) <= cameras:
            raise RequestError("files", f"expected 1 to {cameras} camera images ({', '.join(config.cameras)}), "
                                        f"got {len(spec.files)}")
        embodiment = self.embodiment(options.embodiment)
        width = embodiment.state.width or config.state_dim
        if len(options.state) != width:
            raise RequestError("state", f"expected {width} values, got {len(options.state)}")
        pixels = self.pixels([data for _, data in spec.files])
        state = embodiment.state.normalize(torch.tensor(options.state, dtype=torch.float32))
        ids = self.tokenizer(prompt_text(spec.text, state)).input_ids
        if len(ids) > config.tokenizer_max_length:
            raise RequestError("text", f"the prompt is {len(ids)} tokens; the limit is {config.tokenizer_max_length}")
        seed = options.seed if options.seed is not None else torch.seed() % (1 << 31)
        noise = torch.randn(config.chunk_size, config.max_action_dim, generator=torch.Generator().manual_seed(seed))
        steps = options.num_inference_steps or self.knobs.num_inference_steps or config.num_inference_steps
        action_dim = embodiment.action.width or config.action_dim
        pages = kv_pages(len(pixels) * config.tokens_per_image + len(ids) + config.chunk_size, self.config)
        inputs = {"pixels": pixels, "prompt_ids": torch.tensor(ids, dtype=torch.int64), "actions": noise}
        params = {"num_steps": steps, "action_dim": action_dim, "embodiment": options.embodiment}
        return WalkRequest("act", inputs, params, {"kv_pages": pages}, prompt_tokens=len(ids),
                           peak={"kv_pages": pages})

    def pixels(self, files: list[bytes]) -> torch.Tensor:
        """The camera images as the tower takes them, ``float32 [cameras, 3, S, S]`` in [-1, 1]:
        each decoded (``files.<i>`` named on error) and divided by 255 into its row of the batch
        (resized with padding first when it is not the tower's square), then the whole batch
        scaled to [-1, 1] in place. The same float32 operations as ``x / 255 * 2 - 1`` per
        image, so the same values, without float temporaries per image or a stack.

        The arithmetic is numpy's, one thread per request: a server prepares concurrent requests
        in threads (``asyncio.to_thread``), and torch's element-wise ops on tensors this size each
        start a team of intra-op threads. Sixteen requests prepared at once on 16 cores spent
        2.2 ms a division of one 224x224 image (an H100 host, 2026-12-07)."""
        size = self.model_config.vision.image_size
        out = torch.empty(len(files), 3, size, size)
        rows = out.numpy()
        for i, data in enumerate(files):
            try:
                image = decode_image(data, field=f"files.{i}")
            except ImageError as err:
                raise RequestError(err.field, err.message, err.status) from None
            rgb = np.asarray(image).transpose(2, 0, 1)
            if (image.height, image.width) == (size, size):
                np.divide(rgb, np.float32(255.0), out=rows[i], dtype=np.float32)
            else:
                out[i] = resize_with_pad(torch.from_numpy(rgb.astype(np.float32)) / 255.0, size)
        rows *= np.float32(2.0)
        rows -= np.float32(1.0)
        return out

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return ActionStream()

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.engine.cuda_graphs import buckets_up_to
        from mstar.model.pi05.engine import Pi05Engine

        ckpt = self.checkpoint()
        dtype = self.config.torch_dtype()
        model = ckpt.load_model(device, dtype, dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        if self.knobs.compile:
            from mstar.model.pi05.fast import compile_policy

            compile_policy(model, self.knobs.compile_backend)
        kv = self.config.resources.kv_cache
        return {"policy": Pi05Engine(model, self.embodiment, device, dtype, kv.max_num_pages, kv.page_size,
                                     cuda_graphs=self.knobs.cuda_graphs,
                                     batch_sizes=buckets_up_to(self.config.max_concurrent_requests))}


def prompt_text(task: str, state: torch.Tensor) -> str:
    """lerobot's Pi0.5 prompt: the task cleaned, and the normalised state in 256 bins over [-1, 1]."""
    bins = torch.linspace(-1, 1, 256 + 1)[:-1]
    levels = torch.bucketize(state, bins, right=True) - 1
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    return f"Task: {cleaned}, State: {' '.join(str(int(v)) for v in levels)};\nAction: "


def resize_with_pad(image: torch.Tensor, size: int) -> torch.Tensor:
    """``image [3, H, W]`` in [0, 1] resized bilinearly to fit ``size x size`` without distortion,
    centred on black (openpi's ``resize_with_pad``)."""
    _, height, width = image.shape
    if (height, width) == (size, size):
        return image
    ratio = max(width / size, height / size)
    new_h, new_w = int(height / ratio), int(width / ratio)
    resized = F.interpolate(image[None], size=(new_h, new_w), mode="bilinear", align_corners=False)[0].clamp(0, 1)
    top, left = (size - new_h) // 2, (size - new_w) // 2
    return F.pad(resized, (left, size - new_w - left, top, size - new_h - top))


class ActionStream(OutputStream):
    """The emitted chunk -> one event of modality ``action``: float32 little-endian, row-major
    ``[chunk_size, action_dim]``."""

    def __init__(self) -> None:
        self.chunks = 0

    @property
    def generated(self) -> int:
        return self.chunks

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        self.chunks += 1
        return OutputEvent(modality="action", data=value.to(torch.float32).contiguous().numpy().tobytes())
