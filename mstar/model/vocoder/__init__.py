"""Vocoder parts shared by the TTS families: the neural-source-filter (NSF) harmonic source,
the iSTFT head, the AdaIN residual blocks and the iSTFTNet/HiFT generator built from them.

Kokoro's decoder uses them as they are; the HiFT vocoder of CosyVoice2/3 and Chatterbox
(``hift``) shares the source and the iSTFT head, with its own Snake residual blocks (no style)
and an F0 predictor that reads the mel.
Parameter names follow the reference checkpoints (``m_source.l_linear``, ``ups.<i>``,
``resblocks.<k>``, ``noise_convs.<i>``, ``noise_res.<i>``, ``conv_post``) with weight norm
folded into plain ``weight`` tensors at load time (``fold_weight_norm``).
"""

from mstar.model.vocoder.hift import F0Predictor, HiFTConfig, HiFTGenerator, PaddedConv1d, SnakeResBlock, hift_state
from mstar.model.vocoder.istft import ISTFT, prefix_mask
from mstar.model.vocoder.istftnet import (
    AdaIN1d,
    AdaINResBlock1,
    ISTFTNetConfig,
    ISTFTNetGenerator,
    masked_instance_norm,
    zero_padding,
)
from mstar.model.vocoder.nsf import HarmonicSource, SampleSineGen, SineGen
from mstar.model.vocoder.weight_norm import fold_weight_norm

__all__ = [
    "ISTFT",
    "AdaIN1d",
    "AdaINResBlock1",
    "F0Predictor",
    "HiFTConfig",
    "HiFTGenerator",
    "HarmonicSource",
    "ISTFTNetConfig",
    "ISTFTNetGenerator",
    "PaddedConv1d",
    "SampleSineGen",
    "SineGen",
    "SnakeResBlock",
    "fold_weight_norm",
    "hift_state",
    "masked_instance_norm",
    "prefix_mask",
    "zero_padding",
]
