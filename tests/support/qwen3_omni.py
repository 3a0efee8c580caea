"""Tiny random Qwen3-Omni parts from transformers (the parity references): the thinker and its
weights in the released checkpoint's key layout (``thinker.model.…``, experts stored apart), and
the codec decoder (``code2wav.…``), the talker and the whole model (written as a served
checkpoint directory by ``tests/support/qwen3_omni_dir.py``)."""

from __future__ import annotations

import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeCode2WavConfig,
    Qwen3OmniMoeThinkerConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)

VOCAB = 160
AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN, AUDIO_START, AUDIO_END, VISION_START = 150, 151, 152, 153, 155, 154
VISION_END = 156
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
            mlp_only_layers=[1], rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                             "interleaved": True, "mrope_interleaved": True})
AUDIO = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=48,
             output_dim=64, n_window=50, n_window_infer=200, downsample_hidden_size=8, conv_chunksize=50,
             max_source_positions=100)  # n_window 50: the reference's token count assumes 13 per chunk
VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
# a deeper tower for the vision tests: two deepstack taps (decoder layers 0 and 1 get them) and an
# 8x8 position table, so grids both above and below it are resampled
VISION_DEEP = dict(VISION, depth=3, deepstack_visual_indexes=[0, 2], num_position_embeddings=64)


def reference_thinker(seed: int = 0, vision: dict | None = None) -> Qwen3OmniMoeThinkerForConditionalGeneration:
    config = Qwen3OmniMoeThinkerConfig(text_config=TEXT, audio_config=AUDIO, vision_config=vision or VISION,
                                       audio_token_id=AUDIO_TOKEN, image_token_id=IMAGE_TOKEN,
                                       video_token_id=VIDEO_TOKEN, audio_start_token_id=AUDIO_START,
                                       vision_start_token_id=VISION_START)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight", "ln_post.weight")):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_((0.3 if p.ndim == 1 else 0.1) * noise)
    return model


def released_keys(model: Qwen3OmniMoeThinkerForConditionalGeneration) -> list[tuple[str, torch.Tensor]]:
    """The thinker's tensors under the released names, every expert's projections apart."""
    renamed = {name.replace("model.language_model.", "model.", 1).replace("model.audio_tower.", "audio_tower.", 1)
               .replace("model.visual.", "visual.", 1): tensor for name, tensor in model.state_dict().items()}
    return experts_apart(renamed, "thinker.")


def experts_apart(tensors: dict[str, torch.Tensor], prefix: str) -> list[tuple[str, torch.Tensor]]:
    """``tensors`` under ``prefix``, transformers' stacked experts (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) split into the released per-expert keys."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            for i, rows in enumerate(tensor):
                gate, up = rows.chunk(2, dim=0)
                out += [(f"{prefix}{stem}{i}.gate_proj.weight", gate), (f"{prefix}{stem}{i}.up_proj.weight", up)]
        elif name.endswith("mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            out += [(f"{prefix}{stem}{i}.down_proj.weight", w) for i, w in enumerate(tensor)]
        else:
            out.append((f"{prefix}{name}", tensor))
    return out


# code2wav: 4 quantizers, a 6-frame attention window, one 2x upsampling stage and two decoder
# blocks (4x, 3x): 24 samples a frame, 32 -> 16 -> 8 decoder channels
CODE2WAV = dict(codebook_size=32, num_quantizers=4, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=6, upsampling_ratios=[2],
                upsample_rates=[4, 3], decoder_dim=32)


def reference_code2wav(seed: int = 0) -> Qwen3OmniMoeCode2Wav:
    """A tiny random ``Qwen3OmniMoeCode2Wav``; weights at about ``0.5 / sqrt(fan_in)``, so the
    waveform stays well inside the final clamp (std about 0.04 on random codes)."""
    model = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**CODE2WAV)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(("scale", "gamma")):  # the residual branches' scales: well away from 0
                p.copy_(0.5 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 / p[0].numel() ** 0.5 if p.ndim > 1 else 0.1))
    return model


def released_code2wav_keys(model: Qwen3OmniMoeCode2Wav) -> list[tuple[str, torch.Tensor]]:
    """The codec decoder's tensors under the released names (``code2wav.`` + transformers' own)."""
    return [(f"code2wav.{name}", tensor) for name, tensor in model.state_dict().items()]


# ------------------------------------------------------------------ the talker and its code predictor
TALKER_TEXT = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                   norm_topk_prob=True, shared_expert_intermediate_size=48, rms_norm_eps=1e-6,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                    "interleaved": True})
CODE_PREDICTOR = dict(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_code_groups=5, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# codec ids inside the tiny vocabulary (96: 40 codes and specials above them)
TALKER = dict(num_code_groups=5, thinker_hidden_size=64, spatial_merge_size=2, codec_eos_token_id=90, codec_pad_id=88,
              codec_bos_id=89, codec_nothink_id=91, codec_think_bos_id=92, codec_think_eos_id=93,
              speaker_id={"tiny": 94})


def reference_talker(seed: int = 0):
    """A tiny random transformers talker (``Qwen3OmniMoeTalkerForConditionalGeneration``), with
    weights drawn as ``reference_thinker``'s are."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerForConditionalGeneration

    config = Qwen3OmniMoeTalkerConfig(text_config=TALKER_TEXT, code_predictor_config=CODE_PREDICTOR, **TALKER)
    model = Qwen3OmniMoeTalkerForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_((0.3 if p.ndim == 1 else 0.1) * noise)
    return model


