"""Where Kokoro's weights come from: a directory (or hub id in the cache) laid out like
hexgrad/Kokoro-82M: ``config.json``, ``kokoro-v1_0.pth`` and ``voices/<name>.pt``.

The ``.pth`` is a dict of state dicts, one per top-level module of the reference ``KModel``
(``bert``, ``bert_encoder``, ``predictor``, ``text_encoder``, ``decoder``), as ``KModel`` saves
and loads them; the released file's keys carry a ``module.`` prefix (it was saved from
``DataParallel``), which ``KModel`` strips when a strict load fails, and so do we. Reading it:

- each key becomes ``<module>.<key>``; weight-norm pairs fold into plain weights;
- PL-BERT's pooler and ALBERT's position/token-type id buffers are dropped on purpose (Kokoro
  reads the last hidden states only; the buffers are ``arange``/zeros);
- the affine weights of the AdaIN instance norms may be absent: StyleTTS2 trained them
  without an affine and ``KModel`` builds them with one, leaving absent ones at their
  identity init (its fallback load is not strict). We fill exactly those with the identity;
- everything else is loaded with coverage checked both ways (``load_weights``).

A voice is a ``[max_len, 1, 2 * style_dim]`` tensor: row ``n - 1`` is the style for ``n``
phonemes (``voices.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.kokoro.config import KokoroConfig
from mstar.model.kokoro.modeling import KokoroModel
from mstar.model.vocoder import fold_weight_norm
from mstar.model.weights import WeightLoadError, building, fill_weights, load_weights, resolve_model_path

__all__ = ["KOKORO_MODULES", "KokoroCheckpoint", "dummy_config", "dummy_model", "load_kokoro_state", "released_tensors"]

KOKORO_MODULES = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
WEIGHTS_FILE = "kokoro-v1_0.pth"
_DROPPED = re.compile(r"^bert\.(pooler\.|embeddings\.(position_ids|token_type_ids)$)")
_ADAIN_AFFINE = re.compile(r"(\.norm[12]|\.adain[12]\.\d+)\.norm\.(weight|bias)$")


def released_tensors(state: Mapping[str, Mapping[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(our name, tensor)`` for a released ``{module: state dict}``, weight norm folded and
    the unused tensors dropped; an unknown module is a ``WeightLoadError``."""
    unknown = sorted(set(state) - set(KOKORO_MODULES))
    if unknown:
        raise WeightLoadError(f"Kokoro checkpoint has unknown modules {unknown} (expected {list(KOKORO_MODULES)})")
    for module, sub in state.items():
        plain = {k.removeprefix("module."): v for k, v in sub.items()}
        for key, tensor in fold_weight_norm(plain).items():
            name = f"{module}.{key}"
            if not _DROPPED.match(name):
                yield name, tensor


def load_kokoro_state(
    model: KokoroModel, state: Mapping[str, Mapping[str, torch.Tensor]], dtype: torch.dtype | None = None
) -> None:
    """Fill ``model`` from a released ``{module: state dict}`` (coverage both ways, but for
    absent AdaIN affines, which take the identity: see the module docstring)."""
    tensors = dict(released_tensors(state))
    for name, param in model.named_parameters():
        if name not in tensors and _ADAIN_AFFINE.search(name):
            tensors[name] = torch.ones_like(param) if name.endswith("weight") else torch.zeros_like(param)
    load_weights(model, tensors.items(), dtype=dtype)


@dataclass(frozen=True)
class KokoroCheckpoint:
    path: Path

    @classmethod
    def locate(cls, model_path: str, cache_dir: str | None = None) -> KokoroCheckpoint:
        return cls(Path(resolve_model_path(model_path, cache_dir=cache_dir)))

    def config(self) -> KokoroConfig:
        return KokoroConfig.from_json(self.path / "config.json")

    def weights_file(self) -> Path:
        named = self.path / WEIGHTS_FILE
        if named.is_file():
            return named
        found = sorted(self.path.glob("*.pth"))
        if len(found) != 1:
            raise FileNotFoundError(f"{self.path}: expected {WEIGHTS_FILE} (or exactly one *.pth), found "
                                    f"{[p.name for p in found]}")
        return found[0]

    def voice_names(self) -> list[str]:
        return sorted(p.stem for p in (self.path / "voices").glob("*.pt"))

    def voice(self, name: str) -> torch.Tensor:
        """Voice ``name``'s table ``[max_len, 1, 2 * style_dim]``, float32 on the CPU."""
        return torch.load(self.path / "voices" / f"{name}.pt", map_location="cpu", weights_only=True).float()

    def load_model(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, *,
                   config: KokoroConfig | None = None) -> KokoroModel:
        """The model with the checkpoint's weights (coverage checked), in eval mode; built on
        ``device`` in ``dtype`` at once, the weights cast as they are copied in."""
        with building(device, dtype):
            model = KokoroModel(config or self.config())
        state = torch.load(self.weights_file(), map_location=device, weights_only=True)
        load_kokoro_state(model, state)
        return model.eval()


def dummy_model(config: KokoroConfig, device: torch.device | str = "cpu", seed: int = 0,
                dtype: torch.dtype = torch.float32) -> KokoroModel:
    """``config``'s model with seeded random weights (``load_format: dummy``), in eval mode,
    built and drawn in ``dtype``."""
    with building(device, dtype):
        model = KokoroModel(config)
    return fill_weights(model, lambda: (), dummy=True, seed=seed)


def dummy_config(overrides: dict | None = None) -> KokoroConfig:
    """Kokoro-82M's config (its vocabulary included) with ``overrides`` (``config.json`` keys)
    on top: the model of a ``load_format: dummy`` deployment."""
    from dataclasses import asdict

    from mstar.model.kokoro.vocab import KOKORO_82M_VOCAB

    base = KokoroConfig(vocab=dict(KOKORO_82M_VOCAB)).to_dict()
    merged = base | dict(overrides or {})
    if "plbert" in (overrides or {}):
        merged["plbert"] = asdict(KokoroConfig().plbert) | overrides["plbert"]
    return KokoroConfig.from_dict(merged)
