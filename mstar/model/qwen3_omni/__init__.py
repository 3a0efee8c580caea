"""Qwen3-Omni: the thinker (MoE text decoder, audio and vision encoders) and the codec decoder
(code2wav); the talker to come."""

from mstar.model.qwen3_omni.code2wav import Qwen3OmniCode2Wav, Qwen3OmniCode2WavConfig
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM

__all__ = ["Qwen3OmniCode2Wav", "Qwen3OmniCode2WavConfig", "Qwen3OmniTextConfig", "Qwen3OmniThinkerForCausalLM"]
