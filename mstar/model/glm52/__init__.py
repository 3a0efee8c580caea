"""GLM-5.2 (``glm_moe_dsa``): MLA + DSA attention, MoE with a shared expert, fp8 block-scaled
weights."""

from mstar.model.glm52.config import Glm52Config
from mstar.model.glm52.modeling import Glm52ForCausalLM

__all__ = ["Glm52Config", "Glm52ForCausalLM"]
