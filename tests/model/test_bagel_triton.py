"""BAGEL's image generator on the Triton attention backend against the torch path: the contexts
(text causal, an image's latent tokens both ways) and the denoise steps' queries (the noisy
image both ways, over each CFG context) through ``mstar.layers.triton_attention``.

Without a GPU the kernels run on CPU tensors under Triton's interpreter, in float32: the
interpreter is set before ``mstar.layers.triton_attention`` is first imported; when something
else imported Triton first in this session, the kernel tests skip here and
``test_kernels_in_a_fresh_interpreter`` runs this file again in a process of its own. On a GPU
the same tests run compiled, and ``test_generation_in_bfloat16_on_the_gpu`` runs a bfloat16
image of 16 x 16 latent tokens. Skipped without Triton.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import (  # first: before anything imports Triton
    DEVICE,
    REASON,
    index_interpreted_scalars,
    kernels_runnable,
    rerun_in_fresh_interpreter,
)

# isort: split
from mstar.layers import triton_attention  # noqa: E402
from mstar.layers.paged_kv import allocate_kv_cache  # noqa: E402
from mstar.model.bagel.config import BagelLLMConfig  # noqa: E402
from mstar.model.bagel.flow import (  # noqa: E402
    ImageContexts,
    KVContext,
    extend,
    generate_latents,
    latent_segment,
    text_segment,
)
from mstar.model.bagel.generation import CfgOptions, LatentProjections, latent_position_ids  # noqa: E402
from mstar.model.bagel.llm import BagelLanguageModel  # noqa: E402
from mstar.model.bagel.prompt import SpecialTokens  # noqa: E402
from tests.support.markers import needs_cuda  # noqa: E402

RUNNABLE = kernels_runnable(triton_attention)
runnable = pytest.mark.skipif(not RUNNABLE, reason=REASON)

PAGE = 16
TOKENS = SpecialTokens(90, 91, 92, 93)
LLM = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
           tie_word_embeddings=False, qk_norm=True)
CHANNELS, MAX_LATENT = 4, 16


if RUNNABLE and triton_attention.INTERPRET:
    index_interpreted_scalars()


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn (norm scales around 1, the rest at 0.1 to 0.2), large enough that
    attention over a wrong set of keys shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, device="cpu")  # the CPU stream on any device
            p.copy_(1.0 + 0.1 * noise if "norm" in name else (0.2 if p.ndim == 1 else 0.1) * noise)
    return module


def models(dtype: torch.dtype):
    with torch.device(DEVICE):
        llm = randomized(BagelLanguageModel(BagelLLMConfig.from_hf_dict(LLM)), 1).to(dtype).eval()
        proj = randomized(LatentProjections(LLM["hidden_size"], CHANNELS, 2, MAX_LATENT), 2).to(dtype).eval()
    return llm, proj


def generate(backend: str, dtype: torch.dtype, side: int, steps: int, edit: bool) -> torch.Tensor:
    """One image's latents: its contexts built and its denoise loop run with ``backend``. With
    ``edit`` the contexts hold an input image's clean latent tokens (both ways) before the text,
    and the loop takes three CFG variants; else text to image (two)."""
    llm, proj = models(dtype)
    layers, heads, head_dim = llm.cache_shape()
    gen = torch.Generator().manual_seed(side + edit)
    tokens = side * side
    per_context = 2 * (tokens + 40) // PAGE + 2  # a context's tokens and its flow queries' scratch
    kv = allocate_kv_cache(layers, 3 * per_context, PAGE, heads, head_dim, dtype, DEVICE)
    positions = latent_position_ids(side, side, MAX_LATENT).to(DEVICE)
    pages = iter(range(3 * per_context))

    def context() -> KVContext:
        return KVContext([next(pages) for _ in range(per_context)])

    text = text_segment(llm, [5, 17, 33, 2, 64, 8, 41, 12, 7], TOKENS)
    full, no_text = context(), context()
    no_image = context() if edit else None
    if edit:
        image = latent_segment(llm, proj, torch.randn(tokens, 4 * CHANNELS, generator=gen), 0.0, positions, TOKENS)
        extend(llm, kv, PAGE, [(full, image), (no_text, image)], backend)
    extend(llm, kv, PAGE, [(full, text)] + ([(no_image, text)] if edit else []), backend)
    noise = torch.randn(tokens, 4 * CHANNELS, generator=gen).to(DEVICE)
    cfg = CfgOptions(text_scale=4.0, img_scale=2.0 if edit else 1.5, interval=(0.0, 1.0))
    with torch.no_grad():
        return generate_latents(llm, proj, kv, PAGE, ImageContexts(full, no_text, no_image), noise, positions,
                                TOKENS, num_timesteps=steps, shift=3.0, cfg=cfg, backend=backend)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.slow  # a whole pytest process of its own
@pytest.mark.skipif(RUNNABLE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter() -> None:
    rerun_in_fresh_interpreter(__file__, allow_skips=True)  # the bf16 GPU test skips on the CPU


@runnable
@pytest.mark.parametrize("edit", [False, True])
def test_generation_matches_torch(edit: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    want = generate("torch", torch.float32, 4, 3, edit)
    calls = []
    kernel = triton_attention.triton_paged_attention
    monkeypatch.setattr(triton_attention, "triton_paged_attention",
                        lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs))
    got = generate("triton", torch.float32, 4, 3, edit)
    assert len(calls) == LLM["num_hidden_layers"] * ((2 if edit else 1) + 2)  # per layer: the contexts, 2 steps
    err = rel_err(got, want)
    print(f"[triton] edit={edit}: max rel err {err:.2e}")
    assert err <= 1e-5


@needs_cuda(triton=True)
def test_generation_in_bfloat16_on_the_gpu() -> None:
    """In bf16 both backends drift from the float32 latents by rounding that four guided steps
    amplify (the two bf16 results were 3.6e-2 of peak apart on an H100, 2026-12-07): the
    Triton kernel's drift is held to the torch path's."""
    exact = generate("torch", torch.float32, 16, 4, True)
    torch_err = rel_err(generate("torch", torch.bfloat16, 16, 4, True), exact)
    triton_err = rel_err(generate("triton", torch.bfloat16, 16, 4, True), exact)
    print(f"[triton] bf16 drift from float32: torch {torch_err:.2e}, triton {triton_err:.2e}")
    assert triton_err <= 2 * torch_err + 1e-3


def test_engine_refuses_an_unknown_backend() -> None:
    from mstar.model.bagel.image_engine import BagelImageEngine

    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        BagelImageEngine(None, None, None, TOKENS, num_pages=1, page_size=PAGE, device=torch.device("cpu"),
                         dtype=torch.float32, attention_backend="flash")
