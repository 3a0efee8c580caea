"""Command A+ text and image chat: the declaration.

One node, ``llm``: the Cohere2-MoE decoder with the image encoder on its first rank. A text chat
walks ``chat`` (a prefill, then a Loop of decodes until ``stop``); a chat with images walks
``chat_image``, whose prefill also reads the images' tiles (``pixel_values``), encoded into
the prompt's image placeholders (``mstar.model.command_a_plus.engine``). The frontend tiles
each image (``processor.tile_image``: up to 12 512x512 tiles and a thumbnail) and expands the
template's one image token per image into ``<BOI>`` + (256 image tokens + line break) per tile
+ ``<EOI>``. A request that sends no sampling options gets the release's (temperature 0.9,
top-p 0.95, repetition penalty 1.04); a prompt plus ``max_tokens`` over ``max_seq_len`` is a
400 naming ``max_tokens``. The weights are never downloaded (``checkpoint.locate``).
"""

from __future__ import annotations

import io

import torch

from mstar.config import ConfigError
from mstar.contract import ChatSpec, CompletionSpec, GenerateSpec, RequestError, SamplingParams
from mstar.distributed.dims import ParallelDims
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.chat import ChatLLM, split_content
from mstar.model.command_a_plus.checkpoint import CommandAPlusCheckpoint
from mstar.model.command_a_plus.knobs import SAMPLING_DEFAULTS, CommandAPlusGenerateKnobs, CommandAPlusKnobs
from mstar.model.decoding import checked_sampling
from mstar.model.registry import register
from mstar.model.spec import WalkRequest

LLM = "llm"
# The tokenizer's names of the image's special tokens (Cohere2VisionProcessor reads the same
# attributes), with the release's spellings when a tokenizer does not name them.
IMAGE_TOKENS = {"boi": ("boi_token", "<|START_OF_IMG|>"), "eoi": ("eoi_token", "<|END_OF_IMG|>"),
                "image": ("image_token", "<|IMG_PATCH|>"), "line_break": ("img_line_break_token", "<|IMG_LINE_BREAK|>")}


