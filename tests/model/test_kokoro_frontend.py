"""Kokoro's request side without a model: voice blends, sentence chunking with a short first
chunk, phoneme ids, and the G2P's refusal when misaki is not installed."""

from __future__ import annotations

import pytest
import torch

from mstar.contract import RequestError
from mstar.model.kokoro.phonemes import G2P, chunk_phonemes, installed, to_ids
from mstar.model.kokoro.voices import VoiceBank, parse_voice


def test_parse_voice_weights_sum_to_one():
    assert parse_voice("af_heart") == [("af_heart", 1.0)]
    assert parse_voice("af_bella+af_sky") == [("af_bella", 0.5), ("af_sky", 0.5)]
    assert parse_voice("af_bella(3) + af_sky(1)") == [("af_bella", 0.75), ("af_sky", 0.25)]


@pytest.mark.parametrize("spec", ["af_bella+", "a b", "af_bella(x)", "af_bella(0)+af_sky(0)", "+".join("v" * 9)])
def test_bad_voice_specs_name_voice(spec):
    with pytest.raises(RequestError) as err:
        parse_voice(spec)
    assert err.value.field == "voice"


def test_blend_is_the_weighted_mean_and_style_picks_the_length_row():
    tables = {"a": torch.zeros(5, 1, 4), "b": torch.ones(5, 1, 4)}
    bank = VoiceBank(["a", "b"], tables.__getitem__)
    assert torch.allclose(bank.blend("a(1)+b(3)"), torch.full((5, 1, 4), 0.75))
    ramp = torch.arange(5.0)[:, None, None].expand(5, 1, 4)
    assert VoiceBank.style(ramp, 3).tolist() == [2.0] * 4  # row n - 1
    assert VoiceBank.style(ramp, 99).tolist() == [4.0] * 4  # clamped to the table
    with pytest.raises(RequestError, match="unknown voice 'c'"):
        bank.blend("a+c")


def test_chunks_keep_sentences_whole_and_the_first_short():
    text = "ab cd. ef gh ij. kl mn op qr. st."
    chunks = chunk_phonemes(text, limit=510, target=20, first_target=8)
    assert chunks == ["ab cd.", "ef gh ij.", "kl mn op qr. st."]
    assert " ".join(chunks) == text


def test_a_sentence_longer_than_the_window_is_cut_at_spaces():
    words = " ".join(["abcd"] * 30)  # 149 characters, no sentence end
    chunks = chunk_phonemes(words, limit=40, target=40, first_target=40)
    assert all(len(c) <= 40 for c in chunks) and " ".join(chunks) == words


def test_ids_skip_unknown_phonemes():
    assert to_ids("a?b", {"a": 1, "b": 2}) == [1, 2]


def test_text_without_g2p_names_input_with_the_language_s_hint():
    g2p = G2P(available=lambda lang: False)
    for lang, hint in [("a", "mstar-ai[kokoro]"), ("e", "misaki[en]"), ("z", "misaki[zh]"), ("j", "misaki[ja]")]:
        with pytest.raises(RequestError) as err:
            g2p("Hello.", lang)
        assert err.value.field == "input" and hint in err.value.message and "'phonemes'" in err.value.message
    with pytest.raises(RequestError) as err:
        g2p("Hello.", "q")
    assert err.value.field == "lang_code" and "z (Mandarin Chinese)" in err.value.message


REFERENCE_TEXTS = {
    "e": "Hola, ¿cómo estás? Hace un día precioso.",
    "f": "Bonjour à tous. Il fait très beau aujourd'hui!",
    "h": "नमस्ते, आप कैसे हैं?",
    "i": "Buongiorno a tutti, come state?",
    "p": "Olá, tudo bem? Hoje está um dia lindo.",
    "z": "你好，今天天气很好。我们去公园散步吧！",
}


@pytest.mark.parametrize("lang", sorted(REFERENCE_TEXTS))
def test_g2p_equals_the_reference_pipeline(lang):
    """Our G2P per language gives the phonemes kokoro's own ``KPipeline`` (0.9.4, misaki
    0.9.4) speaks for the same text (one chunk of its non-English path)."""
    if not installed(lang):
        pytest.skip(f"misaki's G2P for {lang!r} is not installed here")
    kokoro = pytest.importorskip("kokoro")
    pipeline = kokoro.KPipeline(lang_code=lang, model=False)
    expected = " ".join(result.phonemes for result in pipeline(REFERENCE_TEXTS[lang]))
    assert G2P()(REFERENCE_TEXTS[lang], lang) == expected != ""


def test_knobs_name_a_bad_dummy_config_key():
    from mstar.config import ConfigError
    from mstar.model.kokoro.knobs import KokoroKnobs

    assert KokoroKnobs.parse({}).first_chunk_target_phonemes == 100
    with pytest.raises(ConfigError, match=r"model_kwargs\.dummy_config.*speaker_count"):
        KokoroKnobs.parse({"dummy_config": {"speaker_count": 2}})
    with pytest.raises(ConfigError, match=r"model_kwargs\.lang_code"):
        KokoroKnobs.parse({"lang_code": "q"})


def test_the_default_deployment_parses():
    from pathlib import Path

    from mstar.config import load_config
    from mstar.model.registry import model_class

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "kokoro.yaml", {"device": "cpu"})
    spec = model_class(config.model)(config)
    assert set(spec.graph().walks) == {"tts"} and spec.tasks == {"speech"}


