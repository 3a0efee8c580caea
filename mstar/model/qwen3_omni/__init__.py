"""Qwen3-Omni: the thinker (MoE text decoder, audio and vision encoders), the talker with its
code predictor, and the codec decoder (code2wav); served as ``qwen3_omni`` (``model.py``)."""

from mstar.model.qwen3_omni.code2wav import Qwen3OmniCode2Wav, Qwen3OmniCode2WavConfig
from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM
from mstar.model.qwen3_omni.talker import Qwen3OmniCodePredictor, Qwen3OmniTalker

__all__ = ["Qwen3OmniCode2Wav", "Qwen3OmniCode2WavConfig", "Qwen3OmniCodePredictor", "Qwen3OmniTalker",
           "Qwen3OmniTextConfig", "Qwen3OmniThinkerForCausalLM"]