def talker_released_keys(model) -> list[tuple[str, torch.Tensor]]:
    """The talker's tensors under the released names (``talker.…``), every expert apart."""
    return experts_apart(model.state_dict(), "talker.")


# ------------------------------------------------------------------ the whole model (speech out)
# chat-template ids inside the thinker's tiny vocabulary (160; 150 .. 156 are the media tokens)
CHAT = dict(im_start_token_id=140, im_end_token_id=141, system_token_id=142, user_token_id=143,
            assistant_token_id=144, tts_pad_token_id=145, tts_bos_token_id=146, tts_eos_token_id=147)
NEWLINE = 148
# the talker's accept_hidden_layer: the output of the thinker's second of three layers
ACCEPT_HIDDEN_LAYER = 2


def reference_omni(seed: int = 0):
    """A tiny random whole ``Qwen3OmniMoeForConditionalGeneration`` (thinker, talker, code2wav)
    whose parts carry the weights of ``reference_thinker`` / ``reference_talker`` /
    ``reference_code2wav``; code2wav's quantizers are the talker's codebooks (5 of 40)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeTalkerConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    thinker = reference_thinker(seed)
    talker_config = Qwen3OmniMoeTalkerConfig(text_config=TALKER_TEXT, code_predictor_config=CODE_PREDICTOR,
                                             accept_hidden_layer=ACCEPT_HIDDEN_LAYER, **TALKER)
    code2wav = dict(CODE2WAV, codebook_size=CODE_PREDICTOR["vocab_size"], num_quantizers=TALKER["num_code_groups"])
    config = Qwen3OmniMoeConfig(thinker_config=thinker.config.to_dict(), talker_config=talker_config.to_dict(),
                                code2wav_config=code2wav, enable_audio_output=True,
                                **{k: v for k, v in CHAT.items() if k != "im_end_token_id"})
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    model.thinker.load_state_dict(thinker.state_dict())
    model.talker.load_state_dict(reference_talker(seed + 1).state_dict())
    decoder = Qwen3OmniMoeCode2Wav(model.code2wav.config).eval()
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in decoder.named_parameters():  # as reference_code2wav draws them
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(("scale", "gamma")):
                p.copy_(0.5 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 / p[0].numel() ** 0.5 if p.ndim > 1 else 0.1))
    model.code2wav.load_state_dict(decoder.state_dict())
    return model


# ------------------------------------------------------------------ a served checkpoint directory


def greedy_media_worst(text, prompt: list[int], embeds: torch.Tensor, deepstack, positions: torch.Tensor,
                       delta, hf_logits, seed: int, steps: int = 2) -> float:
    """Our thinker's text model (``text``) on paged KV: the prompt's prefill from ``embeds`` (media
    rows spliced in, ``deepstack`` features, 3-axis ``positions``), then ``steps`` greedy decode
    steps at the shifted positions; the worst relative error of its logits against
    ``hf_logits(tokens)`` (the reference's logits of the whole sequence so far)."""
    from mstar.layers.paged_kv import allocate_kv_cache
    from mstar.model.qwen3_omni.inputs import shifted_positions
    from tests.support.pages import Pages

    caches = allocate_kv_cache(text.config.num_hidden_layers, 32, 8, text.config.num_key_value_heads,
                               text.config.head_dim, torch.float32, "cpu")
    pages = Pages(32, 8, seed=seed)
    meta = pages.step([("a", len(prompt))])
    logits = text.compute_logits(text(None, meta, caches, inputs_embeds=embeds, positions=positions,
                                      deepstack=deepstack))
    reference = hf_logits(prompt)
    worst = ((logits - reference).abs().max() / reference.abs().max()).item()
    tokens = list(prompt)
    for _ in range(steps):
        nxt = int(logits[-1].argmax())
        tokens.append(nxt)
        meta = pages.step([("a", 1)])
        logits = text.compute_logits(text(torch.tensor([nxt]), meta, caches,
                                          positions=shifted_positions(meta.positions, delta)))
        reference = hf_logits(tokens)[-1:]
        worst = max(worst, ((logits - reference).abs().max() / reference.abs().max()).item())
    return worst
