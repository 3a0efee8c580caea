"""Qwen3.5 / Qwen3.8 chat with images and videos: the declaration.

Two nodes: ``vision`` (the ViT tower, stateless: the media of many requests in one
forward) and ``llm`` (the hybrid decoder). A text-only request walks ``chat``, Llama's
walk: a prefill, then a Loop of decodes until the engine raises ``stop``. A request with
media walks ``chat_vision``: the vision node turns its pixel patches into one embedding
per media token, then the prefill reads them with the prompt's MRoPE positions (both made
by the frontend, ``mstar.model.qwen3_5.prompt``), then the same decode Loop.
Besides KV pages, every request holds one recurrent-state slot (the DeltaNet layers'
conv windows and states) from its first step to its release; the pool has
``resources.gdn_state.max_slots`` slots, one of them the sink, and the conductor admits
against both. One class serves every size; the keys differ only in default weights.
"""

from __future__ import annotations

import torch

from mstar.contract import ChatSpec, CompletionSpec, GenerateSpec, RequestError
from mstar.distributed.dims import ParallelDims
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.chat import ChatLLM
from mstar.model.decoding import checked_sampling, state_capacity, state_slots
from mstar.model.qwen3_5.checkpoint import Qwen3_5Checkpoint
from mstar.model.qwen3_5.knobs import Qwen3_5GenerateKnobs, Qwen3_5Knobs
from mstar.model.registry import register
from mstar.model.spec import WalkRequest

STATE_SLOTS = "state_slots"
LLM, VISION = "llm", "vision"
MEDIA_INPUTS = ("pixel_values", "grid_thw", "mrope_positions")


