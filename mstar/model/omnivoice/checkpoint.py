"""Where OmniVoice's config, tokenizer and weights come from: the release's directory (or hub
id, ``k2-fsa/OmniVoice``).

Layout (as ``OmniVoice.from_pretrained`` of omnivoice 0.2.1 reads it): ``config.json``
(``model_type: omnivoice``, the Qwen3 backbone under ``llm_config``), the tokenizer files
(``tokenizer.json``: Qwen's BPE with OmniVoice's control tokens), safetensors with
``llm.*``, ``audio_embeddings.weight``, ``audio_heads.weight`` (and the
``codebook_layer_offsets`` buffer, which is derived, not read), and ``audio_tokenizer/``:
transformers' Higgs Audio v2 tokenizer (``config.json``, safetensors; without that folder, the
hub repo ``eustlb/higgs-audio-v2-tokenizer``, as the reference does). Of the tokenizer, what
only its training uses is skipped by name (``decoder_semantic``, ``fc1`` and the codebooks'
``inited``, ``cluster_size``, ``embed_avg``). Anything else, or a parameter nothing fills, fails
the load naming it. Weight-normed convolutions (``weight_g``/``weight_v`` or
``parametrizations.weight.original0/1``) are folded into plain weights as they load.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.omnivoice.backbone import OmniVoiceBackbone
from mstar.model.omnivoice.config import OmniVoiceConfig
from mstar.model.omnivoice.modeling import Codec, OmniVoiceModel

HUB_ID = "k2-fsa/OmniVoice"
CODEC_DIR = "audio_tokenizer"
CODEC_HUB_ID = "eustlb/higgs-audio-v2-tokenizer"  # where the reference looks when CODEC_DIR is absent
_CODEC_UNUSED = re.compile(
    r"^(decoder_semantic|fc1)\.|^quantizer\.quantizers\.\d+\.codebook\.(inited|cluster_size|embed_avg)$"
)
_NORMED = re.compile(r"^(.*)\.(?:weight_([gv])|parametrizations\.weight\.original([01]))$")


def backbone_name(name: str) -> str | None:
    """The backbone parameter a released tensor fills (None: not read)."""
    return None if name == "codebook_layer_offsets" else name


def codec_name(name: str) -> str | None:
    """The codec parameter a tokenizer tensor fills (None: used in training only)."""
    return None if _CODEC_UNUSED.search(name) else name


def fold_weight_norm(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, turning each weight-norm pair into ``<layer>.weight``
    (``g * v / |v|``, the norm over every axis but the one ``g`` spans)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _NORMED.match(name)
        if match is None:
            yield name, tensor
            continue
        layer = match.group(1)
        part = "g" if (match.group(2) or "") == "g" or match.group(3) == "0" else "v"
        pair = pending.setdefault(layer, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[layer]
            g, v = pair["g"].float(), pair["v"].float()
            axes = [d for d in range(v.dim()) if g.shape[d] == 1]
            weight = g * v / v.norm(dim=axes, keepdim=True)
            yield f"{layer}.weight", weight.to(pair["v"].dtype)
    if pending:
        raise ValueError(f"weight-norm halves without their pair: {sorted(pending)}")


@torch.no_grad()
def unit_gain_weights(module: torch.nn.Module, seed: int) -> None:
    """Seeded dummy weights that keep activations near unit scale through the codec's ~40
    convolutions (``N(0, 1/fan_in)`` matrices, Snake alphas near 1, small biases, unit
    codewords), so a dummy deployment speaks audible noise rather than underflowing to
    silence. Depends only on the seed and the parameter names and shapes."""
    g = torch.Generator().manual_seed(seed)
    for name, t in module.state_dict(keep_vars=True).items():
        if not t.is_floating_point():
            continue
        noise = torch.randn(t.shape, generator=g)
        if name.endswith("alpha"):
            value = 1 + 0.3 * noise
        elif name.endswith("codebook.embed"):
            value = noise
        elif "norm" in name and name.endswith("weight"):
            value = torch.ones(t.shape)
        elif t.dim() < 2:
            value = 0.1 * noise if name.endswith("bias") else torch.zeros(t.shape)
        else:
            value = noise * (t.shape[0] / t.numel()) ** 0.5
        t.copy_(value.to(t))


@dataclass
class OmniVoiceCheckpoint:
    directory: Path
    codec_directory: Path

    @classmethod
    def locate(cls, model_path: str = HUB_ID, cache_dir: str | None = None) -> OmniVoiceCheckpoint:
        from mstar.model.weights import resolve_model_path

        path = resolve_model_path(model_path, cache_dir=cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {path}: no config.json (an OmniVoice checkpoint)")
        codec = path / CODEC_DIR
        if not (codec / "config.json").is_file():  # as the reference: the codec's own hub repo
            codec = resolve_model_path(CODEC_HUB_ID, cache_dir=cache_dir)
            if not (codec / "config.json").is_file():
                raise ValueError(f"model_path {path}: no {CODEC_DIR}/config.json, and {CODEC_HUB_ID} has none")
        return cls(path, codec)

    def config(self) -> OmniVoiceConfig:
        top = json.loads((self.directory / "config.json").read_text())
        codec = json.loads((self.codec_directory / "config.json").read_text())
        return OmniVoiceConfig.from_hf_dict(top, codec)

    def tokenizer(self):
        from tokenizers import Tokenizer

        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model_path {self.directory}: no tokenizer.json")
        return Tokenizer.from_file(str(path))

    def backbone_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return iter_safetensors(self.directory)

    def codec_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from mstar.model.weights import iter_safetensors

        return fold_weight_norm(iter_safetensors(self.codec_directory))

    def load_codec(self, device: torch.device | str, *, dummy: bool, seed: int) -> Codec:
        """The codec, float32 (its Snake activations and long transposed-conv stacks are where
        a low precision would show); ``dummy``: ``unit_gain_weights``."""
        from mstar.model.weights import building, fill_weights

        with building(device, torch.float32):
            codec = Codec(self.config().codec)
        if dummy:
            unit_gain_weights(codec, seed + 1)
        else:
            fill_weights(codec, self.codec_tensors, dummy=False, seed=seed, dtype=torch.float32,
                         name_map=codec_name)
        return codec.eval()

    def load_model(self, device: torch.device | str, dtype: torch.dtype, *, dummy: bool,
                   seed: int) -> OmniVoiceModel:
        """The backbone in ``dtype``, built in it (no float32 copy is held), and the codec
        (``load_codec``)."""
        from mstar.model.weights import building, fill_weights

        config = self.config()
        with building(device, dtype):
            backbone = OmniVoiceBackbone(config)
        fill_weights(backbone, self.backbone_tensors, dummy=dummy, seed=seed, dtype=dtype, name_map=backbone_name)
        return OmniVoiceModel(config, backbone, self.load_codec(device, dummy=dummy, seed=seed)).eval()
