"""Silero VAD (v5/v6): the probability that a 32 ms chunk of audio holds speech.

The network is small and runs per chunk with a carried state: the chunk (512 samples at 16 kHz,
256 at 8 kHz) is prefixed with the last ``context`` samples of the previous one (64 / 32) and
reflect-padded on the right by the same amount; a fixed Fourier basis applied as a strided
convolution gives four magnitude frames; four convolutions (strides 1, 2, 2, 1, each followed
by a ReLU) reduce them to one 128-wide vector; an LSTM cell carries the stream's state from
chunk to chunk; a ReLU, a 1x1 convolution and a sigmoid give the probability.

Here the chunks of many streams run as one batch (``state [2, B, 128]`` and ``context [B, C]``
per row), so one call serves every Realtime session that appended audio. The weights come from
the ``silero-vad`` package (MIT). Its default model, the one ``silero_vad.load_silero_vad()``
runs, is the TorchScript archive ``silero_vad.jit`` with both rates (``_model.*`` for 16 kHz,
``_model_8k.*``): read here by default, its tensors only. The package also ships a 16 kHz
network as ``silero_vad_16k.safetensors`` (``stft_conv``, ``conv1``..``conv4``, ``lstm_cell``,
``final_conv``) whose weights differ from the archive's (another training of the same
network); ``path`` loads it too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RATES", "SileroVAD", "VadState", "load_silero_vad", "packaged_weights"]


@dataclass(frozen=True)
class Rate:
    sample_rate: int
    chunk: int  # samples a call judges
    context: int  # samples of the previous chunk seen again (and the right padding)
    n_fft: int


RATES = {16000: Rate(16000, 512, 64, 256), 8000: Rate(8000, 256, 32, 128)}
HIDDEN = 128


@dataclass
class VadState:
    """A batch of streams' carried state: the LSTM's ``h, c`` stacked ``[2, B, 128]`` and each
    stream's last ``context`` samples ``[B, C]``."""

    lstm: torch.Tensor
    context: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, rate: Rate, device: torch.device | str = "cpu") -> VadState:
        return cls(torch.zeros(2, batch, HIDDEN, device=device), torch.zeros(batch, rate.context, device=device))

    @classmethod
    def stack(cls, states: list[VadState]) -> VadState:
        return cls(torch.cat([s.lstm for s in states], 1), torch.cat([s.context for s in states], 0))

    def unbind(self) -> list[VadState]:
        return [VadState(self.lstm[:, i:i + 1], self.context[i:i + 1]) for i in range(self.context.shape[0])]


class SileroVAD(nn.Module):
    """Silero's network for one sample rate."""

    def __init__(self, sample_rate: int = 16000) -> None:
        super().__init__()
        if sample_rate not in RATES:
            raise ValueError(f"Silero VAD runs at {' or '.join(map(str, RATES))} Hz, not {sample_rate}")
        self.rate = RATES[sample_rate]
        bins = self.rate.n_fft // 2 + 1
        self.register_buffer("basis", torch.zeros(2 * bins, 1, self.rate.n_fft))  # real rows, then imaginary
        widths = [(bins, 128, 1), (128, 64, 2), (64, 64, 2), (64, 128, 1)]
        self.convs = nn.ModuleList(nn.Conv1d(i, o, 3, stride=s, padding=1) for i, o, s in widths)
        self.lstm = nn.LSTMCell(HIDDEN, HIDDEN)
        self.head = nn.Conv1d(HIDDEN, 1, 1)

    def forward(self, chunk: torch.Tensor, state: VadState) -> tuple[torch.Tensor, VadState]:
        """Speech probabilities ``[B]`` of ``chunk [B, chunk samples]`` and the state after it."""
        rate = self.rate
        if chunk.shape[-1] != rate.chunk:
            raise ValueError(f"a chunk is {rate.chunk} samples at {rate.sample_rate} Hz, got {chunk.shape[-1]}")
        x = torch.cat([state.context.to(chunk.dtype), chunk], dim=1)
        padded = F.pad(x[:, None], (0, rate.context), mode="reflect")
        spectrum = F.conv1d(padded, self.basis, stride=rate.n_fft // 2)
        real, imag = spectrum.chunk(2, dim=1)
        h = torch.sqrt(real.square() + imag.square())
        for conv in self.convs:
            h = F.relu(conv(h))
        hidden, cell = self.lstm(h.squeeze(-1), (state.lstm[0], state.lstm[1]))
        prob = torch.sigmoid(self.head(F.relu(hidden)[..., None])).squeeze(1).mean(-1)
        return prob, VadState(torch.stack([hidden, cell]), x[:, -rate.context:])


_SAFETENSORS_NAMES = {"stft_conv.weight": "basis", "lstm_cell.": "lstm.", "final_conv.": "head.",
                      "conv1.": "convs.0.", "conv2.": "convs.1.", "conv3.": "convs.2.", "conv4.": "convs.3."}
_JIT_NAMES = {"stft.forward_basis_buffer": "basis", "decoder.rnn.": "lstm.", "decoder.decoder.2.": "head.",
              "encoder.0.reparam_conv.": "convs.0.", "encoder.1.reparam_conv.": "convs.1.",
              "encoder.2.reparam_conv.": "convs.2.", "encoder.3.reparam_conv.": "convs.3."}


def _rename(tensors: dict[str, torch.Tensor], names: dict[str, str], prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix):]
        for old, new in names.items():
            if rest.startswith(old):
                out[new + rest[len(old):]] = value
                break
        else:
            raise KeyError(f"{key}: not a Silero VAD weight")
    return out


def packaged_weights() -> Path:
    """The folder of the ``silero-vad`` package's released files."""
    from importlib import resources

    try:
        return Path(str(resources.files("silero_vad.data")))
    except ModuleNotFoundError:
        raise ModuleNotFoundError("Silero VAD's weights ship in the silero-vad package: "
                                  "pip install --no-deps silero-vad==6.2.3") from None


def load_silero_vad(sample_rate: int = 16000, path: str | Path | None = None) -> SileroVAD:
    """The network for ``sample_rate`` with released weights: ``path`` (the ``.jit`` archive or a
    ``.safetensors`` of the 16 kHz network), default the installed package's default model.
    Every weight of the file's network is used and every parameter filled (strict)."""
    path = Path(path) if path is not None else packaged_weights() / "silero_vad.jit"
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        if sample_rate != 16000:
            raise ValueError(f"{path.name} holds the 16 kHz network only")
        weights = _rename(load_file(str(path)), _SAFETENSORS_NAMES)
    else:  # TorchScript archive: its tensors only (no code of it runs here)
        with warnings.catch_warnings():  # torch.jit.load is deprecated; reading its tensors is all we do
            warnings.simplefilter("ignore", DeprecationWarning)
            archive = torch.jit.load(str(path), map_location="cpu").state_dict()
        weights = _rename(archive, _JIT_NAMES, "_model." if sample_rate == 16000 else "_model_8k.")
    model = SileroVAD(sample_rate)
    model.load_state_dict(weights, strict=True)
    return model.eval()
