"""Pi0.5's deployment knobs and a request's options (``/generate``'s ``model_kwargs``)."""

from __future__ import annotations

from pydantic import Field

from mstar.model.knobs import Compile, CudaGraphs, RequestKnobs


class Pi05Knobs(CudaGraphs, Compile):
    """``compile``: the action expert's and the prefix's dense blocks (norms, MLPs) under
    ``torch.compile`` (``mstar.model.pi05.fast``; the attention stays eager); ``cuda_graphs``: each denoise step
    replayed from a CUDA graph per batch and key-length bucket, each prefill per batch bucket,
    image count and prompt bucket (``mstar.model.pi05.engine``); eager is the reference."""

    num_inference_steps: int | None = Field(None, ge=1, le=100)
    """Euler steps of a request that does not send ``num_inference_steps`` (None: the
    checkpoint config's, 10 for pi05_base)."""

    tokenizer: str | None = None
    """PaliGemma's tokenizer (a hub id or a directory) when the checkpoint has none of its own
    (None: ``google/paligemma-3b-pt-224``, as lerobot)."""

    embodiments: dict[str, str] = Field(default_factory=dict)
    """Further robots' normalisation statistics: name -> a lerobot policy directory whose
    ``policy_preprocessor.json`` / ``policy_postprocessor.json`` hold them. A request picks one
    with ``embodiment``; without it, the checkpoint's own statistics apply."""


class Pi05Request(RequestKnobs):
    """``model_kwargs`` of one ``/generate`` request for actions."""

    state: list[float]
    """The robot's state, unnormalised, as many values as the embodiment's state has."""

    seed: int | None = Field(None, ge=0)
    """The seed of the initial noise (None: a fresh one)."""

    num_inference_steps: int | None = Field(None, ge=1, le=100)
    """Euler steps of the flow (None: the deployment's)."""

    embodiment: str = ""
    """Whose statistics normalise the state and unnormalise the actions ("" the checkpoint's)."""
