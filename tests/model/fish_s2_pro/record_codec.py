"""Record the codec-decoder parity fixture from fish-speech 0.1.0's modded DAC.

fish-speech's ``modded_dac`` / ``rvq`` modules import the training stack (hydra, librosa,
audiotools, descript-audio-codec's model package); only their decoder classes and
descript-audio-codec's ``dac.nn`` layers run here, so those imports are stubbed:

    pip install --no-deps --target /tmp/dacdeps descript-audio-codec
    PYTHONPATH=/tmp/fishref/src:/tmp/fishdeps:$PWD python tests/model/fish_s2_pro/record_codec.py

(see ``record_reference.py`` for /tmp/fishref and /tmp/fishdeps). A tiny random codec (fp32,
seed 0; the transformer's RoPE table replaced by fp32 values of the same angles, the
reference keeps it in bf16) decodes ``FRAMES`` frames of random codes through
``DownsampleResidualVectorQuantize.decode`` and the causal ``Decoder``; the released-layout
state dict (weight norm unfolded), the codes and the audio go to ``fixtures/codec.pt``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).parent / "fixtures" / "codec.pt"
DAC = Path("/tmp/dacdeps/dac")
FRAMES = 24
CONFIG = dict(latent_dim=32, decoder_dim=32, decoder_rates=(2, 2), semantic_codebook_size=16, codebook_size=8,
              n_codebooks=3, codebook_dim=4, downsample_factor=(2,), n_layer=2, n_head=2, head_dim=16,
              intermediate_size=48, window_size=4, rope_base=10000.0, norm_eps=1e-5)


def stub_imports() -> None:
    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    module("hydra")
    module("librosa")
    module("omegaconf", OmegaConf=None)
    module("audiotools", AudioSignal=None)
    module("audiotools.ml", BaseModel=nn.Module)
    module("dac", __path__=[str(DAC)])  # the package's files, without its __init__ (audiotools)
    module("dac.model", __path__=[str(DAC / "model")])
    module("dac.nn", __path__=[str(DAC / "nn")])  # without its __init__ (the losses need audiotools)
    module("dac.model.base", CodecMixin=object)


def main() -> None:
    stub_imports()
    from fish_speech.models.dac.modded_dac import Decoder, ModelArgs, WindowLimitedTransformer
    from fish_speech.models.dac.rvq import DownsampleResidualVectorQuantize

    c = CONFIG
    torch.manual_seed(0)
    args = ModelArgs(block_size=64, n_layer=c["n_layer"], n_head=c["n_head"], dim=c["latent_dim"],
                     intermediate_size=c["intermediate_size"], head_dim=c["head_dim"], rope_base=c["rope_base"],
                     norm_eps=c["norm_eps"], dropout_rate=0.0, attn_dropout_rate=0.0)
    post = WindowLimitedTransformer(args, input_dim=c["latent_dim"], window_size=c["window_size"], causal=True)
    quantizer = DownsampleResidualVectorQuantize(
        input_dim=c["latent_dim"], n_codebooks=c["n_codebooks"], codebook_dim=c["codebook_dim"],
        quantizer_dropout=0.0, codebook_size=c["codebook_size"], semantic_codebook_size=c["semantic_codebook_size"],
        downsample_factor=c["downsample_factor"], post_module=post)
    decoder = Decoder(c["latent_dim"], c["decoder_dim"], list(c["decoder_rates"]), causal=True)
    codec = nn.ModuleDict({"quantizer": quantizer, "decoder": decoder}).eval()
    randomize(codec, [post], args)
    with torch.no_grad():
        sizes = [c["semantic_codebook_size"]] + [c["codebook_size"]] * c["n_codebooks"]
        codes = torch.stack([torch.randint(0, n, (2, FRAMES)) for n in sizes], dim=1)
        audio = decoder(quantizer.decode(codes))[:, 0]
    state = {k: v.clone() for k, v in codec.state_dict().items()
             if not k.endswith(("freqs_cis", "causal_mask"))}
    OUT.parent.mkdir(exist_ok=True)
    torch.save({"version": "fish-speech 0.1.0 + descript-audio-codec 1.0.0 (dac.nn)", "config": CONFIG,
                "state_dict": state, "codes": codes, "audio": audio}, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); audio peak {audio.abs().max():.3f} std {audio.std():.3f}")


def randomize(codec: nn.Module, transformers: list[nn.Module], args) -> None:
    """Weights at scales that make every part matter and keep tanh unsaturated; the
    transformers' RoPE tables in fp32 (the reference keeps them in bf16)."""
    with torch.no_grad():
        for name, p in codec.named_parameters():
            if name.endswith("original0"):  # weight-norm gains: each output channel's norm
                p.copy_(0.2 + 0.3 * torch.rand_like(p))
            elif name.endswith(("alpha", "gamma")) or "norm" in name:
                p.copy_(0.6 + 0.4 * torch.rand_like(p))
            else:
                p.copy_(0.12 * torch.randn_like(p))
    for module in transformers:
        dim = module.config.head_dim
        freqs = 1.0 / (module.config.rope_base ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(module.config.block_size).float(), freqs)
        module.freqs_cis = torch.stack((angles.cos(), angles.sin()), dim=-1)


if __name__ == "__main__":
    main()
