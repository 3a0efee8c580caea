"""Nemotron-H: the hybrid Mamba-2 / attention / MLP language model (the duplex model's LLM)."""

from mstar.model.nemotron_h.config import NemotronHConfig
from mstar.model.nemotron_h.modeling import NemotronHForCausalLM

__all__ = ["NemotronHConfig", "NemotronHForCausalLM"]
