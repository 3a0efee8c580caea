"""Typed ``model_kwargs``: every registered family's knobs class parses its defaults, refuses an
unknown key naming it and listing the valid keys, and names the key of a bad value; a bad knob
stops ``start`` before anything loads. Request options name the field of a bad value."""

from __future__ import annotations

import pytest

from mstar.config import ConfigError, parse_config
from mstar.contract import RequestError
from mstar.model.chat import GenerateKnobs
from mstar.model.image_output import ImageGenerateKnobs
from mstar.model.knobs import Knobs
from mstar.model.orpheus.knobs import SpeechKnobs
from mstar.model.registry import model_class, registered

# The project's own families: test modules register toy models of their own (at import, so
# which of those are seen depends on what else was collected first).
FAMILIES = [key for key in registered() if model_class(key).__module__.startswith("mstar.")]


def knobs_of(key: str) -> type[Knobs]:
    return model_class(key).Knobs


@pytest.mark.parametrize("key", FAMILIES)
def test_every_family_declares_knobs_whose_defaults_parse(key):
    cls = knobs_of(key)
    assert issubclass(cls, Knobs) and cls is not Knobs, f"{key} declares no knobs class"
    assert cls.parse({}).seed == 0


@pytest.mark.parametrize("key", FAMILIES)
def test_an_unknown_key_is_named_with_the_valid_keys(key):
    cls = knobs_of(key)
    with pytest.raises(ConfigError) as err:
        cls.parse({"cuda_graph": True})
    message = str(err.value)
    assert message.startswith("model_kwargs.cuda_graph: unknown key") and "\n" not in message
    assert message.endswith("valid keys: " + ", ".join(sorted(cls.model_fields)))


@pytest.mark.parametrize("key, name", [(key, name) for key in FAMILIES for name in knobs_of(key).model_fields])
def test_a_bad_value_names_its_key(key, name):
    """Bytes are no knob's type (not a boolean, number, string, list or mapping)."""
    with pytest.raises(ConfigError, match=rf"^model_kwargs\.{name}\b"):
        knobs_of(key).parse({name: b"x"})


def test_the_rule_is_named_with_the_value():
    with pytest.raises(ConfigError, match=r"^model_kwargs.cuda_graphs: must be true or false, got 'yes'$"):
        knobs_of("smollm2").parse({"cuda_graphs": "yes"}, device="cuda")
    with pytest.raises(ConfigError, match=r"^model_kwargs.seed: must be >= 0, got -1$"):
        knobs_of("smollm2").parse({"seed": -1})
    with pytest.raises(ConfigError, match=r"^model_kwargs.num_inference_steps: must be <= 100, got 101$"):
        knobs_of("z_image_turbo").parse({"num_inference_steps": 101})
    with pytest.raises(ConfigError, match=r"^model_kwargs.codec_chunk_schedule: every chunk needs at least one frame"):
        knobs_of("qwen3_omni").parse({"codec_chunk_schedule": [12, 0]})
    assert knobs_of("qwen3_omni").parse({"codec_chunk_schedule": []}).codec_chunk_schedule == []
    with pytest.raises(ConfigError, match=r"^model_kwargs.vit_resize: must be \[longest side at most, shortest"):
        knobs_of("bagel").parse({"vit_resize": [224, 980]})
    assert knobs_of("bagel").parse({"vae_resize": [64, 32]}).vae_resize == [64, 32]


@pytest.mark.parametrize("key, switch", [
    ("orpheus", "compile"),  # its talker engine is not compiled (smollm2: CPU only, test_llama_compile.py)
    ("qwen3_5_0_8b", "cuda_graphs"),  # the hybrid engine has no graph runner
    ("qwen3_5_0_8b", "fused_kernels"),
    ("z_image_turbo", "cuda_graphs"),  # its text encoder is not graphed
    ("z_image_turbo", "fused_kernels"),
    ("flux2_klein", "overlap_scheduling"),
    ("whisper", "compile"),
    ("flux2_klein", "cfg_parallel"),  # klein base's alone
    ("qwen3_omni", "cuda_graphs"),  # neither LLM's forward replays graphs yet
])
def test_a_switch_the_family_does_not_run_is_refused(key, switch):
    with pytest.raises(ConfigError, match=rf"model_kwargs\.{switch}: unknown key"):
        knobs_of(key).parse({switch: True}, device="cuda")


