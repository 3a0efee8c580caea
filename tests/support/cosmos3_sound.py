"""A tiny Cosmos3 sound tokenizer (diffusers' ``Cosmos3AVAEAudioTokenizer``, seeded random weights)
and its ``sound_tokenizer/`` folder as the pipeline saves it (weight-norm ``weight_g`` /
``weight_v`` pairs), for the sound tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.support.diffusers_dirs import randomize

# 1200 Hz, hop 12 both ways (the encoder's STFT hop 2 x strides 2, 3; the decoder's strides 3, 4):
# 100 latents a second
SOUND = dict(sampling_rate=1200, vocoder_input_dim=4, dec_dim=4, dec_c_mults=[1, 2], dec_strides=[3, 4],
             dec_out_channels=2, enc_dim=4, enc_num_blocks=1, enc_n_fft=8, enc_hop_length=2, enc_latent_dim=8,
             enc_c_mults=[1, 2], enc_strides=[2, 3])
LATENT_FPS = 100.0


def reference_tokenizer(seed: int = 3):
    from diffusers import Cosmos3AVAEAudioTokenizer

    module = Cosmos3AVAEAudioTokenizer(**SOUND).eval()
    randomize(module, seed, gains=("weight_g",))
    with torch.no_grad():  # moderate gains: activations of a few units, most output inside the clamp
        for name, param in module.named_parameters():
            if name.endswith("weight_g"):
                param.mul_(0.2 if name == "decoder.conv2.weight_g" else 0.5)
    return module


def write_sound_tokenizer(root: Path, module, drop: str | None = None) -> None:
    """``root/sound_tokenizer/`` (config and weights; ``drop``: leave out tensors with this prefix)."""
    folder = root / "sound_tokenizer"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(dict(module.config), default=list))
    state = {k: v.contiguous() for k, v in module.state_dict().items() if drop is None or not k.startswith(drop)}
    save_file(state, folder / "diffusion_pytorch_model.safetensors")


def add_sound_tower(source, root: Path, seed: int):
    """Copy the checkpoint ``source`` (its ``root`` and ``transformer``) to ``root`` with a
    ``sound_gen`` tower (``sound_dim`` 4 at ``LATENT_FPS``, random weights from ``seed``) and a
    ``sound_tokenizer/``: ``(tower, tokenizer)``, the reference modules."""
    import shutil

    from diffusers import Cosmos3OmniTransformer

    shutil.copytree(source.root, root)
    config = {k: v for k, v in dict(source.transformer.config).items() if not k.startswith("_")}
    tower = Cosmos3OmniTransformer(**{**config, "sound_gen": True, "sound_dim": SOUND["vocoder_input_dim"],
                                      "sound_latent_fps": LATENT_FPS}).eval()
    randomize(tower, seed)
    (root / "transformer" / "config.json").write_text(json.dumps(dict(tower.config), default=list))
    save_file({k: v.contiguous() for k, v in tower.state_dict().items()},
              root / "transformer" / "diffusion_pytorch_model.safetensors")
    sound = reference_tokenizer()
    write_sound_tokenizer(root, sound)
    return tower, sound
