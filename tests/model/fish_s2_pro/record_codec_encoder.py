"""Record the codec-encoder fixture from fish-speech 0.1.0's modded DAC: a tiny random
causal ``Encoder`` and ``DownsampleResidualVectorQuantize`` (its ``pre_module`` a window
transformer) encode two random clips; the released-layout state dict, the clips and the
codes (and the latents the books quantize) go to ``fixtures/codec_encoder.pt``. Set up as ``record_codec.py`` says:

    PYTHONPATH=/tmp/fishref/src:/tmp/fishdeps:$PWD python tests/model/fish_s2_pro/record_codec_encoder.py
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from record_codec import CONFIG, randomize, stub_imports

OUT = Path(__file__).parent / "fixtures" / "codec_encoder.pt"
ENCODER = dict(encoder_dim=16, encoder_rates=(2, 2), encoder_transformer_layers=(0, 1), encoder_window=6, head_dim=64)
FRAMES = 20


def main() -> None:
    stub_imports()
    from fish_speech.models.dac import modded_dac
    from fish_speech.models.dac.modded_dac import Encoder, ModelArgs, WindowLimitedTransformer
    from fish_speech.models.dac.rvq import DownsampleResidualVectorQuantize

    c, e = CONFIG, ENCODER
    torch.manual_seed(0)
    args = ModelArgs(block_size=64, n_layer=c["n_layer"], n_head=c["n_head"], dim=c["latent_dim"],
                     intermediate_size=c["intermediate_size"], head_dim=c["head_dim"], rope_base=c["rope_base"],
                     norm_eps=c["norm_eps"], dropout_rate=0.0, attn_dropout_rate=0.0)
    pre = WindowLimitedTransformer(args, input_dim=c["latent_dim"], window_size=c["window_size"], causal=True)
    quantizer = DownsampleResidualVectorQuantize(
        input_dim=c["latent_dim"], n_codebooks=c["n_codebooks"], codebook_dim=c["codebook_dim"],
        quantizer_dropout=0.0, codebook_size=c["codebook_size"], semantic_codebook_size=c["semantic_codebook_size"],
        downsample_factor=c["downsample_factor"], pre_module=pre)
    general = functools.partial(ModelArgs, block_size=64, head_dim=e["head_dim"], rope_base=c["rope_base"],
                                norm_eps=c["norm_eps"], dropout_rate=0.0, attn_dropout_rate=0.0)
    original = modded_dac.WindowLimitedTransformer.__init__

    def windowed(self, *a, window_size=None, **k):  # the release's 512-frame window, shrunk to the clip
        original(self, *a, window_size=e["encoder_window"], **k)

    modded_dac.WindowLimitedTransformer.__init__ = windowed
    encoder = Encoder(e["encoder_dim"], list(e["encoder_rates"]), c["latent_dim"],
                      list(e["encoder_transformer_layers"]), general, causal=True)
    modded_dac.WindowLimitedTransformer.__init__ = original
    codec = torch.nn.ModuleDict({"encoder": encoder, "quantizer": quantizer}).eval()
    randomize(codec, [pre] + [m for m in encoder.modules() if isinstance(m, WindowLimitedTransformer)], args)
    audio = 0.3 * torch.randn(2, FRAMES * 8)
    with torch.no_grad():
        codes = quantizer(encoder(audio[:, None])).codes
        latents = quantizer.pre_module(quantizer.downsample(encoder(audio[:, None])))
    state = {k: v.clone() for k, v in codec.state_dict().items() if not k.endswith(("freqs_cis", "causal_mask"))
             and not k.startswith(("quantizer.post_module.", "quantizer.upsample."))}  # the decode side
    torch.save({"version": "fish-speech 0.1.0 + descript-audio-codec 1.0.0 (dac.nn)", "config": CONFIG,
                "encoder": ENCODER, "state_dict": state, "audio": audio, "codes": codes,
                "latents": latents}, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); codes {codes[0, :, :6].tolist()}")


if __name__ == "__main__":
    main()