@pytest.mark.parametrize("key, switch", [("smollm2", "cuda_graphs"), ("orpheus", "fused_kernels"),
                                         ("whisper", "encoder_cuda_graphs"), ("flux2_klein", "cuda_graphs")])
def test_cuda_switches_need_a_cuda_deployment(key, switch):
    assert getattr(knobs_of(key).parse({switch: True}, device="cuda"), switch) is True
    with pytest.raises(ConfigError, match=rf"^model_kwargs\.{switch} needs device: cuda$"):
        knobs_of(key).parse({switch: True}, device="cpu")


def test_a_misspelt_knob_stops_startup_before_anything_loads(monkeypatch):
    from mstar.model.llama.checkpoint import LlamaCheckpoint
    from mstar.runtime.launch import start

    def locate(*args, **kwargs):
        raise AssertionError("the checkpoint was located: startup went past the knobs")

    monkeypatch.setattr(LlamaCheckpoint, "locate", locate)
    with pytest.raises(ConfigError) as err:
        start(parse_config({"model": "smollm2", "model_kwargs": {"cuda_graph": True}}), in_process=True)
    assert str(err.value) == ("model_kwargs.cuda_graph: unknown key; valid keys: attention_backend, compile, "
                              "compile_backend, cuda_graphs, fused_kernels, max_prefill_tokens, "
                              "overlap_scheduling, prefix_caching, quantization, seed")


@pytest.mark.parametrize("key, offered", [("smollm2", True), ("llama", True), ("orpheus", True),
                                          ("qwen3_5_0_8b", False), ("whisper", False)])
def test_prefix_caching_is_on_where_the_kv_depend_on_the_tokens_alone(key, offered):
    """Qwen3.5's recurrent state and Whisper's audio are not in the cached pages: no knob."""
    if offered:
        assert knobs_of(key).parse({}).prefix_caching is True
        assert knobs_of(key).parse({"prefix_caching": False}).prefix_caching is False
    else:
        with pytest.raises(ConfigError, match=r"^model_kwargs\.prefix_caching: unknown key"):
            knobs_of(key).parse({"prefix_caching": False})


# ------------------------------------------------------------------ request options
@pytest.mark.parametrize("options, kwargs, field", [
    (GenerateKnobs, {"temprature": 0.5}, "model_kwargs"),  # misspelt
    (GenerateKnobs, {"temperature": "hot"}, "temperature"),
    (GenerateKnobs, {"max_tokens": 0}, "max_tokens"),
    (GenerateKnobs, {"chat": "no"}, "chat"),
    (SpeechKnobs, {"top_k": 1.5}, "top_k"),
    (SpeechKnobs, {"voice": "tara"}, "model_kwargs"),  # a /v1/audio/speech field, not an option
    (ImageGenerateKnobs, {"width": "wide"}, "width"),
    (ImageGenerateKnobs, {"output_format": "gif"}, "output_format"),
    (ImageGenerateKnobs, {"output_compression": 50}, "output_compression"),  # png is lossless
])
def test_bad_request_options_name_the_field(options, kwargs, field):
    with pytest.raises(RequestError) as err:
        options.parse(kwargs)
    assert err.value.field == field and err.value.status == 400


def test_sampling_ranges_name_the_field():
    sampling = GenerateKnobs.parse({"temperature": 0, "seed": 3}).sampling()
    assert sampling.temperature == 0 and sampling.seed == 3 and sampling.top_p == 1.0
    with pytest.raises(RequestError) as err:
        GenerateKnobs.parse({"top_p": 2}).sampling()
    assert err.value.field == "top_p"
    speech = SpeechKnobs.parse({"temperature": 0.9}).sampling({"temperature": 0.6, "top_p": 0.8})
    assert (speech.temperature, speech.top_p) == (0.9, 0.8)  # what the request sent, over the defaults


def test_qwen3_omni_fused_kernels_need_cuda_or_the_interpreter(monkeypatch):
    """The MoE kernels' switch: taken on CUDA, and on the CPU only under Triton's interpreter."""
    knobs = knobs_of("qwen3_omni")
    assert knobs.parse({}).fused_kernels is False
    assert knobs.parse({"fused_kernels": True}, device="cuda").fused_kernels is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"^model_kwargs\.fused_kernels needs device: cuda$"):
        knobs.parse({"fused_kernels": True}, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert knobs.parse({"fused_kernels": True}, device="cpu").fused_kernels is True