@pytest.fixture
def spec():
    from mstar.config import parse_config
    from mstar.model.kokoro.model import Kokoro

    tiny = {"n_layer": 1, "plbert": {"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1}}
    kokoro = Kokoro(parse_config({"model": "kokoro", "load_format": "dummy", "device": "cpu",
                                  "model_kwargs": {"dummy_config": tiny, "first_chunk_target_phonemes": 16}}))
    kokoro.load_frontend()
    return kokoro


def test_text_goes_through_g2p_per_voice_language(spec, monkeypatch):
    """The G2P plumbing with misaki stood in for: the language follows the voice's first
    letter, and the phonemes become the chunks' ids with a style row per chunk."""
    from mstar.contract import SpeechSpec

    asked = []

    def build(lang):
        def g2p(text):
            asked.append((lang, text))
            return "hˈɛloʊ wˈɜːld. ðɛɹ.", None

        return g2p

    monkeypatch.setattr(spec.g2p, "available", lambda lang: True)
    monkeypatch.setattr(spec.g2p, "_build", build)
    request = spec.prepare_speech(SpeechSpec("r", "Hello. There.", "bf_emma", 1.25))
    assert asked == [("b", "Hello. There.")]
    vocab = spec.kokoro_config.vocab
    assert request.params == {"num_chunks": 2, "speed": 1.25, "seed": 0}
    first = [0, *(vocab[p] for p in "hˈɛloʊ wˈɜːld."), 0]
    assert request.inputs["chunk_ids"][0, : len(first)].tolist() == first
    assert request.inputs["chunk_lengths"].tolist() == [len(first), len("ðɛɹ.") + 2]
    table = spec.voice_bank.table("bf_emma")
    assert torch.equal(request.inputs["styles"][1], table[len("ðɛɹ.") - 1, 0])


@pytest.mark.parametrize(("voice", "lang_code", "text"), [
    ("ef_dora", None, "Hola, buenos días. ¿Qué tal estás hoy?"),
    ("zf_xiaobei", None, "你好，朋友。今天天气很好，我们去公园吧。"),
    ("af_heart", "f", "Bonjour à tous. Comment allez-vous aujourd'hui?"),
])
def test_the_voice_or_lang_code_picks_the_language(spec, voice, lang_code, text):
    """Text in another language through the real G2P: the voice's first letter (or the
    request's ``lang_code``) picks it, and the phonemes become chunks as for English."""
    from mstar.contract import SpeechSpec

    lang = lang_code or voice[0]
    if not installed(lang):
        pytest.skip(f"misaki's G2P for {lang!r} is not installed here")
    options = {"lang_code": lang_code} if lang_code else {}
    request = spec.prepare_speech(SpeechSpec("r", text, voice, 1.0, model_kwargs=options))
    phonemes = G2P()(text, lang)
    config, knobs = spec.kokoro_config, spec.knobs
    chunks = chunk_phonemes(phonemes, config.max_input_tokens - 2, knobs.chunk_target_phonemes,
                            knobs.first_chunk_target_phonemes)
    assert len(chunks) == request.params["num_chunks"] == 2  # two sentences, the first chunk short
    for row, (chunk, length) in enumerate(zip(chunks, request.inputs["chunk_lengths"].tolist())):
        ids = to_ids(chunk, config.vocab)
        assert len(ids) > 2 and request.inputs["chunk_ids"][row, :length].tolist() == [0, *ids, 0]


def test_generate_takes_voice_and_speed_from_model_kwargs(spec):
    from mstar.contract import GenerateSpec

    request = spec.prepare_generate(GenerateSpec("g", "-", [], ["audio"],
                                                 {"phonemes": "ðə kˈæt.", "voice": "af_sky", "speed": 0.5}))
    assert request.params["speed"] == 0.5 and request.params["num_chunks"] == 1
    with pytest.raises(RequestError) as err:
        spec.prepare_generate(GenerateSpec("g", "-", [], ["text"], {}))
    assert err.value.field == "output_modalities"


def test_sentence_chunking_off_packs_to_the_window(spec):
    from mstar.contract import GenerateSpec, SpeechSpec

    phonemes = "ðə kˈæt sˈæt. ɔn ðə mˈæt. ænd slˈɛpt."
    chunked = spec.prepare_speech(SpeechSpec("a", "-", "af_sky", 1.0, {"phonemes": phonemes}))  # a short first
    whole = spec.prepare_speech(SpeechSpec("b", "-", "af_sky", 1.0, {"phonemes": phonemes}, sentence_chunking=False))
    assert chunked.params["num_chunks"] == 2 and whole.params["num_chunks"] == 1
    generated = spec.prepare_generate(GenerateSpec("g", "-", [], ["audio"],
                                                   {"phonemes": phonemes, "sentence_chunking": False}))
    assert generated.params["num_chunks"] == 1


def test_voices_carry_their_language(spec):
    from mstar.contract import Voice

    listed = {v.name: v for v in spec.voice_list()}
    assert listed["af_heart"] == Voice("af_heart", "en-US") and listed["bm_george"].language == "en-GB"
    assert [v.name for v in spec.voice_list()] == spec.voices()
