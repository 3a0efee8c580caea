"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT): the declaration, understanding side.

Two nodes so far: ``vision`` (the SigLIP NaViT tower with its connector, stateless: the
images of many requests in one forward) and ``llm`` (the MoT decoder over the paged KV).
A text-only chat walks ``chat``: a prefill, then a Loop of decodes until ``stop``. A chat with
images walks ``chat_vision``: the vision node turns each image's patches into LLM tokens,
which the prefill splices in with BAGEL's positions (``mstar.model.bagel.prompt``).

BAGEL has no chat template: every text part of every message is a block
``<|im_start|> text <|im_end|>`` and every image an image block, in order (roles are not
written: BAGEL's prompts carry none); the answer opens with ``<|im_start|>`` (the prompt's
last token) and ends at ``<|im_end|>``. The generation side (generate and edit walks, the VAE,
the flow loop) adds its nodes and walks to ``nodes`` / ``walks``.
"""

from __future__ import annotations

import io

import torch

from mstar.contract import ChatSpec, GenerateSpec, RequestError
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.bagel.checkpoint import BagelCheckpoint
from mstar.model.bagel.image_walks import GENERATOR, BagelImageWalks
from mstar.model.bagel.knobs import BagelKnobs
from mstar.model.bagel.prompt import layout
from mstar.model.chat import ChatLLM, split_content
from mstar.model.decoding import checked_sampling
from mstar.model.registry import register
from mstar.model.spec import WalkRequest

LLM, VISION = "llm", "vision"
VISION_INPUTS = ("patches", "patch_positions", "patch_counts")
PREFILL_INPUTS = ("vision_embeds", "vision_rows", "rope_positions", "mask_positions")


@register
class Bagel(BagelImageWalks, ChatLLM):
    key = "bagel"
    tasks = frozenset({"chat"}) | BagelImageWalks.image_tasks
    default_weights = "ByteDance-Seed/BAGEL-7B-MoT"
    input_modalities = frozenset({"text", "image"})
    Knobs = BagelKnobs
    knobs: BagelKnobs
    kv_upfront = True  # never preempted: an image's K/V are not recomputed from token ids

    # ------------------------------------------------------------ the graph
    def nodes(self) -> list[Node]:
        return [*self.image_nodes(), Node(VISION, "stateless", inputs=VISION_INPUTS, outputs=("vision_embeds",)),
                Node(LLM, "autoregressive", inputs=("prompt_ids", *PREFILL_INPUTS, "token"), outputs=("token",),
                     ops=("prefill", "decode"), flags=("stop",))]

    def walks(self) -> list[Walk]:
        def decode_loop() -> Loop:
            decode = Step(LLM, "decode", reads="token", writes="token", emit=Emit("token", "text"))
            return Loop(decode, until="stop", max_iters="max_decode_steps")

        chat = Walk("chat", Sequential(
            Step(LLM, "prefill", reads="prompt_ids", writes="token", emit=Emit("token", "text")),
            decode_loop()), inputs="prompt_ids")
        chat_vision = Walk("chat_vision", Sequential(
            Step(VISION, reads=VISION_INPUTS, writes="vision_embeds"),
            Step(LLM, "prefill", reads=("prompt_ids", *PREFILL_INPUTS), writes="token", emit=Emit("token", "text")),
            decode_loop()), inputs=("prompt_ids", *VISION_INPUTS, *PREFILL_INPUTS[1:]))
        return [chat, chat_vision, *self.image_walks(VISION)]

    def graph(self) -> Graph:
        return Graph.build(self.nodes(), self.walks())

    # ------------------------------------------------------------ frontend
    def checkpoint(self) -> BagelCheckpoint:
        return BagelCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        self.tokenizer = ckpt.tokenizer()
        self.special = ckpt.special_tokens(self.tokenizer)
        self.bagel_config = ckpt.config()
        self.stop_token_ids = [self.special.im_end]

    def prepare_chat(self, spec: ChatSpec) -> WalkRequest:
        checked_sampling(spec.sampling)
        images: list[torch.Tensor] = []

        def take(kind: str, part: dict, where: str) -> None:
            if len(images) >= self.knobs.max_images_per_request:
                raise RequestError(where, f"at most {self.knobs.max_images_per_request} images per request")
            images.append(self._image(part.get("data"), where))

        messages = split_content(spec.messages, ("image",), take)
        blocks: list[list[int] | int] = []
        patches, positions, sizes = [], [], []
        for image in images:
            p, q = self._tokens(image)
            patches.append(p), positions.append(q), sizes.append(len(q))
        counts = iter(sizes)
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
            for part in parts:
                if part["type"] == "image":
                    blocks.append(next(counts))
                elif not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content", "must be a string or a list of content parts")
                elif part["text"]:
                    blocks.append(self.tokenizer.encode(part["text"], add_special_tokens=False))
        if not blocks:
            raise RequestError("messages", "must hold some text or an image")
        plan = layout(blocks, self.special, answer=True)
        request = self.text_request(plan.token_ids.tolist(), spec.max_tokens, spec.sampling, spec.ignore_eos)
        if images:
            request.walk = "chat_vision"
            request.inputs.update(patches=torch.cat(patches), patch_positions=torch.cat(positions),
                                  patch_counts=torch.tensor(sizes, dtype=torch.int64), vision_rows=plan.vision_rows,
                                  rope_positions=plan.rope_positions, mask_positions=plan.mask_positions)
        return request

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        """``/generate``: the uploaded images, in order, then the text, as one user message
        (``chat: false``: the text's ids as they are, no blocks, no images)."""
        if set(spec.output_modalities) - {"text"}:
            raise RequestError("output_modalities", f"model {self.key!r} outputs text here (image output: "
                                                    "the generation walks)")
        if not spec.text and not spec.files:
            raise RequestError("text", "must not be empty")
        options = self.GenerateKnobs.parse(spec.model_kwargs)
        if not options.chat:
            if spec.files:
                raise RequestError("files", "images need BAGEL's prompt layout (chat: true)")
            return super().prepare_generate(spec)
        content = [{"type": "image", "data": data} for _, data in spec.files]
        if spec.text:
            content.append({"type": "text", "text": spec.text})
        messages = [{"role": "user", "content": content}]
        return self.prepare_chat(ChatSpec(spec.request_id, messages, options.sampling(), options.max_tokens))

    def _image(self, data, where: str):
        from PIL import Image

        if isinstance(data, (bytes, bytearray)):
            try:
                image = Image.open(io.BytesIO(data))
            except Exception as err:
                raise RequestError(where, f"cannot decode the image: {err}") from None
        elif isinstance(data, Image.Image):
            image = data
        else:
            raise RequestError(where, "an image part needs data: image bytes")
        width, height = image.size
        if width * height > self.knobs.max_image_pixels:
            raise RequestError(where, f"image of {width}x{height} pixels exceeds max_image_pixels "
                                      f"({self.knobs.max_image_pixels})")
        try:
            image.load()
        except Exception as err:
            raise RequestError(where, f"cannot decode the image: {err}") from None
        return image

    def _tokens(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        from mstar.model.bagel.vision import patch_positions, patchify, preprocess

        patch = self.bagel_config.vision.patch_size
        pixels = preprocess(image, patch, tuple(self.knobs.vit_resize), tuple(self.knobs.vae_resize))
        side = self.bagel_config.vit_max_num_patch_per_side
        return patchify(pixels, patch), patch_positions(pixels.shape[1], pixels.shape[2], patch, side)

    # ------------------------------------------------------------ worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.bagel.engine import bagel_engines

        model, tower = self.checkpoint().load_models(
            device, self.config.torch_dtype(), llm=bool({LLM, GENERATOR} & nodes), vision=VISION in nodes,
            dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        engines = bagel_engines(model if LLM in nodes else None, tower, self.knobs, self.config, device)
        return {**engines, **self.image_engines(nodes, device, model)}
