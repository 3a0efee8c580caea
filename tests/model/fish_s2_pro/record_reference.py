"""Record the dual-AR parity fixtures from fish-speech, the reference network.

``dual_ar.pt`` comes from fish-speech 0.1.0 (PyPI: the S1 form, the fast AR on the slow AR's
pre-norm state); ``dual_ar_s2.pt`` (``--s2``) from the GitHub source at 3dd1f85 (2026-04-07),
which carries S2's settings: the ``fish_qwen3_omni`` config (written here in that nested
form), codebook embeddings scaled, the fast AR on the final-normed state
(``norm_fastlayer_input``), and S2's tensor names (``text_model.model.*``,
``audio_decoder.*``). For ``--s2`` put ``git archive 3dd1f85 fish_speech`` of
github.com/fishaudio/fish-speech on the path instead of the wheel.

fish-speech pins numpy<=1.26 and other packages that do not sit beside this project, so it
is installed apart, without dependencies, and put on the path by hand:

    pip download fish-speech==0.1.0 --no-deps -d /tmp/fishref
    unzip /tmp/fishref/fish_speech-0.1.0-py3-none-any.whl -d /tmp/fishref/src
    pip install --no-deps --target /tmp/fishdeps tiktoken loguru einops loralib
    PYTHONPATH=/tmp/fishref/src:/tmp/fishdeps:$PWD python tests/model/fish_s2_pro/record_reference.py

It builds ``DualARTransformer`` on a tiny random config (fp32, seed 0), replaces its RoPE
tables (stored in bf16 by the reference) by fp32 ones of the same angles, and drives its own
``forward_generate`` / ``forward_generate_fast`` greedily (the slow token restricted to the
semantic tokens, so every step makes a frame): a prefill over a prompt of text tokens and
two prompt frames, then ``STEPS`` decode steps with the reference's fast AR loop. It writes
the released-layout state dict, the config, the prompt, and every step's slow logits, fast
logits and frame codes to ``fixtures/dual_ar.pt``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from fish_speech.models.text2semantic.llama import DualARModelArgs, DualARTransformer

S2 = "--s2" in sys.argv
OUT = Path(__file__).parent / "fixtures" / ("dual_ar_s2.pt" if S2 else "dual_ar.pt")
STEPS = 6
CONFIG = dict(model_type="dual_ar", vocab_size=96, n_layer=2, n_head=4, n_local_heads=2, dim=32, head_dim=8,
              intermediate_size=48, rope_base=10000.0, norm_eps=1e-6, max_seq_len=64, attention_qk_norm=True,
              tie_word_embeddings=True, codebook_size=16, num_codebooks=4, scale_codebook_embeddings=True,
              n_fast_layer=2, fast_dim=24, fast_n_head=2, fast_n_local_heads=1, fast_head_dim=12,
              fast_intermediate_size=40, use_gradient_checkpointing=False)
SEMANTIC_BEGIN = 70  # <|semantic:0|> .. <|semantic:15|> are ids 70 .. 85


def main() -> None:
    torch.manual_seed(0)
    size = CONFIG["codebook_size"]
    extra = dict(semantic_begin_id=SEMANTIC_BEGIN, semantic_end_id=SEMANTIC_BEGIN + size - 1,
                 norm_fastlayer_input=True) if S2 else {}
    args = DualARModelArgs(**CONFIG, **extra)
    n = args.num_codebooks
    tokenizer = SimpleNamespace(semantic_id_to_token_id={i: SEMANTIC_BEGIN + i for i in range(size)},
                                semantic_begin_id=SEMANTIC_BEGIN, semantic_end_id=SEMANTIC_BEGIN + size - 1)
    takes_tokenizer = "tokenizer" in inspect.signature(DualARTransformer.__init__).parameters
    model = (DualARTransformer(args, tokenizer) if takes_tokenizer else DualARTransformer(args)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # scales that make every part matter
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    model.freqs_cis = _fp32_table(args.max_seq_len, args.head_dim, args.rope_base)
    model.fast_freqs_cis = _fp32_table(n, args.fast_head_dim, args.rope_base)
    model.setup_caches(1, args.max_seq_len, dtype=torch.float32)

    text = [1, 5, 9, 33, 2]
    prompt_tokens = torch.tensor([*text, SEMANTIC_BEGIN + 3, SEMANTIC_BEGIN + 11, 7])
    prompt_codes = torch.zeros(len(prompt_tokens), n, dtype=torch.int64)
    prompt_codes[5] = torch.tensor([3, 1, 15, 6])
    prompt_codes[6] = torch.tensor([11, 0, 4, 9])
    inp = torch.cat((prompt_tokens[None], prompt_codes.t()))[None]  # [1, 1 + N, T]

    slow_logits, fast_logits, frames = [], [], []
    pos = torch.arange(inp.shape[-1])
    with torch.no_grad():
        for _ in range(STEPS + 1):
            out = model.forward_generate(inp, pos)
            logits = out.logits[0, -1]
            slow_logits.append(logits.clone())
            token = SEMANTIC_BEGIN + int(logits[SEMANTIC_BEGIN:SEMANTIC_BEGIN + size].argmax())
            codes, books = _fast_frame(model, out.hidden_states[:, -1], token - SEMANTIC_BEGIN)
            fast_logits.append(books)
            frames.append(codes)
            inp = torch.tensor([token, *codes.tolist()])[None, :, None]
            pos = pos[-1:] + 1
    state = {k: v.clone() for k, v in model.state_dict().items() if "freqs_cis" not in k
             and "causal_mask" not in k and "kv_cache" not in k}
    config = {k: v for k, v in dataclasses.asdict(args).items() if k in CONFIG and k != "use_gradient_checkpointing"}
    version = "fish-speech 0.1.0"
    if S2:
        config, state = s2_release(config, state), s2_names(state)
        version = "fish-speech GitHub 3dd1f85"
    OUT.parent.mkdir(exist_ok=True)
    torch.save({"version": version, "config": config, "semantic_begin_id": SEMANTIC_BEGIN,
                "state_dict": state, "prompt_tokens": prompt_tokens, "prompt_codes": prompt_codes,
                "slow_logits": torch.stack(slow_logits), "fast_logits": torch.stack(fast_logits),
                "codes": torch.stack(frames)}, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


def s2_release(flat: dict, state: dict) -> dict:
    """``flat`` in S2's nested ``fish_qwen3_omni`` config form."""
    fast = {"vocab_size": flat["codebook_size"], "num_codebooks": flat["num_codebooks"],
            "n_layer": flat["n_fast_layer"]}
    fast.update({k[len("fast_"):]: v for k, v in flat.items() if k.startswith("fast_")})
    text = {k: v for k, v in flat.items() if not k.startswith("fast_") and k not in
            ("codebook_size", "num_codebooks", "n_fast_layer", "model_type", "scale_codebook_embeddings")}
    return {"model_type": "fish_qwen3_omni", "semantic_start_token_id": SEMANTIC_BEGIN,
            "semantic_end_token_id": SEMANTIC_BEGIN + flat["codebook_size"] - 1, "text_config": text,
            "audio_decoder_config": fast}


