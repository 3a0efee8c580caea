"""BAGEL's reference code (``bagel2``, the official BAGEL modules repackaged) made importable
and exact on the CPU, and tiny random BAGEL models built from it.

``bagel2`` imports ``flash_attn`` at module level. ``install_flash_attn_stand_in`` puts a
test-only module of that name into ``sys.modules`` whose ``flash_attn_varlen_func`` has the
real signature and computes each packed sequence (from ``cu_seqlens_q`` / ``cu_seqlens_k``)
with ``scaled_dot_product_attention``; ``causal`` follows flash-attn's convention for a query
block shorter than its keys (the mask is aligned to the bottom right: query ``i`` of ``n``
sees the first ``L - n + i + 1`` of ``L`` keys).

The reference casts queries, keys and values to bfloat16 right before the attention call
(flash-attn takes half types only) and some of its generation-mode rows too. A float32
parity test would then compare against bfloat16 roundings (~1e-3). So the two modules that
do it (``qwen2_navit``, ``siglip_navit``) see, as their ``torch`` global, a view of torch
whose ``bfloat16`` is ``float32``: every other name is torch's own. With the model in
float32 the reference then computes exactly what it computes in bfloat16 on a GPU, without
the roundings. bagel2's Qwen2 rotary embedding also looks up ``"default"`` RoPE, which
transformers 5 dropped: its module's table gets that entry back. Nothing else of bagel2
is changed.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn's variable-length attention by SDPA: ``q [Tq, H, D]``, ``k``/``v [Tk, Hkv, D]``,
    the sequences delimited by the cumulative lengths. Returns ``[Tq, H, D]``."""
    if dropout_p or softcap or alibi_slopes is not None or window_size != (-1, -1) or block_table is not None:
        raise NotImplementedError("the flash_attn stand-in does plain attention only")
    out = torch.empty_like(q)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        q_lo, q_hi, k_lo, k_hi = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        n, length = q_hi - q_lo, k_hi - k_lo
        mask = None
        if causal:
            rows, cols = torch.arange(n, device=q.device), torch.arange(length, device=q.device)
            mask = cols[None, :] <= rows[:, None] + (length - n)
        o = F.scaled_dot_product_attention(q[q_lo:q_hi].transpose(0, 1), k[k_lo:k_hi].transpose(0, 1),
                                           v[k_lo:k_hi].transpose(0, 1), attn_mask=mask, scale=softmax_scale,
                                           enable_gqa=q.shape[1] != k.shape[1])
        out[q_lo:q_hi] = o.transpose(0, 1)
    return out


def install_flash_attn_stand_in() -> None:
    """Put the stand-in ``flash_attn`` into ``sys.modules`` unless one is there already.

    transformers and diffusers probe for flash-attn (``importlib.util.find_spec``, which a
    module without a spec fails) when first imported (``transformers.modeling_utils``,
    ``diffusers.utils``): both are imported before, so their probes see no flash-attn, as
    they should, whichever test imports them later in the same process."""
    if "flash_attn" in sys.modules:
        return
    import transformers.modeling_utils  # noqa: F401

    try:
        import diffusers.utils  # noqa: F401
    except ImportError:  # not a dependency of the BAGEL tests themselves
        pass

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.__doc__ = "test-only stand-in (tests/support/bagel_reference.py)"
    sys.modules["flash_attn"] = module


class _Float32Torch(types.ModuleType):
    """torch with ``bfloat16`` read as ``float32`` (see the module docstring)."""

    bfloat16 = torch.float32

    def __getattr__(self, name):
        return getattr(torch, name)


install_flash_attn_stand_in()

from bagel2.modeling.bagel import bagel as _bagel  # noqa: E402
from bagel2.modeling.bagel import qwen2_navit, siglip_navit  # noqa: E402
from bagel2.modeling.bagel.bagel import Bagel, BagelConfig  # noqa: E402
from bagel2.modeling.bagel.qwen2_navit import NaiveCache, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from bagel2.modeling.bagel.siglip_navit import SiglipVisionConfig, SiglipVisionModel  # noqa: E402
from bagel2.modeling.qwen2 import modeling_qwen2 as _qwen2  # noqa: E402

for _module in (qwen2_navit, siglip_navit):
    _module.torch = _Float32Torch("torch")


def _default_rope(config, device=None, **_):
    """Plain RoPE's inverse frequencies, which transformers 5 no longer lists as ``"default"``
    in ``ROPE_INIT_FUNCTIONS`` (bagel2's Qwen2 rotary embedding looks it up by that name)."""
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


_qwen2.ROPE_INIT_FUNCTIONS = {**_qwen2.ROPE_INIT_FUNCTIONS, "default": _default_rope}

__all__ = ["Bagel", "BagelConfig", "NaiveCache", "Qwen2Config", "Qwen2ForCausalLM", "SiglipVisionConfig",
           "SiglipVisionModel", "TOKENS", "reference_bagel", "randomize", "LLM", "VIT", "VAE", "BAGEL"]

# ---------------------------------------------------------------------------- tiny configs
from tests.support.bagel_tokenizer import NAMED, TOKENS, VOCAB, tokenizer  # noqa: E402

LLM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
           tie_word_embeddings=False, qk_norm=True, layer_module="Qwen2MoTDecoderLayer", pad_token_id=None)
