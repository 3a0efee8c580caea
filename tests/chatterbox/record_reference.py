"""Record the reference T3's outputs on tiny random configs, once, as test fixtures.

The reference is ``chatterbox-tts==0.1.7``. It pins torch 2.6, numpy < 2 and transformers
5.2, so it is not importable beside the project's torch 2.13 / transformers 5.25; the fixtures
were recorded in a private venv that sees the project venv's packages (torch 2.13.0+cpu,
numpy 2.4) through a ``.pth`` file, with these installed over them::

    python3 -m venv /tmp/t3venv
    echo /work/main/.venv/lib/python3.11/site-packages \\
        > /tmp/t3venv/lib/python3.11/site-packages/zz_project.pth
    /tmp/t3venv/bin/pip install --no-deps chatterbox-tts==0.1.7 transformers==5.2.0 \\
        tokenizers==0.22.2 "huggingface-hub<2"
    /tmp/t3venv/bin/pip install librosa==0.11.0 s3tokenizer conformer==0.3.2 \\
        resemble-perth omegaconf diffusers==0.29.0 pyloudnorm
    /tmp/t3venv/bin/pip uninstall -y torchaudio     # its 2.11 library does not load on 2.13
    mkdir /tmp/t3venv/lib/python3.11/site-packages/kernels   # hide the project's newer `kernels`
    echo 'raise ImportError' > /tmp/t3venv/lib/python3.11/site-packages/kernels/__init__.py
    /tmp/t3venv/bin/python tests/chatterbox/record_reference.py

``chatterbox/__init__`` imports the whole package (S3Gen needs torchaudio); T3 and the text
tokenizers never call it, so ``torchaudio`` is an empty stand-in module here.

Each variant (``english``, ``multilingual``, ``turbo``) gets ``t3_<variant>.safetensors`` (the
reference T3's ``state_dict``: the released key layout, random values) and ``t3_<variant>.pt``
(inputs, the conditioning encoder's output, the prefill embeddings, the speech-head logits of
every forward of a short greedy decode, rows ``[cond, uncond]`` for the guided variants, and
the tokens). ``tokenizers.json`` holds tiny tokenizer files and the reference's ids for a few
sentences; ``t3_released_shapes.json`` the real-size T3's keys and shapes per variant.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


def _stub_torchaudio() -> None:
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi",
                 "torchaudio.transforms", "torchaudio.functional"):
        module = types.ModuleType(name)
        module.__path__ = []
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = module
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(sys.modules[parent], child, module)


_stub_torchaudio()

import torch  # noqa: E402
from chatterbox.models.t3 import t3 as t3_module  # noqa: E402
from chatterbox.models.t3.inference import alignment_stream_analyzer  # noqa: E402
from chatterbox.models.t3.llama_configs import LLAMA_CONFIGS  # noqa: E402
from chatterbox.models.t3.modules.cond_enc import T3Cond  # noqa: E402
from chatterbox.models.t3.modules.perceiver import Perceiver  # noqa: E402
from chatterbox.models.t3.modules.t3_config import T3Config  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

TINY_LLAMA = dict(
    vocab_size=8, max_position_embeddings=131072, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    attn_implementation="eager", tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    attention_dropout=0.0, mlp_bias=False, model_type="llama", rms_norm_eps=1e-5,
    rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
    rope_theta=500000.0, use_cache=True,
)
TINY_GPT2 = dict(
    activation_function="gelu_new", model_type="gpt2", n_ctx=256, n_embd=32, hidden_size=32, n_head=4,
    n_layer=2, n_positions=256, layer_norm_epsilon=1e-5, vocab_size=8, attn_pdrop=0.0, embd_pdrop=0.0,
    resid_pdrop=0.0, attn_implementation="eager",
)
LLAMA_CONFIGS["tiny_llama"] = TINY_LLAMA
LLAMA_CONFIGS["tiny_gpt2"] = TINY_GPT2
# The reference turns its alignment guard on for a 2454-token text vocabulary (the multilingual
# model) and reads the heads from this module constant: the tiny model's heads, in its 2 layers.
TINY_ALIGNED_HEADS = [(1, 3), (0, 1), (1, 0)]
alignment_stream_analyzer.LLAMA_ALIGNED_HEADS = TINY_ALIGNED_HEADS

# The tiny hyper-parameters (tests/chatterbox/tiny.py builds the same ones for our side).
HP = {
    "english": dict(text_vocab=40, speech_vocab=70, start_speech=61, stop_speech=62, backbone="tiny_llama",
                    learned_pos=True, perceiver=True, emotion=True, seed=1),
    "multilingual": dict(text_vocab=2454, speech_vocab=70, start_speech=61, stop_speech=62, backbone="tiny_llama",
                         learned_pos=True, perceiver=True, emotion=True, seed=2),
    "turbo": dict(text_vocab=50, speech_vocab=65, start_speech=63, stop_speech=64, backbone="tiny_gpt2",
                  learned_pos=False, perceiver=False, emotion=False, seed=3),
}
START_TEXT, STOP_TEXT = 38, 0
MAX_TEXT, MAX_SPEECH, SPEAKER, PROMPT_LEN, QUERIES, STEPS = 30, 40, 16, 6, 4, 8
SAMPLE_SEED = 1234
SAMPLING = {  # tests/chatterbox/test_t3_parity.py samples with the same values
    "guided": dict(temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    "turbo": dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2),
}


def tiny_hp(spec: dict) -> T3Config:
    hp = T3Config(text_tokens_dict_size=spec["text_vocab"])
    hp.start_text_token, hp.stop_text_token = START_TEXT, STOP_TEXT
    hp.speech_tokens_dict_size = spec["speech_vocab"]
    hp.start_speech_token, hp.stop_speech_token = spec["start_speech"], spec["stop_speech"]
    hp.max_text_tokens, hp.max_speech_tokens = MAX_TEXT, MAX_SPEECH
    hp.llama_config_name = spec["backbone"]
    hp.input_pos_emb = "learned" if spec["learned_pos"] else None
    hp.speech_cond_prompt_len = PROMPT_LEN
    hp.speaker_embed_size = SPEAKER
    hp.use_perceiver_resampler = spec["perceiver"]
    hp.emotion_adv = spec["emotion"]
    return hp


def build(spec: dict) -> t3_module.T3:
    torch.manual_seed(spec["seed"])
    model = t3_module.T3(tiny_hp(spec))
    if spec["perceiver"]:  # the reference hard-codes the 1024-wide, 32-query perceiver
        model.cond_enc.perceiver = Perceiver(QUERIES, 32, 32, 4)
    gen = torch.Generator().manual_seed(spec["seed"] + 100)
    with torch.no_grad():  # every tensor random, norms around one, so nothing is trivially zero or one
        for name, p in model.state_dict().items():
            if not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if ("norm" in name or "ln_" in name) and p.dim() == 1 else 0.2 * noise)
    return model.eval()


def conditioning(spec: dict, gen: torch.Generator) -> dict:
    return dict(
        speaker_emb=torch.randn(1, SPEAKER, generator=gen),
        cond_prompt_speech_tokens=torch.randint(0, spec["start_speech"], (1, PROMPT_LEN), generator=gen),
        emotion_adv=torch.full((1, 1, 1), 0.7),
    )


def record_variant(variant: str) -> None:
    spec = HP[variant]
    model = build(spec)
    gen = torch.Generator().manual_seed(spec["seed"] + 200)
    cond = conditioning(spec, gen)
    guided = variant != "turbo"
    body = torch.randint(1, START_TEXT, (1, 9), generator=gen)
    if guided:
        text = torch.cat([torch.tensor([[START_TEXT]]), body, torch.tensor([[STOP_TEXT]])], dim=1)
        text = torch.cat([text, text])
    else:
        text = torch.randint(0, spec["text_vocab"], (1, 9), generator=gen)
    cfg_weight = 0.5

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(FIXTURES / f"t3_{variant}.safetensors"))

    logits: list[torch.Tensor] = []
    model.speech_head.register_forward_hook(lambda _m, _i, out: logits.append(out[:, -1].clone()))
    with torch.inference_mode():
        cond_embeds = model.prepare_conditioning(T3Cond(**cond))
        start = torch.full((text.shape[0], 1), spec["start_speech"])
        prefill, _ = model.prepare_input_embeds(t3_cond=T3Cond(**cond), text_tokens=text, speech_tokens=start,
                                                cfg_weight=cfg_weight if guided else 0.0)
        logits.clear()
        if guided:
            # Greedy through the reference's own loop: a tiny temperature makes its multinomial
            # draw the argmax of the penalised, guided logits.
            tokens = model.inference(t3_cond=T3Cond(**cond), text_tokens=text, max_new_tokens=STEPS,
                                     temperature=1e-6, top_p=1.0, min_p=0.0, repetition_penalty=1.2,
                                     cfg_weight=cfg_weight)
        else:
            tokens = model.inference_turbo(T3Cond(**cond), text, temperature=1e-6, top_k=1000, top_p=1.0,
                                           repetition_penalty=1.2, max_gen_len=STEPS)
        greedy_logits = list(logits)
        # A seeded sampled decode: the reference draws with torch.multinomial from the global
        # generator, seeded here; our loop draws the same way from a generator seeded alike.
        torch.manual_seed(SAMPLE_SEED)
        if guided:
            sampled = model.inference(t3_cond=T3Cond(**cond), text_tokens=text, max_new_tokens=STEPS,
                                      **SAMPLING["guided"], cfg_weight=cfg_weight)
        else:
            sampled = model.inference_turbo(T3Cond(**cond), text, **SAMPLING["turbo"], max_gen_len=STEPS)
    out = dict(
        text=text, cfg_weight=torch.tensor(cfg_weight), cond_embeds=cond_embeds, prefill_embeds=prefill,
        step_logits=torch.stack(greedy_logits), tokens=tokens,
        sampled_tokens=sampled, **cond,
    )
    torch.save(out, FIXTURES / f"t3_{variant}.pt")
    print(variant, "prefill", tuple(prefill.shape), "forwards", len(greedy_logits), "tokens", tokens.tolist(),
          "sampled", sampled.tolist())


SENTENCES_EN = ["Hello world.", "The quick brown fox jumps over the lazy dog!", "A dog, a cat; zebra?"]
SENTENCES_MTL = [
    ("en", "Hello World, it's Über-cool."),
    ("fr", "Ça va très bien, Élodie."),
    ("de", "Größe und Straße."),
    ("ko", "안녕하세요 세계"),
    ("es", "¿Qué tal, Señor?"),
    (None, "no language token"),
]
SENTENCES_TURBO = ["Hello world, [laugh] how are you?", "Numbers 12345 and symbols: $5.00!"]


def record_tokenizers() -> None:
    """Tiny tokenizer files in the released styles (a grapheme BPE with ``[START]`` ``[STOP]``
    ``[SPACE]``, the multilingual one with language tokens, Turbo's byte-level BPE) and the
    reference's ids for a few sentences."""
    from chatterbox.models.tokenizers.tokenizer import EnTokenizer, MTLTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    corpus = [s for s in SENTENCES_EN] + [s for _, s in SENTENCES_MTL] + ["the then there other brother"]
    special = ["[STOP]", "[UNK]", "[SPACE]", "[START]", "[PAD]", "[SEP]", "[CLS]", "[MASK]"]
    langs = ["[en]", "[fr]", "[de]", "[ko]", "[es]"]

    def grapheme(extra: list[str], text: list[str]) -> Tokenizer:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.decoder = decoders.BPEDecoder()
        tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=special + extra))
        return tok

    en = grapheme([], [s.replace(" ", "[SPACE]") for s in corpus])
    import unicodedata
    mtl_text = [unicodedata.normalize("NFKD", s.lower()) for s in corpus]
    mtl = grapheme(langs, mtl_text)
    turbo = Tokenizer(models.BPE())
    turbo.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    turbo.decoder = decoders.ByteLevel()
    turbo.train_from_iterator(corpus + SENTENCES_TURBO, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

    work = FIXTURES / "tok"
    for name, tok in (("en", en), ("mtl", mtl), ("turbo", turbo)):
        (work / name).mkdir(parents=True, exist_ok=True)
        tok.save(str(work / name / "tokenizer.json"))
    (work / "turbo" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2TokenizerFast"}))

    ref_en = EnTokenizer(str(work / "en" / "tokenizer.json"))
    ref_mtl = MTLTokenizer(str(work / "mtl" / "tokenizer.json"))
    ref_turbo = AutoTokenizer.from_pretrained(str(work / "turbo"))
    record = {
        "files": {name: json.loads((work / name / "tokenizer.json").read_text()) for name in ("en", "mtl", "turbo")},
        "en": [[s, ref_en.encode(s)] for s in SENTENCES_EN],
        "mtl": [[lang, s, ref_mtl.encode(s, language_id=lang)] for lang, s in SENTENCES_MTL],
        "turbo": [[s, ref_turbo(s).input_ids] for s in SENTENCES_TURBO],
    }
    (FIXTURES / "tokenizers.json").write_text(json.dumps(record, ensure_ascii=False))
    for name in ("en", "mtl", "turbo"):
        for f in (work / name).iterdir():
            f.unlink()
        (work / name).rmdir()
    work.rmdir()


def released_hp(variant: str) -> T3Config:
    """The variants' real hyper-parameters, as ``tts.py``, ``mtl_tts.py`` and ``tts_turbo.py`` set them."""
    if variant == "english":
        return T3Config.english_only()
    if variant == "multilingual":
        return T3Config.multilingual()
    hp = T3Config(text_tokens_dict_size=50276)
    hp.llama_config_name = "GPT2_medium"
    hp.speech_tokens_dict_size = 6563
    hp.input_pos_emb = None
    hp.speech_cond_prompt_len = 375
    hp.use_perceiver_resampler = False
    hp.emotion_adv = False
    return hp


def record_released_shapes() -> None:
    """Every key of the reference T3's ``state_dict`` at the real sizes, with its shape (built
    on the meta device: the released files load into exactly these with ``strict``)."""
    shapes = {}
    for variant in HP:
        with torch.device("meta"):
            model = t3_module.T3(released_hp(variant))
        shapes[variant] = {k: list(v.shape) for k, v in model.state_dict().items()}
    (FIXTURES / "t3_released_shapes.json").write_text(json.dumps(shapes, indent=0, sort_keys=True))


def main() -> None:
    FIXTURES.mkdir(exist_ok=True)
    torch.set_num_threads(1)
    for variant in HP:
        record_variant(variant)
    record_tokenizers()
    record_released_shapes()


if __name__ == "__main__":
    main()
