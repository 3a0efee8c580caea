"""Record ``tests/chatterbox/fixtures/pipeline_<variant>/``: the reference package's own
top-level ``generate`` on a whole tiny random Chatterbox, once, for ``test_pipeline_parity.py``
(a script, not collected by pytest).

The reference is ``chatterbox-tts==0.1.7`` with ``s3tokenizer==0.3.0``, ``conformer==0.3.2``,
``resemble-perth==1.0.1``, ``librosa==0.11.0`` and ``transformers==5.2.0``, in the private venv
that ``record_reference.py`` describes (``/tmp/t3venv``, which sees the project's torch 2.13.0
through a ``.pth`` file), plus the real torchaudio Python code: its 2.11.0 wheel installed
beside, with its compiled extension moved aside (torchaudio then imports without it, and
``Resample`` and ``compliance.kaldi.fbank`` are pure PyTorch)::

    /tmp/t3venv/bin/pip install --no-deps --target /tmp/ta_site torchaudio==2.11.0 "setuptools<81"
    mkdir /tmp/ta_site_so && mv /tmp/ta_site/torchaudio/lib/*.so /tmp/ta_site_so/
    HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/ta_site /tmp/t3venv/bin/python tests/chatterbox/record_pipeline.py

(``setuptools<81``: perth imports ``pkg_resources``; ``HF_HUB_OFFLINE``: the multilingual
tokenizer looks for a Cangjie table on the Hub, which is not reachable.)

Per variant (``english``: ``ChatterboxTTS``; ``multilingual``: ``ChatterboxMultilingualTTS``;
``turbo``: ``ChatterboxTurboTTS``) the package's classes are built at tiny sizes and seeded
(T3, the whole ``S3Gen`` with its S3 tokenizer and CAMPPlus, the voice encoder, the text
tokenizer of ``fixtures/tokenizers.json``), the built-in voice is the package's own
``prepare_conditionals`` of ``clip.wav`` (saved as ``conds.pt`` with ``Conditionals.save``),
and ``generate(TEXT)`` runs at the package's defaults. The directory keeps the checkpoint in
the released file layout (``t3_*.safetensors``, ``s3gen*.safetensors``, ``ve.safetensors``,
``conds.pt``, the tokenizer file), ``perth.pt`` (the tiny PerTh network of
``tests/perth/fixtures``, which stands in for the 36 MB shipped one), ``clip.wav``, and
``record.pt``: the sizes, the text and options, the seed, T3's drawn tokens, the tokens S3Gen
read, and the waveform before and after the watermark.

Three hooks, each saying what the test must do alike:

* the global generator is seeded with the seed before ``generate`` (T3 draws its tokens with
  ``torch.multinomial`` from it) and again as ``s3gen.inference`` starts: the served family
  seeds one generator for T3 and a fresh one for S3Gen, both from the request's seed;
* the tiny T3's speech vocabulary is 63 ids with start / stop at 61 / 62; the package's
  filters test the released ids (6561 / 6562), so what ``t3.inference`` returns has 61 / 62
  renamed to 6561 / 6562 (the released layout: the codes, then start, then stop);
* the tiny PerTh network replaces ``PerthImplicitWatermarker()``'s shipped one.

Also: the clip's S3 codes are folded into the tiny vocabularies before ``conds.pt`` is saved
(``clip_conds`` in the record keeps them unfolded); Turbo's ``prepare_conditionals`` runs with
``norm_loudness=False`` (its loudness step hands the tokenizer float64 samples, which it
refuses); the seed is the first from ``SEED`` whose utterance stops within ``KEPT_TOKENS``
tokens and draws at most one start token (the package's ``drop_invalid_tokens`` fails on
two); every weight is rounded to a float16 value before the reference runs and stored as
float16 (files under 1 MB); files equal to English's are kept once, in English's directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures"
sys.path.insert(0, str(HERE.parents[1]))  # tests.s3gen.record_reference's tiny S3Gen builders

SEED = 20
TEXT = {"english": "Hello world. A dog, a cat!", "multilingual": "Ça va très bien, Élodie.",
        "turbo": "Hello world, how are you?"}
LANGUAGE = {"multilingual": "fr"}
SPEECH_VOCAB, START_SPEECH, STOP_SPEECH = 63, 61, 62
MAX_SPEECH = 120
KEPT_TOKENS = 50  # the first seed whose utterance is at most this long: small fixtures, fast tests
GPT2_POSITIONS = 1100  # Turbo runs up to 1000 steps past its prompt
SPEAKER_VE = 8
TEXT_VOCAB = {"english": 128, "multilingual": 2454, "turbo": 300}
S3GEN_VOCAB = {"english": 1000, "multilingual": 1000, "turbo": 4300}  # Turbo appends S3GEN_SIL = 4299
TOKENIZER_STATE = dict(n_mels=128, n_audio_state=64, n_audio_head=1, n_audio_layer=1)  # heads 64 wide: its rotary
CAMPPLUS = dict(embedding_size=16, growth_rate=4, bn_size=2, init_channels=16)
DERIVED = ("tokenizer._mel_filters", "tokenizer.window")  # buffers the loaders recompute
CLIP_SECONDS, CLIP_RATE = 6.0, 24000
FILES = {
    "english": ("t3_cfg.safetensors", "s3gen.safetensors", "tokenizer.json"),
    "multilingual": ("t3_mtl23ls_v2.safetensors", "s3gen.safetensors", "grapheme_mtl_merged_expanded_v1.json"),
    "turbo": ("t3_turbo_v1.safetensors", "s3gen_meanflow.safetensors", "tokenizer.json"),
}
TOKENIZER_KEY = {"english": "en", "multilingual": "mtl", "turbo": "turbo"}


def seeded(module: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Every float tensor random (norm gains around one), so nothing is trivially zero or one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.state_dict().items():
            if not p.is_floating_point() or "running_" in name or name.endswith(("_mel_filters", "window")):
                continue  # BatchNorm statistics; the tokenizer's filterbank and window are computed
            noise = torch.randn(p.shape, generator=gen)
            gain = p.dim() == 1 and ("norm" in name or "ln_" in name or name.endswith("bn.weight"))
            p.copy_(1.0 + 0.1 * noise if gain else scale * noise)
    halved(module)


def halved(module: torch.nn.Module) -> None:
    """Every float tensor rounded to a float16 value: the files store float16 (half the
    bytes), and the reference runs on exactly the float32 values they load as."""
    with torch.no_grad():
        for name, p in module.state_dict().items():
            if p.is_floating_point() and not name.endswith(DERIVED):
                p.copy_(p.half().float())


def save_half(module: torch.nn.Module, path: Path, skip: tuple[str, ...] = (), drop: tuple[str, ...] = ()) -> None:
    from safetensors.torch import save_file

    state = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in module.state_dict().items()
             if not k.endswith(skip) and not k.startswith(drop)}
    save_file(state, str(path))


def t3_model(variant: str):
    from chatterbox.models.t3 import t3 as t3_module
    from chatterbox.models.t3.inference import alignment_stream_analyzer
    from chatterbox.models.t3.llama_configs import LLAMA_CONFIGS
    from chatterbox.models.t3.modules.perceiver import Perceiver
    from chatterbox.models.t3.modules.t3_config import T3Config

    LLAMA_CONFIGS["tiny_llama"] = dict(
        vocab_size=8, max_position_embeddings=131072, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        attn_implementation="eager", tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
        attention_dropout=0.0, mlp_bias=False, model_type="llama", rms_norm_eps=1e-5,
        rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
        rope_theta=500000.0, use_cache=True)
    LLAMA_CONFIGS["tiny_gpt2"] = dict(
        activation_function="gelu_new", model_type="gpt2", n_ctx=GPT2_POSITIONS, n_embd=32, hidden_size=32, n_head=4,
        n_layer=2, n_positions=GPT2_POSITIONS, layer_norm_epsilon=1e-5, vocab_size=8, attn_pdrop=0.0, embd_pdrop=0.0,
        resid_pdrop=0.0, attn_implementation="eager")
    alignment_stream_analyzer.LLAMA_ALIGNED_HEADS = [(1, 3), (0, 1), (1, 0)]
    turbo = variant == "turbo"
    hp = T3Config(text_tokens_dict_size=TEXT_VOCAB[variant])
    hp.start_text_token, hp.stop_text_token = TEXT_VOCAB[variant] - 1, 0
    hp.speech_tokens_dict_size, hp.start_speech_token, hp.stop_speech_token = SPEECH_VOCAB, START_SPEECH, STOP_SPEECH
    hp.max_text_tokens, hp.max_speech_tokens = 60, MAX_SPEECH
    hp.llama_config_name = "tiny_gpt2" if turbo else "tiny_llama"
    hp.input_pos_emb = None if turbo else "learned"
    hp.speech_cond_prompt_len = 6
    hp.speaker_embed_size = SPEAKER_VE
    hp.use_perceiver_resampler = not turbo
    hp.emotion_adv = not turbo
    torch.manual_seed(1)
    model = t3_module.T3(hp)
    if not turbo:  # the reference hard-codes the 1024-wide, 32-query perceiver
        model.cond_enc.perceiver = Perceiver(4, 32, 32, 4)
    seeded(model, 11)
    return model.eval()


def s3gen_model(variant: str):
    meanflow = variant == "turbo"
    from chatterbox.models.s3gen import s3gen
    from chatterbox.models.s3gen.xvector import CAMPPlus
    from s3tokenizer.model_v2 import ModelConfig, S3TokenizerV2

    from tests.s3gen import record_reference as s3rec

    # ``S3Tokenizer`` builds its network at ``S3TokenizerV2``'s default config: make it tiny.
    S3TokenizerV2.__init__.__defaults__ = (ModelConfig(**TOKENIZER_STATE),)
    from chatterbox.models.s3gen import decoder, f0_predictor, flow, flow_matching, hifigan
    from chatterbox.models.s3gen.transformer import upsample_encoder

    ref = SimpleNamespace(decoder=decoder, f0_predictor=f0_predictor, flow=flow, flow_matching=flow_matching,
                          hifigan=hifigan, s3gen=s3gen, upsample_encoder=upsample_encoder)
    s3rec.VOCAB, s3rec.SPEAKER = S3GEN_VOCAB[variant], CAMPPLUS["embedding_size"]
    torch.manual_seed(0)
    tiny = s3rec.tiny_token2wav(ref, meanflow)
    model = s3gen.S3Token2Wav(meanflow=meanflow)
    model.flow, model.mel2wav = tiny.flow, tiny.mel2wav
    model.speaker_encoder = CAMPPlus(**CAMPPLUS, memory_efficient=False)
    seeded(model.speaker_encoder, 12, scale=0.1)
    seeded(model.tokenizer, 13, scale=0.1)
    halved(model)
    return model.eval()


def voice_encoder():
    from chatterbox.models.voice_encoder import voice_encoder as ve_module
    from chatterbox.models.voice_encoder.config import VoiceEncConfig

    class Tiny(VoiceEncConfig):
        ve_hidden_size = 16
        speaker_embed_size = SPEAKER_VE

    ve = ve_module.VoiceEncoder(Tiny())
    seeded(ve, 14)
    return ve.eval()


def perth_watermarker():
    from perth.perth_net.perth_net_implicit.config import PerthConfig
    from perth.perth_net.perth_net_implicit.model.perth_net import PerthNet
    from perth.perth_net.perth_net_implicit.perth_watermarker import PerthImplicitWatermarker

    tiny = torch.load(HERE.parent / "perth" / "fixtures" / "tiny.pt")
    net = PerthNet(PerthConfig(**tiny["config"])).eval()
    net.load_state_dict(tiny["state"])
    return PerthImplicitWatermarker(run_name=None, perth_net=net), tiny


def write_clip(path: Path) -> None:
    import soundfile

    g = np.random.default_rng(0)
    t = np.arange(int(CLIP_SECONDS * CLIP_RATE)) / CLIP_RATE
    wave = 0.3 * np.sin(2 * np.pi * (150 + 30 * np.sin(2 * np.pi * 3 * t)) * t) + 0.02 * g.standard_normal(t.size)
    soundfile.write(str(path), wave.astype(np.float32), CLIP_RATE, subtype="PCM_16")


def tokenizer_file(variant: str, directory: Path):
    files = json.loads((FIXTURES / "tokenizers.json").read_text())["files"]
    name = FILES[variant][2]
    (directory / name).write_text(json.dumps(files[TOKENIZER_KEY[variant]], ensure_ascii=False))
    if variant == "turbo":
        from transformers import AutoTokenizer

        config = {"tokenizer_class": "GPT2TokenizerFast", "pad_token": "<|endoftext|>"}
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        return AutoTokenizer.from_pretrained(str(directory))
    from chatterbox.models.tokenizers.tokenizer import EnTokenizer, MTLTokenizer

    return (MTLTokenizer if variant == "multilingual" else EnTokenizer)(str(directory / name))


def record_variant(variant: str) -> None:
    import chatterbox.mtl_tts as mtl_tts
    import chatterbox.tts as tts
    import chatterbox.tts_turbo as tts_turbo
    directory = FIXTURES / f"pipeline_{variant}"
    directory.mkdir(parents=True, exist_ok=True)
    t3_name, s3gen_name, _ = FILES[variant]
    t3, s3gen, ve = t3_model(variant), s3gen_model(variant), voice_encoder()
    save_half(t3, directory / t3_name)
    # the tokenizer's mel filterbank and window are derived buffers: the loaders recompute them
    # Turbo's clip encoders equal English's (same seeds): its file leaves them out (< 1 MB) and
    # the test copies them over from English's s3gen.safetensors.
    shared = ("tokenizer.", "speaker_encoder.") if variant == "turbo" else ()
    save_half(s3gen, directory / s3gen_name, skip=DERIVED, drop=shared)
    save_half(ve, directory / "ve.safetensors")
    tokenizer = tokenizer_file(variant, directory)
    marker, tiny_perth = perth_watermarker()
    torch.save({"model": tiny_perth["state"], "config": tiny_perth["config"]}, directory / "perth.pt")
    write_clip(directory / "clip.wav")

    cls = {"english": tts.ChatterboxTTS, "multilingual": mtl_tts.ChatterboxMultilingualTTS,
           "turbo": tts_turbo.ChatterboxTurboTTS}[variant]
    model = cls.__new__(cls)
    model.sr, model.t3, model.s3gen, model.ve, model.tokenizer = 24000, t3, s3gen, ve, tokenizer
    model.device, model.conds, model.watermarker = "cpu", None, marker
    # Turbo's loudness step hands the tokenizer float64 samples, which it cannot take; the
    # served family does not normalise loudness either.
    loudness = {"norm_loudness": False} if variant == "turbo" else {}
    model.prepare_conditionals(str(directory / "clip.wav"), **loudness)
    clip_conds = {"t3_prompt": model.conds.t3.cond_prompt_speech_tokens.clone(),
                  "speaker": model.conds.t3.speaker_emb.clone(),
                  "gen": {k: v.clone() for k, v in model.conds.gen.items() if v is not None}}
    # The tiny T3 embeds 61 codes, not S3's 6561: its prompt keeps the clip's codes mod 61.
    # and tiny S3Gen's few codes: its prompt keeps them modulo.
    model.conds.t3.cond_prompt_speech_tokens = model.conds.t3.cond_prompt_speech_tokens % START_SPEECH
    model.conds.gen["prompt_token"] = model.conds.gen["prompt_token"] % S3GEN_VOCAB[variant]
    model.conds.save(directory / "conds.pt")

    drawn: list[torch.Tensor] = []
    read: list[torch.Tensor] = []
    marked: list[np.ndarray] = []
    state = {"seed": SEED}

    def renamed(tokens: torch.Tensor) -> torch.Tensor:
        drawn.append(tokens.clone())
        out = tokens.clone()
        out[tokens == START_SPEECH], out[tokens == STOP_SPEECH] = 6561, 6562
        return out

    infer = t3.inference_turbo if variant == "turbo" else t3.inference
    if variant == "turbo":
        t3.inference_turbo = lambda *a, **k: renamed(infer(*a, **k))
    else:
        t3.inference = lambda *a, **k: renamed(infer(*a, **k))
    s3_infer = s3gen.inference

    def s3_inference(*args, **kwargs):
        read.append(kwargs["speech_tokens"].clone())
        torch.manual_seed(state["seed"])
        return s3_infer(*args, **kwargs)

    s3gen.inference = s3_inference
    apply = marker.apply_watermark

    def watermark(signal, sample_rate, **kwargs):
        marked.append(np.array(signal, copy=True))
        return apply(signal, sample_rate=sample_rate, **kwargs)

    marker.apply_watermark = watermark
    kwargs = {"language_id": LANGUAGE[variant]} if variant in LANGUAGE else {}
    for seed in range(SEED, SEED + 200):  # the first seed whose utterance stops within MAX_SPEECH
        drawn.clear(), read.clear(), marked.clear()
        state["seed"] = seed
        torch.manual_seed(seed)
        try:
            wave = model.generate(TEXT[variant], **kwargs)
        except IndexError:  # ran past the tiny position table: no stop drawn
            continue
        except TypeError:  # two start tokens drawn: the package's drop_invalid_tokens fails
            continue
        if len(drawn[0].reshape(-1)) <= KEPT_TOKENS:
            break
    tokens = drawn[0][0] if drawn[0].dim() == 2 else drawn[0]
    record = dict(
        variant=variant, text=TEXT[variant], language=LANGUAGE.get(variant), seed=state["seed"],
        sizes=dict(text_vocab=TEXT_VOCAB[variant], start_text=TEXT_VOCAB[variant] - 1, stop_text=0,
                   speech_vocab=SPEECH_VOCAB, start_speech=START_SPEECH, stop_speech=STOP_SPEECH,
                   max_speech=MAX_SPEECH, max_text=60, speaker=SPEAKER_VE, prompt_len=6, perceiver_queries=4,
                   s3gen_vocab=S3GEN_VOCAB[variant], tokenizer=TOKENIZER_STATE, campplus=CAMPPLUS, ve_hidden=16),
        tokens=tokens.reshape(-1), s3gen_tokens=read[0].reshape(-1),
        wave_unmarked=torch.from_numpy(marked[0]).float(), wave=wave.reshape(-1).float(),
        clip_conds=clip_conds,
    )
    torch.save(record, directory / "record.pt")
    sizes = {p.name: p.stat().st_size for p in directory.iterdir()}
    print(variant, "tokens", record["tokens"].tolist(), "samples", record["wave"].numel(),
          "peak", float(record["wave"].abs().max()), sizes)


def share_with_english(variant: str) -> None:
    """Drop the files equal to English's (the same seeds build them): the test copies English's."""
    english = FIXTURES / "pipeline_english"
    for path in (FIXTURES / f"pipeline_{variant}").iterdir():
        twin = english / path.name
        if path.suffix != ".pt" and twin.is_file() and twin.read_bytes() == path.read_bytes():
            path.unlink()


def main() -> None:
    torch.set_num_threads(1)
    for variant in sys.argv[1:] or ("english", "multilingual", "turbo"):
        record_variant(variant)
        if variant != "english":
            share_with_english(variant)


if __name__ == "__main__":
    main()
