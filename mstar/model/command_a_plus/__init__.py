"""Command A+ (Cohere2-MoE text decoder, Cohere2 vision): text and image chat."""

from mstar.model.command_a_plus.config import CommandAPlusConfig
from mstar.model.command_a_plus.modeling import CommandAPlusForCausalLM

__all__ = ["CommandAPlusConfig", "CommandAPlusForCausalLM"]
