"""Record the EarTTS talker and codec fixtures from NeMo's reference modules.

nemo-toolkit 3.0.0 does not install beside this project's torch, so its two module files
(``speechlm2/modules/ear_tts_model.py`` and ``ear_tts_vae_codec.py``) are imported directly,
with the few NeMo helpers they name stubbed (a logger, the fp32 context, the tokenizer type)
and ``librosa`` (used only for mel filterbanks, which decoding never builds) stubbed too.
They need ``omegaconf``, which lives in a separate site directory, not in the project venv:

    pip download nemo-toolkit==3.0.0 --no-deps -d /tmp/eartts-src
    (cd /tmp/eartts-src && unzip -q nemo_toolkit-3.0.0-*.whl)
    pip install --target /tmp/eartts-ref/site omegaconf==2.3.0
    PYTHONPATH=$PWD:/tmp/eartts-ref/site NEMO_SRC=/tmp/eartts-src python tests/model/eartts/record_reference.py

The talker's character-aware text encoder is replaced by a lookup (the ``on``/``off`` tables
the port reads), so the fixtures check everything downstream of a token's text embedding.
The sampling noise the reference draws (``gumbel_like``, ``torch.randn_like``) is recorded so
the port can be fed the same draws.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent
OUT = HERE / "fixtures" / "eartts_reference.pt"
TEXT_OUT = HERE / "fixtures" / "eartts_text_reference.pt"

TTS_CONFIG = {
    "use_gated_fusion_for_text_audio": True,
    "disable_eos_prediction": True,
    "use_bos_eos_emb": True,
    "use_subword_flag_emb": True,
    "use_audio_prompt_frozen_projection": True,
    "backbone_type": "gemma3_text",
    "backbone_config": {
        "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 18, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "use_cache": True,
    },
    "latent_size": 32, "codebook_size": 16, "num_quantizers": 6, "context_hidden_size": None,
    "cas_config": None,
    "mog_head_config": {"intermediate_size": 64, "num_layers": 2, "low_rank": 8, "num_predictions": 16,
                        "min_log_std": -4.0, "eps": 1e-6},
    "random_target_masking": False, "exponent": 3.0,
}
CODEC_CONFIG = {
    "latent_size": 32, "n_fft": 16, "hop_length": 4, "base_hidden_size": 8, "channel_mult": [1, 2, 4],
    "rates": [7, 7, 9], "num_blocks": 2, "kernel_size": 7, "groups": 1, "codebook_size": 16,
    "num_quantizers": 6, "wav_to_token_ratio": 1764,
}
GENERATION = {"num_iter": 8, "guidance_scale": 0.5, "top_p_or_k": 0.8, "noise_scale": 0.8, "eos_threshold": -3.0}
VOCAB = 20
WARMUP = 7
STEPS = 4


def _stub_nemo() -> None:
    def module(name: str, **attrs) -> None:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    class _Log:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    for name in ("nemo", "nemo.collections", "nemo.collections.common", "nemo.collections.speechlm2",
                 "nemo.collections.speechlm2.parts"):
        module(name)
    module("nemo.collections.common.tokenizers", AutoTokenizer=object)
    module("nemo.collections.speechlm2.parts.precision", fp32_precision=contextlib.nullcontext)
    module("nemo.collections.speechlm2.parts.pretrained", set_model_dict_for_partial_init=None)
    module("nemo.utils", logging=_Log())
    module("librosa")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Table(nn.Module):
    def __init__(self, on: torch.Tensor, off: torch.Tensor) -> None:
        super().__init__()
        self.on, self.off = on, off  # plain attributes: not in the state dict

    def forward(self, ids, mask):
        return torch.where(mask[..., None], self.on[ids], self.off[ids])


def _randomize(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            std = p.shape[1] ** -0.5 if p.dim() >= 2 else 0.3
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def main():
    src = Path(os.environ.get("NEMO_SRC", "/tmp/eartts-src")) / "nemo/collections/speechlm2/modules"
    import transformers  # before the stubs: it probes for librosa
    from omegaconf import DictConfig

    _stub_nemo()

    tts = _load("ear_tts_model", src / "ear_tts_model.py")
    vae = _load("ear_tts_vae_codec", src / "ear_tts_vae_codec.py")
    torch.manual_seed(0)
    codec = vae.RVQVAEModel(DictConfig(CODEC_CONFIG)).eval()
    model = tts.RVQEARTTSModel(DictConfig(TTS_CONFIG)).eval()
    _randomize(codec, 1)
    _randomize(model, 2)
    with torch.no_grad():
        for mus in codec.prvq.mus_list:
            mus.mul_(2.0)
    model.set_rvq_embs(torch.stack([m.detach() for m in codec.prvq.mus_list], 0))
    hidden = TTS_CONFIG["backbone_config"]["hidden_size"]
    gen = torch.Generator().manual_seed(3)
    text_on, text_off = torch.randn(VOCAB, hidden, generator=gen), torch.randn(VOCAB, hidden, generator=gen) * 0.1
    model.embed_subword = _Table(text_on, text_off)

    batch, q, cb = 2, TTS_CONFIG["num_quantizers"], TTS_CONFIG["codebook_size"]
    code = torch.randint(0, cb, (batch, WARMUP, q), generator=gen)
    code[:, 0] = cb
    audio_mask = torch.zeros(batch, WARMUP, dtype=torch.bool)
    audio_mask[:, -2:] = True
    code[:, WARMUP - 2] = cb
    subword_mask = torch.zeros(batch, WARMUP, dtype=torch.bool)
    subword_mask[:, -3:] = True
    subword_ids = torch.randint(0, VOCAB, (batch, WARMUP), generator=gen)
    prompt_latent = torch.randn(batch, WARMUP, hidden, generator=gen)
    step_ids = torch.randint(0, VOCAB, (batch, STEPS), generator=gen)

    noise: list[tuple[str, torch.Tensor]] = []
    gumbel = tts.gumbel_like

    def recorded_gumbel(x, eps=1e-8):
        out = gumbel(x, eps)
        noise.append(("gumbel", out.clone()))
        return out

    randn_like = torch.randn_like

    def recorded_randn_like(x, *args, **kwargs):
        out = randn_like(x, *args, **kwargs)
        noise.append(("gauss", out.clone()))
        return out

    tts.gumbel_like = recorded_gumbel
    torch.manual_seed(4)
    with torch.no_grad():
        out = model(code=code, audio_mask=audio_mask, subword_ids=subword_ids, subword_mask=subword_mask,
                    non_prompt_mask=audio_mask, use_cache=True, guidance_enabled=True,
                    audio_prompt_lantent=prompt_latent)
        warm_hidden = out.hidden_states.clone()
        cache = out.past_key_values
        prev = code[:, -1:]
        step_hidden, step_codes, step_noise = [], [], []
        for t in range(STEPS):
            noise.clear()
            torch.randn_like = recorded_randn_like
            try:
                out = model(code=prev, subword_ids=step_ids[:, t:t + 1],
                            subword_mask=torch.ones(batch, 1, dtype=torch.bool), past_key_values=cache,
                            use_cache=True, guidance_enabled=True, generation_config=dict(GENERATION),
                            ignore_eos_flag_stop=True)
            finally:
                torch.randn_like = randn_like
            cache = out.past_key_values
            prev = out.codes
            step_hidden.append(out.hidden_states[:, 0].clone())
            step_codes.append(out.codes[:, 0].clone())
            step_noise.append({
                "gumbel": torch.stack([n[:, 0] for kind, n in noise if kind == "gumbel"]),
                "gauss": torch.stack([n[:, 0] for kind, n in noise if kind == "gauss"]),
            })
        codes = torch.stack(step_codes, 1)  # [B, STEPS, Q]
        extra = torch.randint(0, cb, (batch, 3, q), generator=gen)
        all_codes = torch.cat([codes, extra], 1)
        pcm, _ = codec.decode(all_codes, torch.full((batch,), all_codes.shape[1]))

    state = {"tts_model.tts_model." + k: v for k, v in model.state_dict().items()}
    state.update({"tts_model.audio_codec." + k: v for k, v in codec.state_dict().items()
                  if not k.startswith("encoder.") or k == "encoder.layers.0.weight"})
    state["tts_model.audio_prompt_latents.tiny"] = prompt_latent[:1].clone()
    state["tts_model.codec_silence_tokens"] = torch.arange(q) % cb
    OUT.parent.mkdir(exist_ok=True)
    torch.save({
        "versions": {"nemo-toolkit": "3.0.0", "torch": str(torch.__version__),
                     "transformers": str(transformers.__version__)},
        "config": {"model": {"tts_config": TTS_CONFIG, "codec_config": CODEC_CONFIG,
                             "inference_guidance_scale": GENERATION["guidance_scale"],
                             "inference_top_p_or_k": GENERATION["top_p_or_k"],
                             "inference_noise_scale": GENERATION["noise_scale"]},
                   "data": {"target_sample_rate": 22050, "frame_length": 0.08}},
        "state": state, "text_on": text_on, "text_off": text_off,
        "warmup": {"code": code, "audio_mask": audio_mask, "subword_ids": subword_ids,
                   "subword_mask": subword_mask, "prompt_latent": prompt_latent, "hidden": warm_hidden},
        "steps": {"ids": step_ids, "hidden": torch.stack(step_hidden, 1), "codes": codes, "noise": step_noise},
        "codec": {"codes": all_codes, "pcm": pcm[:, 0]},
    }, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); codes {codes.tolist()}")
    return tts


CAS_CONFIG = {"backbone_type": "t5gemma", "backbone_config": {
    "is_encoder_decoder": False,
    "encoder": {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 16, "use_cache": False}}}
# A made-up tokenizer: single characters (the character vocabulary), words, a token with no
# known character ("x?"), BOS/EOS.
TOKENS = ["<s>", "</s>", "<pad>", "a", "b", "c", "d", "e", "\u2581", "\u2581a", "\u2581ab", "bc", "cde", "\u2581dead",
          "ea", "\u00e9", "x?", "\u2581bead", "ab", "<unk>"]


class _Tokenizer:
    """The attributes of NeMo's ``AutoTokenizer`` the text encoder reads."""

    def __init__(self) -> None:
        self.vocab = {tok: i for i, tok in enumerate(TOKENS)}
        self.tokenizer = types.SimpleNamespace(vocab=self.vocab, get_vocab=lambda: dict(self.vocab))
        self.vocab_size = len(TOKENS)
        self.bos_token, self.eos_token = "<s>", "</s>"

    def ids_to_tokens(self, i: int) -> str:
        return TOKENS[i]


def record_text_encoder(tts) -> None:
    """The character-aware subword encoder over every token (all spoken), and with a mask."""
    from omegaconf import DictConfig

    torch.manual_seed(5)
    cas = tts.CharAwareSubwordEncoder(out_size=64, tokenizer=_Tokenizer(), vocab_dir=None, backbone_type="t5gemma",
                                      backbone_config=DictConfig(CAS_CONFIG["backbone_config"]),
                                      use_subword_flag_emb=True, use_bos_eos_emb=True).eval()
    _randomize(cas, 6)
    ids = torch.arange(len(TOKENS))[None]
    mask = (torch.arange(len(TOKENS)) % 3 != 0)[None]
    with torch.no_grad():
        spoken = cas(ids, torch.ones_like(mask))[0]
        masked = cas(ids, mask)[0]
    torch.save({"cas_config": CAS_CONFIG, "tokens": TOKENS, "mask": mask[0], "spoken": spoken, "masked": masked,
                "state": {"tts_model.tts_model.embed_subword." + k: v for k, v in cas.state_dict().items()}},
               TEXT_OUT)
    print(f"wrote {TEXT_OUT} ({TEXT_OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    record_text_encoder(main())