@register
class Qwen3_5Chat(ChatLLM):
    key = "qwen3_5_4b"
    tasks = frozenset({"chat", "text_completion"})
    default_weights = "Qwen/Qwen3.5-4B"
    input_modalities = frozenset({"text", "image", "video"})
    Knobs = Qwen3_5Knobs
    knobs: Qwen3_5Knobs
    GenerateKnobs = Qwen3_5GenerateKnobs
    kv_upfront = True  # its engine never preempts: a recurrent state is not recomputed

    def graph(self) -> Graph:
        vision = Node(VISION, "stateless", inputs=("pixel_values", "grid_thw"), outputs=("vision_embeds",))
        llm = Node(LLM, "autoregressive", inputs=("prompt_ids", "vision_embeds", "mrope_positions", "token"),
                   outputs=("token",), ops=("prefill", "decode"), flags=("stop",))

        def decode_loop() -> Loop:
            decode = Step(LLM, "decode", reads="token", writes="token", emit=Emit("token", "text"))
            return Loop(decode, until="stop", max_iters="max_decode_steps")

        chat = Walk("chat", Sequential(
            Step(LLM, "prefill", reads="prompt_ids", writes="token", emit=Emit("token", "text")),
            decode_loop()), inputs="prompt_ids")
        chat_vision = Walk("chat_vision", Sequential(
            Step(VISION, reads=("pixel_values", "grid_thw"), writes="vision_embeds"),
            Step(LLM, "prefill", reads=("prompt_ids", "vision_embeds", "mrope_positions"), writes="token",
                 emit=Emit("token", "text")),
            decode_loop()), inputs=("prompt_ids", *MEDIA_INPUTS))
        return Graph.build([vision, llm], [chat, chat_vision])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> Qwen3_5Checkpoint:
        return Qwen3_5Checkpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.stop_token_ids = self.stop_ids(ckpt.config().eos_token_id, *ckpt.generation_eos())
        self._load_media_settings(ckpt)

    def _load_media_settings(self, ckpt: Qwen3_5Checkpoint) -> None:
        """Processor settings: the checkpoint's, overridden by ``model_kwargs.image_processor``
        / ``video_processor``."""
        from mstar.config import ConfigError
        from mstar.model.qwen3_5.processor import (
            ImageProcessing,
            VideoProcessing,
            with_overrides,
        )
        from mstar.model.qwen3_5.prompt import VisionTokens

        self.vision_config = ckpt.vision_config()
        patching = {}
        if self.vision_config is not None:  # a checkpoint without processor files: patch as the tower does
            v = self.vision_config
            patching = {"patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
                        "merge_size": v.spatial_merge_size}
            self.vision_tokens = VisionTokens(v.image_token_id, v.video_token_id, v.vision_start_token_id,
                                              v.vision_end_token_id, v.spatial_merge_size)
        try:
            self.image_processing = with_overrides(
                ImageProcessing.from_hf_dict(patching | ckpt.processor_config("image")),
                self.knobs.image_processor, "model_kwargs.image_processor")
            self.video_processing = with_overrides(
                VideoProcessing.from_hf_dict(patching | ckpt.processor_config("video")),
                self.knobs.video_processor, "model_kwargs.video_processor")
        except (TypeError, ValueError) as err:
            raise ConfigError(str(err)) from None

    def parallel_dims(self) -> dict[str, ParallelDims]:
        """``llm`` splits by attention heads, KV heads, DeltaNet key and value heads and MLP
        features; the vision tower is not split (placed on one rank, e.g. the leader's)."""
        config = self.checkpoint().config()
        return {LLM: ParallelDims(tensor={"num_attention_heads": config.num_attention_heads,
                                          "num_key_value_heads": config.num_key_value_heads,
                                          "linear_num_key_heads": config.linear_num_key_heads,
                                          "linear_num_value_heads": config.linear_num_value_heads,
                                          "intermediate_size": config.intermediate_size})}

    @property
    def max_slots(self) -> int:
        return state_slots(self.config, "gdn_state")

    def default_capacity(self) -> dict[str, int]:
        return super().default_capacity() | {STATE_SLOTS: state_capacity(self.config, "gdn_state")}

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        return self._chat(spec, getattr(spec, "enable_thinking", None))

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if set(spec.output_modalities) - {"text"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs text only")
        if not spec.text:
            raise RequestError("text", "must not be empty")
        options = self.GenerateKnobs.parse(spec.model_kwargs)
        sampling = options.sampling()
        if not options.chat:
            if spec.files:
                raise RequestError("files", "images and videos need the chat template (chat: true)")
            ids = self.tokenizer.encode(spec.text, add_special_tokens=False)
            return self.text_request(ids, options.max_tokens, sampling, False)
        content = spec.text
        if spec.files:  # the files first, in upload order, then the text
            content = [self._file_part(name, data) for name, data in spec.files] + [{"type": "text", "text": spec.text}]
        messages = [{"role": "user", "content": content}]
        return self._chat(ChatSpec(spec.request_id, messages, sampling, options.max_tokens), options.enable_thinking)

    def prepare_completion(self, spec: CompletionSpec) -> WalkRequest:
        """A text completion walks ``chat``: its prompt may not hold image or video placeholders."""
        request = super().prepare_completion(spec)
        if self.vision_config is not None:
            media = {self.vision_tokens.image, self.vision_tokens.video}
            if any(token in media for token in request.inputs["prompt_ids"].tolist()):
                raise RequestError("prompt", "a text completion cannot hold image or video placeholder tokens")
        return request

    def _chat(self, spec: ChatSpec, enable_thinking: object) -> WalkRequest:
        checked_sampling(spec.sampling)
        if enable_thinking is not None and not isinstance(enable_thinking, bool):
            raise RequestError("enable_thinking", "must be true or false")
        messages, media = self._split_media(spec.messages)
        ids = self.chat_ids(messages, **({} if enable_thinking is None else {"enable_thinking": enable_thinking}))
        if not media and self.vision_config is None:
            return self.text_request(ids, spec.max_tokens, spec.sampling, spec.ignore_eos)
        return self._media_request(ids, media, spec)

    def _file_part(self, name: str, data: bytes) -> dict:
        part = _file_part(name, data)
        if part["type"] not in self.input_modalities:
            raise RequestError("files", f"{name}: an animated image is a video, and model {self.key!r} "
                                        f"does not take videos")
        return part

    def _split_media(self, messages: list[dict]):
        from mstar.model.qwen3_5.media import split_media

        for i, message in enumerate(messages):
            content = message.get("content")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image", "video") and kind not in self.input_modalities:
                    raise RequestError(f"messages[{i}].content[{j}]", f"model {self.key!r} does not take {kind}s")
        return split_media(messages, self.knobs.media_limits, self.image_processing, self.video_processing,
                           serves_media=self.vision_config is not None)

    def _media_request(self, ids: list[int], media: list, spec: ChatSpec) -> WalkRequest:
        """The ``chat_vision`` walk: placeholders expanded, patches and MRoPE positions made;
        a prompt without media (and no media tokens in its text) stays on ``chat``."""
        from mstar.model.qwen3_5.prompt import expand_placeholders, mrope_positions

        tokens = self.vision_tokens
        placeholders = sum(1 for t in ids if t in (tokens.image, tokens.video))
        if placeholders != len(media):
            raise RequestError("messages", f"the prompt has {placeholders} image/video placeholder tokens for "
                                           f"{len(media)} media (text may not contain them)")
        if not media:
            return self.text_request(ids, spec.max_tokens, spec.sampling, spec.ignore_eos)
        try:
            ids = expand_placeholders(ids, media, tokens, lambda s: self.tokenizer.encode(s, add_special_tokens=False))
        except ValueError as err:
            raise RequestError("messages", str(err)) from None
        grids = [m.grid for m in media]
        positions, _ = mrope_positions(ids, grids, tokens)
        request = self.text_request(ids, spec.max_tokens, spec.sampling, spec.ignore_eos)
        request.walk = "chat_vision"
        request.inputs.update(pixel_values=torch.cat([m.patches for m in media]),
                              grid_thw=torch.tensor(grids, dtype=torch.int64), mrope_positions=positions)
        return request

    def text_request(self, ids: list[int], max_tokens: int | None, sampling, ignore_eos: bool, *,
                     prompt_field: str = "messages") -> WalkRequest:
        request = super().text_request(ids, max_tokens, sampling, ignore_eos, prompt_field=prompt_field)
        request.cost[STATE_SLOTS] = 1
        return request

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.qwen3_5.engine import qwen3_5_engines

        ckpt = self.checkpoint()
        model, tower = ckpt.load_models(device, self.config.torch_dtype(), text=LLM in nodes, vision=VISION in nodes,
                                        dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        return qwen3_5_engines(model, tower, ckpt.vision_config(), self.knobs, self.config, self.max_slots, device)


def _file_part(name: str, data: bytes) -> dict:
    """A ``/generate`` upload as a content part: an animated image is a video, else an image."""
    import io

    from PIL import Image

    try:
        frames = getattr(Image.open(io.BytesIO(data)), "n_frames", 1)
    except Exception:
        raise RequestError("files", f"{name}: not an image or animated image Pillow can read") from None
    return {"type": "video" if frames > 1 else "image", "data": data}


@register
class Qwen3_5_0_8B(Qwen3_5Chat):
    key = "qwen3_5_0_8b"
    default_weights = "Qwen/Qwen3.5-0.8B"


@register
class Qwen3_5_2B(Qwen3_5Chat):
    key = "qwen3_5_2b"
    default_weights = "Qwen/Qwen3.5-2B"


@register
class Qwen3_5_9B(Qwen3_5Chat):
    key = "qwen3_5_9b"
    default_weights = "Qwen/Qwen3.5-9B"


@register
class Qwen3_5_27B(Qwen3_5Chat):
    key = "qwen3_5_27b"
    default_weights = "Qwen/Qwen3.5-27B"


@register
class Qwen3_8_27B(Qwen3_5Chat):
    """Qwen3.8-27B: the Qwen3.5 architecture on the same code (served at TP4 from
    ``configs/qwen3_8_27b_tp4.yaml``); video input is refused, images and text are not."""

    key = "qwen3_8_27b"
    default_weights = "Qwen/Qwen3.8-27B"
    input_modalities = frozenset({"text", "image"})
