"""Vocoder parts shared by the TTS families: the neural-source-filter (NSF) harmonic source,
the iSTFT head, the AdaIN residual blocks and the iSTFTNet/HiFT generator built from them.

Kokoro's decoder uses them as they are; Chatterbox's and CosyVoice's HiFT vocoders share the
source and the iSTFT head (their generator differs in its residual blocks and F0 predictor).
Parameter names follow the reference checkpoints (``m_source.l_linear``, ``ups.<i>``,
``resblocks.<k>``, ``noise_convs.<i>``, ``noise_res.<i>``, ``conv_post``) with weight norm
folded into plain ``weight`` tensors at load time (``fold_weight_norm``).
"""

from mstar.model.vocoder.istft import ISTFT
from mstar.model.vocoder.istftnet import AdaIN1d, AdaINResBlock1, ISTFTNetConfig, ISTFTNetGenerator
from mstar.model.vocoder.nsf import HarmonicSource, SineGen
from mstar.model.vocoder.weight_norm import fold_weight_norm

__all__ = [
    "ISTFT",
    "AdaIN1d",
    "AdaINResBlock1",
    "HarmonicSource",
    "ISTFTNetConfig",
    "ISTFTNetGenerator",
    "SineGen",
    "fold_weight_norm",
]