@register
class CommandAPlusChat(ChatLLM):
    key = "command_a_plus"
    tasks = frozenset({"chat", "text_completion"})
    default_weights = "CohereLabs/command-a-plus-05-2026-bf16"
    input_modalities = frozenset({"text", "image"})
    Knobs = CommandAPlusKnobs
    knobs: CommandAPlusKnobs
    GenerateKnobs = CommandAPlusGenerateKnobs
    kv_upfront = True  # the engine never preempts: an image's K/V are not recomputed from ids

    def graph(self) -> Graph:
        llm = Node(LLM, "autoregressive", inputs=("prompt_ids", "pixel_values", "token"), outputs=("token",),
                   ops=("prefill", "decode"), flags=("stop",))

        def walk(name: str, reads: tuple[str, ...]) -> Walk:
            prefill = Step(LLM, "prefill", reads=reads, writes="token", emit=Emit("token", "text"))
            decode = Step(LLM, "decode", reads="token", writes="token", emit=Emit("token", "text"))
            return Walk(name, Sequential(prefill, Loop(decode, until="stop", max_iters="max_decode_steps")),
                        inputs=reads)

        return Graph.build([llm], [walk("chat", ("prompt_ids",)), walk("chat_image", ("prompt_ids", "pixel_values"))])

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> CommandAPlusCheckpoint:
        return CommandAPlusCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.stop_token_ids = self.stop_ids(ckpt.config().eos_token_id)
        self.vision_config = ckpt.vision_config()
        self.image_ids: dict[str, int] = {}
        if self.vision_config is not None:
            for key, (attribute, default) in IMAGE_TOKENS.items():
                token = getattr(self.tokenizer, attribute, None) or default
                token_id = self.tokenizer.convert_tokens_to_ids(token)
                if token_id is None or token_id == self.tokenizer.unk_token_id:
                    raise ConfigError(f"model_path: the tokenizer has no {token!r} token for images")
                self.image_ids[key] = token_id
            if self.image_ids["image"] != self.vision_config.image_token_id:
                raise ConfigError(f"model_path: the tokenizer's image token is id {self.image_ids['image']}, the "
                                  f"config's image_token_id {self.vision_config.image_token_id}")

    def parallel_dims(self) -> dict[str, ParallelDims]:
        """``llm`` splits by attention heads, KV heads and every expert's features (the shared
        expert's too); the router is whole on every rank, the image encoder on the first only
        (it broadcasts the image's tokens)."""
        config = self.checkpoint().config()
        return {LLM: ParallelDims(tensor={"num_attention_heads": config.num_attention_heads,
                                          "num_key_value_heads": config.num_key_value_heads,
                                          "intermediate_size": config.intermediate_size})}

    def sampling(self, sent: SamplingParams) -> SamplingParams:
        """The request's sampling, or the release's defaults when it sent none of its own (an
        OpenAI request that leaves every option out arrives as ``SamplingParams()``)."""
        if sent == SamplingParams():
            return SamplingParams(**SAMPLING_DEFAULTS)
        return checked_sampling(sent)

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        return self._chat(spec, self.sampling(spec.sampling))

    def _chat(self, spec: ChatSpec, sampling: SamplingParams) -> WalkRequest:
        tiles: list[torch.Tensor] = []
        messages = split_content(spec.messages, ("image",), lambda kind, part, where: tiles.append(
            self._tiles(part, where, len(tiles))))
        ids = self.chat_ids(messages)
        if not tiles:
            self._no_placeholders(ids, "messages")
            return self.text_request(ids, spec.max_tokens, sampling, spec.ignore_eos)
        ids = self._expand(ids, tiles)
        request = self.text_request(ids, spec.max_tokens, sampling, spec.ignore_eos)
        request.walk = "chat_image"
        request.inputs["pixel_values"] = torch.cat(tiles)
        return request

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        if set(spec.output_modalities) - {"text"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs text only")
        if not spec.text:
            raise RequestError("text", "must not be empty")
        options = self.GenerateKnobs.parse(spec.model_kwargs)
        sampling = options.sampling(SAMPLING_DEFAULTS)
        if not options.chat:
            if spec.files:
                raise RequestError("files", "images need the chat template (chat: true)")
            ids = self.tokenizer.encode(spec.text, add_special_tokens=False)
            self._no_placeholders(ids, "text")
            return self.text_request(ids, options.max_tokens, sampling, False, prompt_field="text")
        content = spec.text
        if spec.files:  # the images first, in upload order, then the text
            images = [{"type": "image", "data": data} for _, data in spec.files]
            content = [*images, {"type": "text", "text": spec.text}]
        messages = [{"role": "user", "content": content}]
        return self._chat(ChatSpec(spec.request_id, messages, sampling, options.max_tokens), sampling)

    def prepare_completion(self, spec: CompletionSpec) -> WalkRequest:
        request = super().prepare_completion(spec)
        self._no_placeholders(request.inputs["prompt_ids"].tolist(), "prompt")
        return request

    def _tiles(self, part: dict, where: str, index: int) -> torch.Tensor:
        from PIL import Image

        from mstar.model.command_a_plus.processor import image_to_tensor, tile_image

        if self.vision_config is None:
            raise RequestError(where, "this checkpoint has no vision tower: text only")
        if index >= self.knobs.max_images:
            raise RequestError(where, f"at most {self.knobs.max_images} images per request")
        data = part.get("data")
        try:
            image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
            image.load()
        except Exception as err:
            raise RequestError(where, f"cannot decode the image: {err}") from None
        width, height = image.size
        if width * height > self.knobs.max_image_pixels:
            raise RequestError(where, f"image of {width}x{height} pixels exceeds max_image_pixels "
                                      f"({self.knobs.max_image_pixels})")
        return tile_image(image_to_tensor(image), tile=self.vision_config.image_size)

    def _expand(self, ids: list[int], tiles: list[torch.Tensor]) -> list[int]:
        """The prompt with the template's one image token per image made that image's tokens."""
        from mstar.model.command_a_plus.processor import image_token_ids

        marker = self.image_ids["image"]
        if ids.count(marker) != len(tiles):
            raise RequestError("messages", f"the prompt has {ids.count(marker)} image tokens for {len(tiles)} "
                                           "images (text may not contain them)")
        out, images = [], iter(tiles)
        for token in ids:
            out += image_token_ids(next(images).shape[0], self.vision_config.tokens_per_tile, self.image_ids) \
                if token == marker else [token]
        return out

    def _no_placeholders(self, ids: list[int], field: str) -> None:
        if self.image_ids and self.image_ids["image"] in ids:
            raise RequestError(field, "the text holds an image token but no image came with it")

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.command_a_plus.engine import command_engine

        model = self.checkpoint().load_model(device, self.config.torch_dtype(),
                                             dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        return {LLM: command_engine(model, self.knobs, self.config, device)} if LLM in nodes else {}
