"""CosyVoice3 (Fun-CosyVoice3-0.5B): a Qwen2 speech-token LM with repetition-aware sampling,
a DiT flow-matching mel decoder and the causal HiFT vocoder (``mstar.model.vocoder``)."""

from mstar.model.cosyvoice3.checkpoint import CosyVoice3Parts, dit_name_map, flow_name_map, llm_name_map, load_parts
from mstar.model.cosyvoice3.dit import DiTConfig, DiTEstimator
from mstar.model.cosyvoice3.flow import (
    CosyVoice3Flow,
    FlowConfig,
    PreLookahead,
    StreamChunk,
    StreamPlanner,
    stream_schedule,
)
from mstar.model.cosyvoice3.lm import SpeechLM, SpeechLMConfig, length_bounds
from mstar.model.cosyvoice3.qwen2 import Qwen2Backbone, qwen2_config
from mstar.model.cosyvoice3.sampling import RasParams, drop_long_silences, ras_sample, sample_speech_token

__all__ = [
    "CosyVoice3Flow",
    "CosyVoice3Parts",
    "DiTConfig",
    "DiTEstimator",
    "FlowConfig",
    "PreLookahead",
    "Qwen2Backbone",
    "RasParams",
    "SpeechLM",
    "SpeechLMConfig",
    "StreamChunk",
    "StreamPlanner",
    "dit_name_map",
    "drop_long_silences",
    "flow_name_map",
    "length_bounds",
    "llm_name_map",
    "load_parts",
    "qwen2_config",
    "ras_sample",
    "sample_speech_token",
    "stream_schedule",
]