"""The language model as BAGEL-7B-MoT's ``llm_config.json`` shapes it (Qwen2, MoT layers,
q/k norms), tiny: head_dim 16, grouped-query attention 4 over 2."""

VIT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_channels=3,
           image_size=32, patch_size=4, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, rope=False)
"""SigLIP NaViT as BAGEL runs it: learned position embeddings (``rope`` off), a patch grid of
up to 8 x 8."""

VAE = types.SimpleNamespace(downsample=8, z_channels=4)
"""What ``Bagel`` reads of the FLUX VAE's config (the latent patch shapes)."""

BAGEL = dict(visual_gen=True, visual_und=True, latent_patch_size=2, max_latent_size=8, vit_max_num_patch_per_side=8,
             connector_act="gelu_pytorch_tanh", interpolate_pos=False, timestep_shift=1.0)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every trained parameter drawn again (norm scales around 1, the rest small), so no weight
    is left at an initialisation a wrong port could also reproduce (zeros, ones). The fixed
    2D sine-cosine tables (``*pos_embed``) keep their values, as in every BAGEL checkpoint."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("pos_embed"):
                continue  # BAGEL's fixed sine-cosine tables, never trained
            else:
                p.copy_((0.2 if p.ndim == 1 else 0.1) * noise)


def reference_bagel(seed: int = 0, llm: dict | None = None, vit: dict | None = None,
                    bagel: dict | None = None) -> Bagel:
    """A tiny random ``Bagel`` in eval mode and float32, built as the released inference code
    builds it (MoT layers, q/k norms, ViT rope off, its patch embedding a linear layer over
    ``(p, p, c)``-flattened patches)."""
    llm_config = Qwen2Config(**(llm or LLM))
    vit_config = SiglipVisionConfig(**(vit or VIT))
    config = BagelConfig(llm_config=llm_config, vit_config=vit_config, vae_config=VAE, **(bagel or BAGEL))
    torch.manual_seed(seed)
    model = Bagel(Qwen2ForCausalLM(llm_config), SiglipVisionModel(vit_config), config)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit_config)
    randomize(model, seed)
    return model.eval().float()


_ = _bagel  # the module the generation side's helpers reach (prepare_vae_latent and friends)


# ---------------------------------------------------------------------------- driving a chat
class IdTokenizer:
    """A tokenizer for prompts given as token ids already (what ``prepare_prompts`` encodes)."""

    def encode(self, prompt):
        return list(prompt)


def reference_chat_logits(model: Bagel, blocks: list, steps: int) -> tuple[torch.Tensor, list[int]]:
    """The reference's understanding path as its inferencer runs it: ``blocks`` in order, an
    image (``[3, H, W]``, already normalised, sides multiples of the patch) through
    ``forward_cache_update_vit``, a text (a list of token ids, wrapped by the reference in
    ``<|im_start|> … <|im_end|>``) through ``forward_cache_update_text``; then ``generate_text``
    greedily from ``<|im_start|>`` for ``steps`` tokens. Returns the logits of every decode step
    ``[steps, vocab]`` (read off ``lm_head``) and the tokens it fed (the start token, then the
    argmaxes)."""
    cache = NaiveCache(model.config.llm_config.num_hidden_layers)
    lens, ropes = [0], [0]
    with torch.no_grad():
        for block in blocks:
            if isinstance(block, torch.Tensor):
                inputs, lens, ropes = model.prepare_vit_images(lens, ropes, [block], lambda x: x, TOKENS)
                cache = model.forward_cache_update_vit(cache, **inputs)
            else:
                inputs, lens, ropes = model.prepare_prompts(lens, ropes, [block], IdTokenizer(), TOKENS)
                cache = model.forward_cache_update_text(cache, **inputs)
        start = model.prepare_start_tokens(lens, ropes, TOKENS)
        logits = []
        hook = model.language_model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out))
        try:
            fed = model.generate_text(cache, max_length=steps, do_sample=False, end_token_id=None, **start)
        finally:
            hook.remove()
    return torch.cat(logits), fed[:, 0].tolist()


# ---------------------------------------------------------------------------- a checkpoint dir
def write_checkpoint(directory, model: Bagel | None = None, tensors: dict | None = None):
    """``model`` (default ``reference_bagel()``) as a directory laid out like the hub snapshot
    of BAGEL-7B-MoT: ``llm_config.json``, ``vit_config.json`` (one ViT layer more than the
    model runs, as released), ``config.json``, the tokenizer, and ``ema.safetensors`` with
    every tensor of the model (or ``tensors`` instead)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    model = model if model is not None else reference_bagel()
    llm = dict(LLM, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    vit = dict(VIT, num_hidden_layers=VIT["num_hidden_layers"] + 1, model_type="siglip_vision_model")
    (directory / "llm_config.json").write_text(json.dumps(llm))
    (directory / "vit_config.json").write_text(json.dumps(vit))
    top = {k: BAGEL[k] for k in ("vit_max_num_patch_per_side", "latent_patch_size", "max_latent_size")}
    (directory / "config.json").write_text(json.dumps(top))
    tok = tokenizer()
    tok.save_pretrained(directory)
    assert [tok.convert_tokens_to_ids(n) for n in NAMED.values()] == list(NAMED)
    state = tensors if tensors is not None else model.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "ema.safetensors"))
    return directory
