"""FLUX.2 [klein] base: the non-distilled klein checkpoints, sampled with classifier-free guidance.

The same nodes as the distilled klein, plus guidance: the negative prompt (the empty string,
as in diffusers' Flux2KleinPipeline) is encoded by the text-encoder node beside the prompt,
in the same batch, and each denoise step combines a conditional and an unconditional DiT
prediction, ``v_uncond + g * (v_cond - v_uncond)`` (guidance 4 and 50 steps by default:
``Flux2GuidedKnobs``).

Two forms of the guided walk; ``model_kwargs.cfg_parallel`` picks one:

- ``false`` (default): the **batched pair**. Each step of node ``dit`` puts both rows of a
  request in one forward, beside the rows of other requests.
- ``true``: **CFG parallel**. Each step is ``Parallel(dit: velocity on text -> v_cond,
  dit_uncond: velocity on negative_text -> v_uncond)``, then ``dit: guide`` combines and steps.
  ``dit_uncond`` is the same DiT under a second node name, so the YAML places the branches:
  ``dit_uncond`` on the rank of ``dit`` (one copy of the weights, two forwards) or on
  another rank (the branches run at the same time; ``latents`` go out and ``v_uncond`` comes
  back each step).

Both walks of the distilled model have a guided form: ``t2i_guided`` and ``edit_guided`` (the
reference tokens condition both branches). A request with ``guidance_scale`` 1 takes the
unguided walk.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mstar.contract import ImageSpec, RequestError
from mstar.graph import Emit, Graph, Loop, Node, Parallel, Sequential, Step, Walk
from mstar.model.flux2.knobs import Flux2GuidedKnobs
from mstar.model.flux2.model import Flux2Klein
from mstar.model.registry import register
from mstar.model.spec import WalkRequest

NEGATIVE_PROMPT = ""

GUIDED_WALKS = {"t2i": "t2i_guided", "edit": "edit_guided"}  # the distilled model's walk -> its guided form
UNCOND_NODE = "dit_uncond"
GUIDANCE_RULE = "must be a number >= 1 (1 turns guidance off)"


def _scale(value) -> float | None:
    """A valid guidance scale as a float, or None (a string or a boolean is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 1 else None


@register
class Flux2KleinBase(Flux2Klein):
    key = "flux2_klein_base"
    default_weights = "black-forest-labs/FLUX.2-klein-base-4B"
    Knobs = Flux2GuidedKnobs
    knobs: Flux2GuidedKnobs

    @property
    def cfg_parallel(self) -> bool:
        return self.knobs.cfg_parallel

    def graph(self) -> Graph:
        base = super().graph()
        text_encoder, dit, vae = base.nodes["text_encoder"], base.nodes["dit"], base.nodes["vae"]
        guided_dit = Node(dit.name, dit.kind, inputs=(*dit.inputs, "negative_text", "v_cond", "v_uncond"),
                          outputs=(*dit.outputs, "velocity"), ops=(*dit.ops, "velocity", "guide"))
        nodes = [text_encoder, guided_dit, vae]
        if self.cfg_parallel:
            nodes.append(Node(UNCOND_NODE, dit.kind, inputs=dit.inputs, outputs=("velocity",), ops=("velocity",)))
        guided = [self._guided(base.walks[name]) for name in GUIDED_WALKS if name in base.walks]
        return Graph.build(nodes, [*base.walks.values(), *guided])

    def _guided(self, plain: Walk) -> Walk:
        """The guided form of the distilled model's walk ``t2i`` or ``edit`` (which conditions
        every DiT row on the request's reference tokens as well)."""
        edit = plain.name == "edit"

        def dit_reads(text: str) -> dict[str, str]:
            return {"latents": "latents", "text": text, **({"references": "references"} if edit else {})}

        if self.cfg_parallel:
            denoise = Sequential(
                Parallel(
                    Step("dit", "velocity", reads=dit_reads("text"), writes={"velocity": "v_cond"}, name="dit.cond"),
                    Step(UNCOND_NODE, "velocity", reads=dit_reads("negative_text"), writes={"velocity": "v_uncond"},
                         name="dit.uncond"),
                ),
                Step("dit", "guide", reads=("latents", "v_cond", "v_uncond"), writes="latents"),
            )
        else:
            denoise = Step("dit", "step", reads={**dit_reads("text"), "negative_text": "negative_text"},
                           writes="latents")
        encoders = [  # one rank, one plan: both prompts in one text-encoder batch
            Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes="text"),
            Step("text_encoder", reads={"prompt_ids": "negative_ids", "prompt_mask": "negative_mask"},
                 writes={"text": "negative_text"}, name="text_encoder.negative"),
        ]
        if edit:
            encoders.append(Step("vae", "encode", reads="reference_pixels", writes="references"))
        return Walk(GUIDED_WALKS[plain.name], Sequential(
            Parallel(*encoders),
            Loop(denoise, max_iters="num_steps", progress=True),
            Step("vae", "decode", reads="latents", writes="image", emit=Emit("image", "image")),
        ), inputs=(*plain.inputs, "negative_ids", "negative_mask"))

    # -------------------------------------------------------------- frontend
    def load_frontend(self) -> None:
        super().load_frontend()
        self.negative = self.text.tokenize(NEGATIVE_PROMPT)

    def prepare_image(self, spec: ImageSpec, index: int = 0) -> WalkRequest:
        scale = self.knobs.guidance_scale if spec.guidance_scale is None else _scale(spec.guidance_scale)
        if scale is None:
            raise RequestError("guidance_scale", GUIDANCE_RULE)
        request = super().prepare_image(dataclasses.replace(spec, guidance_scale=None), index)
        if scale == 1:
            return request
        if request.walk not in GUIDED_WALKS:
            raise RequestError("guidance_scale", f"walk {request.walk!r} has no guided form; send guidance_scale 1")
        ids, mask = self.negative
        inputs = {**request.inputs, "negative_ids": ids, "negative_mask": mask}
        params = {**request.params, "guidance_scale": scale}
        return WalkRequest(GUIDED_WALKS[request.walk], inputs, params, request.cost, request.prompt_tokens)

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        """The distilled model's engines; ``dit_uncond`` is the DiT's engine (shared with
        ``dit`` when both are on this rank: one copy of the weights)."""
        wanted = set(nodes) - {UNCOND_NODE}
        if UNCOND_NODE in nodes:
            wanted.add("dit")
        engines = super().build_engines(wanted, device)
        if UNCOND_NODE in nodes:
            engines[UNCOND_NODE] = engines["dit"]
            if "dit" not in nodes:
                del engines["dit"]
        return engines
