"""Qwen3-Omni: the thinker (MoE text decoder, audio and vision encoders); talker and codec to come."""

from mstar.model.qwen3_omni.config import Qwen3OmniTextConfig
from mstar.model.qwen3_omni.modeling import Qwen3OmniThinkerForCausalLM

__all__ = ["Qwen3OmniTextConfig", "Qwen3OmniThinkerForCausalLM"]