def s2_names(state: dict) -> dict:
    """The flat names as S2 releases them (what fish-speech's ``_remap_fish_qwen3_omni_keys`` undoes)."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("codebook_embeddings."):
            out["audio_decoder." + name] = tensor
        elif name.startswith("fast_"):
            out["audio_decoder." + name[len("fast_"):]] = tensor
        else:
            out["text_model.model." + name] = tensor
    return out


def _fp32_table(length: int, dim: int, base: float) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(length).float(), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def _fast_frame(model: DualARTransformer, hidden: torch.Tensor, code0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's fast AR loop (``decode_one_token_ar``), greedy: the frame's codes and
    the logits of codebooks 1 .. N - 1."""
    for layer in model.fast_layers:
        layer.attention.kv_cache.k_cache.zero_()
        layer.attention.kv_cache.v_cache.zero_()
    model.forward_generate_fast(hidden, torch.tensor([0]))  # hidden: already through fast_project_in
    codes, books = [code0], []
    x = model.fast_embeddings(torch.tensor([code0]))
    for book in range(1, model.config.num_codebooks):
        logits = model.forward_generate_fast(x, torch.tensor([book]))[0, -1]
        books.append(logits.clone())
        codes.append(int(logits.argmax()))
        x = model.fast_embeddings(torch.tensor([codes[-1]]))
    return torch.tensor(codes), torch.stack(books)


if __name__ == "__main__":
    main()
