"""AudioSeal: an imperceptible 16-bit watermark added to speech, and its detector.

Our own port of the maths of Meta's AudioSeal 0.2 (``audioseal`` on PyPI): a SEANet encoder
(causal convolutions, strided downsampling by the product of ``ratios``, an LSTM) turns the
audio into hidden frames; the message adds one learnt vector per bit (the embedding row
``2 * k + bit_k``, summed over the bits) to every frame; a SEANet decoder turns the frames back
into a watermark the length of the clip, and the marked audio is ``x + alpha * watermark``.
The detector is a SEANet encoder whose frames a transposed convolution brings back to the
sample rate and a 1x1 convolution reads as two detection logits and one logit per bit.

Streaming: a request's chunks are marked with its own ``WatermarkStream``, which carries every
causal layer's state across chunks (each convolution's unconsumed input tail and one-time left
padding, the transposed convolutions' overlapping tails, the LSTMs' ``(h, c)``), so the chunks
of a clip cut into whole hops (``hop`` samples: 320 for the released models, so a 12 Hz codec
frame of 1920 samples is six) come out exactly as the whole clip marked at once, however it is
cut. The reference's own ``generator.streaming(batch)`` differs: in audioseal 0.2.0 the flag
stops at the encoder's ``nn.Sequential``, so every chunk is marked as an independent clip
(zero left context, fresh LSTM); ``forward`` on each chunk reproduces that, and the tests check
both.

Checkpoints load from the released layout (``{"xp.cfg": {...}, "model": state_dict}`` with
weight-normed convolutions as ``weight_g``/``weight_v`` or ``parametrizations`` pairs, with or
without the 0.2 ``inner_conv`` level) or from a card name (its config built in, its weights
from the Hugging Face cache), checking coverage both ways.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from mstar.model.knobs import Knobs
from mstar.model.weights import init_dummy_weights, load_weights

MESSAGE_BITS = 16

_SEANET_DEFAULTS: dict[str, Any] = {
    "activation": "ELU", "activation_params": {"alpha": 1.0}, "channels": 1, "compress": 2,
    "dilation_base": 2, "dimension": 128, "kernel_size": 7, "last_kernel_size": 7, "lstm": 2,
    "n_filters": 32, "n_residual_layers": 1, "pad_mode": "constant", "ratios": [8, 5, 4, 2],
    "residual_kernel_size": 3, "true_skip": True, "trim_right_ratio": 1.0,
}
_HUB_REPO = "facebook/audioseal"
CARDS: dict[str, tuple[str, bool]] = {  # card -> (file in the Hub repo, causal)
    "audioseal_wm_streaming": ("generator_streaming.pth", True),
    "audioseal_wm_16bits": ("generator_base.pth", False),
    "audioseal_detector_streaming": ("detector_streaming.pth", True),
    "audioseal_detector_16bits": ("detector_base.pth", False),
}


@dataclass(frozen=True)
class SEANetConfig:
    """The SEANet hyper-parameters AudioSeal's cards and ``xp.cfg`` carry (others ignored)."""

    causal: bool = True
    dimension: int = 128
    n_filters: int = 32
    n_residual_layers: int = 1
    ratios: tuple[int, ...] = (8, 5, 4, 2)
    kernel_size: int = 7
    last_kernel_size: int = 7
    residual_kernel_size: int = 3
    dilation_base: int = 2
    compress: int = 2
    lstm: int = 2
    elu_alpha: float = 1.0
    trim_right_ratio: float = 1.0
    nbits: int = MESSAGE_BITS
    output_dim: int = 32  # the detector's channels before its head (the reference's builder fixes 32)

    @property
    def hop(self) -> int:
        return math.prod(self.ratios)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> SEANetConfig:
        """From a card or a checkpoint's ``xp.cfg`` (``seanet`` plus ``nbits``, ``decoder``...)."""
        seanet = {**_SEANET_DEFAULTS, **dict(cfg.get("seanet") or {})}
        for side in ("decoder", "detector"):
            seanet.update(seanet.pop(side, None) or {})
            seanet.update(cfg.get(side) or {})
        unsupported = {
            "activation": seanet["activation"] != "ELU", "channels": seanet["channels"] != 1,
            "true_skip": not seanet["true_skip"], "pad_mode": seanet["pad_mode"] != "constant",
            "final_activation": seanet.get("final_activation") is not None,
            "normalizer": bool(cfg.get("normalizer")),
        }
        if any(unsupported.values()):
            raise ValueError(f"unsupported AudioSeal config: {[k for k, v in unsupported.items() if v]}")
        return cls(
            causal=bool(seanet["causal"]), dimension=int(seanet["dimension"]),
            n_filters=int(seanet["n_filters"]), n_residual_layers=int(seanet["n_residual_layers"]),
            ratios=tuple(int(r) for r in seanet["ratios"]), kernel_size=int(seanet["kernel_size"]),
            last_kernel_size=int(seanet["last_kernel_size"]),
            residual_kernel_size=int(seanet["residual_kernel_size"]),
            dilation_base=int(seanet["dilation_base"]), compress=int(seanet["compress"]),
            lstm=int(seanet["lstm"]), elu_alpha=float((seanet["activation_params"] or {}).get("alpha", 1.0)),
            trim_right_ratio=float(seanet["trim_right_ratio"]),
            nbits=int(cfg.get("nbits", MESSAGE_BITS)),
        )


# --- streaming state ---------------------------------------------------------------------------

@dataclass
class _ConvState:
    pad_pending: bool = True  # the causal left padding, added to the first non-empty chunk
    tail: torch.Tensor | None = None  # input not yet consumed by a full window


@dataclass
class WatermarkStream:
    """One request's marking state: per layer, a conv's input tail, a transposed conv's overlap,
    a residual add's leftovers or an LSTM's ``(h, c)``. Create with
    ``AudioSealGenerator.new_stream``; drop it to free it."""

    message: torch.Tensor  # [nbits] of 0/1
    alpha: float
    layers: dict[int, Any] = field(default_factory=dict)


def _state(stream: WatermarkStream | None, key: int, make):
    if stream is None:
        return None
    if key not in stream.layers:
        stream.layers[key] = make()
    return stream.layers[key]


# --- layers ------------------------------------------------------------------------------------

class _Conv(nn.Conv1d):
    """A SEANet convolution that pads itself: causal (all padding left) or centred, plus the
    right padding that completes the last window; in a stream, the causal padding once."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1, *, causal: bool):
        super().__init__(cin, cout, kernel, stride, dilation=dilation)
        self.causal = causal
        self.span = (kernel - 1) * dilation + 1
        self.pad_total = self.span - stride

    def forward(self, x: torch.Tensor, stream: WatermarkStream | None = None) -> torch.Tensor:
        st = _state(stream, id(self), _ConvState)
        stride = self.stride[0]
        if st is None:
            length = x.shape[-1]
            frames = (length - self.span + self.pad_total) / stride + 1
            extra = (math.ceil(frames) - 1) * stride + self.span - self.pad_total - length
            left = self.pad_total if self.causal else self.pad_total - self.pad_total // 2
            return super().forward(F.pad(x, (left, self.pad_total - left + extra)))
        if st.pad_pending and x.shape[-1] > 0:
            x = F.pad(x, (self.pad_total, 0))
            st.pad_pending = False
        if st.tail is not None:
            x = torch.cat([st.tail, x], dim=-1)
        frames = max(0, (x.shape[-1] - self.span) // stride + 1)
        st.tail = x[..., frames * stride:]
        if frames == 0:
            return x.new_zeros(x.shape[0], self.out_channels, 0)
        return super().forward(x[..., : (frames - 1) * stride + self.span])


class _ConvTranspose(nn.ConvTranspose1d):
    """Upsampling by ``stride``, trimmed back to ``stride`` samples a frame; in a stream, the
    overlapping right half of the last frame waits for the next chunk's first frame."""

    def __init__(self, cin: int, cout: int, stride: int, *, causal: bool, trim_right_ratio: float):
        super().__init__(cin, cout, 2 * stride, stride)
        total = stride
        right = math.ceil(total * trim_right_ratio) if causal else total // 2
        self.trim = (total - right, right)

    def forward(self, x: torch.Tensor, stream: WatermarkStream | None = None) -> torch.Tensor:
        if stream is None:
            y = super().forward(x)
            return y[..., self.trim[0]: y.shape[-1] - self.trim[1]]
        if self.trim[0]:
            raise ValueError("only a trim_right_ratio of 1 streams")
        if x.shape[-1] == 0:
            return x.new_zeros(x.shape[0], self.out_channels, 0)
        y = super().forward(x)
        partial = stream.layers.get(id(self))
        if partial is not None:  # the previous chunk's overlap, its bias counted once
            y[..., : partial.shape[-1]] += partial - self.bias[:, None]
        keep = self.stride[0]
        stream.layers[id(self)] = y[..., -keep:]
        return y[..., :-keep]


class _Residual(nn.Module):
    """``x + conv1(elu(conv_k(elu(x))))`` at half width (``compress``)."""

    def __init__(self, dim: int, cfg: SEANetConfig, dilation: int):
        super().__init__()
        hidden = dim // cfg.compress
        self.block = nn.ModuleList([  # indexed as the released ``block.<i>``
            _ELU(cfg.elu_alpha), _Conv(dim, hidden, cfg.residual_kernel_size, dilation=dilation, causal=cfg.causal),
            _ELU(cfg.elu_alpha), _Conv(hidden, dim, 1, causal=cfg.causal),
        ])

    def forward(self, x: torch.Tensor, stream: WatermarkStream | None = None) -> torch.Tensor:
        y = _run(self.block, x, stream)
        leftover = _state(stream, id(self), lambda: [x[..., :0], y[..., :0]])
        if leftover is None:
            return x + y
        x, y = torch.cat([leftover[0], x], -1), torch.cat([leftover[1], y], -1)
        n = min(x.shape[-1], y.shape[-1])
        leftover[0], leftover[1] = x[..., n:], y[..., n:]
        return x[..., :n] + y[..., :n]


class _LSTM(nn.Module):
    """Stacked LSTM over the frames with a skip connection; a stream carries ``(h, c)``."""

    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, layers)

    def forward(self, x: torch.Tensor, stream: WatermarkStream | None = None) -> torch.Tensor:
        seq = x.permute(2, 0, 1)
        if stream is None:
            y, _ = self.lstm(seq)
        elif seq.shape[0] == 0:
            return x
        else:
            y, stream.layers[id(self)] = self.lstm(seq, stream.layers.get(id(self)))
        return (y + seq).permute(1, 2, 0)


class _ELU(nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor, stream: WatermarkStream | None = None) -> torch.Tensor:
        return F.elu(x, self.alpha)


def _run(layers: nn.ModuleList, x: torch.Tensor, stream: WatermarkStream | None = None) -> torch.Tensor:
    for layer in layers:
        x = layer(x, stream)
    return x


def _encoder(cfg: SEANetConfig) -> nn.ModuleList:
    """SEANet's encoder, indexed as the released ``encoder.model.<i>`` (ELUs count)."""
    nf, c = cfg.n_filters, cfg.causal
    layers: list[nn.Module] = [_Conv(1, nf, cfg.kernel_size, causal=c)]
    mult = 1
    for ratio in reversed(cfg.ratios):
        layers += [_Residual(mult * nf, cfg, cfg.dilation_base**j) for j in range(cfg.n_residual_layers)]
        layers += [_ELU(cfg.elu_alpha), _Conv(mult * nf, 2 * mult * nf, 2 * ratio, ratio, causal=c)]
        mult *= 2
    if cfg.lstm:
        layers.append(_LSTM(mult * nf, cfg.lstm))
    layers += [_ELU(cfg.elu_alpha), _Conv(mult * nf, cfg.dimension, cfg.last_kernel_size, causal=c)]
    return nn.ModuleList(layers)


def _decoder(cfg: SEANetConfig) -> nn.ModuleList:
    nf, c = cfg.n_filters, cfg.causal
    mult = 2 ** len(cfg.ratios)
    layers: list[nn.Module] = [_Conv(cfg.dimension, mult * nf, cfg.kernel_size, causal=c)]
    if cfg.lstm:
        layers.append(_LSTM(mult * nf, cfg.lstm))
    for ratio in cfg.ratios:
        layers += [_ELU(cfg.elu_alpha),
                   _ConvTranspose(mult * nf, mult * nf // 2, ratio, causal=c, trim_right_ratio=cfg.trim_right_ratio)]
        layers += [_Residual(mult * nf // 2, cfg, cfg.dilation_base**j) for j in range(cfg.n_residual_layers)]
        mult //= 2
    layers += [_ELU(cfg.elu_alpha), _Conv(nf, 1, cfg.last_kernel_size, causal=c)]
    return nn.ModuleList(layers)


def message_bits(message: int | str | torch.Tensor, nbits: int = MESSAGE_BITS) -> torch.Tensor:
    """The payload as ``nbits`` 0/1 values, most significant bit first: an int in
    ``[0, 2**nbits)`` or a string of ``nbits`` 0/1 characters (read left to right)."""
    if isinstance(message, torch.Tensor):
        bits = message.long().flatten()
    elif isinstance(message, str):
        if len(message) != nbits or set(message) - {"0", "1"}:
            raise ValueError(f"a message string is {nbits} characters of 0 and 1, got {message!r}")
        bits = torch.tensor([int(ch) for ch in message])
    else:
        if not 0 <= int(message) < 2**nbits:
            raise ValueError(f"a message is an int in [0, {2**nbits}), got {message}")
        bits = torch.tensor([(int(message) >> (nbits - 1 - k)) & 1 for k in range(nbits)])
    if bits.numel() != nbits or ((bits != 0) & (bits != 1)).any():
        raise ValueError(f"a message is {nbits} bits of 0/1")
    return bits


def bits_to_int(bits: torch.Tensor) -> int:
    """The inverse of ``message_bits`` for one message (most significant bit first)."""
    return int(sum(int(b) << (len(bits) - 1 - k) for k, b in enumerate(bits.tolist())))


class AudioSealGenerator(nn.Module):
    """Adds the watermark: ``x + alpha * decoder(encoder(x) + message vectors)``."""

    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = _encoder(cfg)
        self.decoder = _decoder(cfg)
        self.message_table = nn.Embedding(2 * cfg.nbits, cfg.dimension)

    def _watermark(self, x: torch.Tensor, bits: torch.Tensor, stream: WatermarkStream | None) -> torch.Tensor:
        hidden = _run(self.encoder, x, stream)
        rows = 2 * torch.arange(self.cfg.nbits, device=x.device) + bits.to(x.device).view(-1, self.cfg.nbits)
        hidden = hidden + self.message_table(rows).sum(-2).unsqueeze(-1)
        wm = _run(self.decoder, hidden, stream)[..., : x.shape[-1]]
        if wm.shape[-1] != x.shape[-1]:
            raise ValueError(f"a streamed chunk is whole hops of {self.cfg.hop} samples; "
                             f"this one ({x.shape[-1]} samples) left {x.shape[-1] - wm.shape[-1]} behind")
        return wm

    @torch.no_grad()
    def forward(self, x: torch.Tensor, message: int | str | torch.Tensor = 0, alpha: float = 1.0) -> torch.Tensor:
        """Mark whole clips ``[batch, 1, samples]`` (or ``[batch, samples]``) with one message
        (or ``[batch, nbits]`` messages)."""
        squeeze = x.dim() == 2
        x = x.unsqueeze(1) if squeeze else x
        batched = isinstance(message, torch.Tensor) and message.dim() == 2
        bits = message if batched else message_bits(message, self.cfg.nbits)
        out = x + alpha * self._watermark(x, bits, None)
        return out.squeeze(1) if squeeze else out

    def new_stream(self, message: int | str | torch.Tensor = 0, alpha: float = 1.0) -> WatermarkStream:
        if not self.cfg.causal or self.cfg.trim_right_ratio != 1.0:
            raise ValueError("only a causal (streaming) AudioSeal generator marks chunk by chunk")
        return WatermarkStream(message_bits(message, self.cfg.nbits), float(alpha))

    @torch.no_grad()
    def mark_chunk(self, pcm: torch.Tensor, stream: WatermarkStream) -> torch.Tensor:
        """The next chunk ``[samples]`` (or ``[1, 1, samples]``) of one stream, marked; a
        whole number of hops."""
        x = pcm.reshape(1, 1, -1)
        if x.shape[-1] == 0:
            return pcm
        out = x + stream.alpha * self._watermark(x, stream.message, stream)
        return out.reshape(pcm.shape)


@dataclass(frozen=True)
class Detection:
    probability: float  # share of samples the detector calls marked
    message: int  # decoded bits, most significant first
    bits: tuple[float, ...]  # each bit's probability of being 1


class AudioSealDetector(nn.Module):
    """Per sample: P(marked) and the bits' logits, averaged over the clip."""

    def __init__(self, cfg: SEANetConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = _encoder(cfg)
        self.upsample = nn.ConvTranspose1d(cfg.dimension, cfg.output_dim, cfg.hop, cfg.hop)
        self.head = nn.Conv1d(cfg.output_dim, 2 + cfg.nbits, 1)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, 1, samples]`` -> (softmaxed detection ``[batch, 2, samples]``, bit
        probabilities ``[batch, nbits]``)."""
        x = x.reshape(x.shape[0], 1, -1)
        logits = self.head(self.upsample(_run(self.encoder, x))[..., : x.shape[-1]])
        return logits[:, :2].softmax(dim=1), logits[:, 2:].mean(-1).sigmoid()

    def detect(self, pcm: torch.Tensor, threshold: float = 0.5) -> Detection:
        """One clip ``[samples]``: the share of samples scored above ``threshold`` and the bits."""
        scores, bits = self(pcm.reshape(1, 1, -1))
        probability = float((scores[0, 1] > threshold).float().mean())
        hard = (bits[0] > 0.5).long()
        return Detection(probability, bits_to_int(hard), tuple(float(b) for b in bits[0]))


# --- checkpoints -------------------------------------------------------------------------------

_PREFIXES = (("encoder.model.", "encoder."), ("decoder.model.", "decoder."),
             ("msg_processor.msg_processor.", "message_table."), ("detector.0.model.", "encoder."),
             ("detector.0.reverse_convolution.", "upsample."), ("detector.1.", "head."))


def released_name(name: str) -> str | None:
    """A released (or 0.2 in-memory) AudioSeal tensor name as ours, weight norm already folded."""
    for theirs, ours in _PREFIXES:
        if name.startswith(theirs):
            name = ours + name[len(theirs):]
            break
    else:
        return None
    name = name.replace(".inner_conv.", ".")
    name = re.sub(r"\.(conv|convtr)\.(conv|convtr)\.", ".", name)
    return name


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weight = g * v / |v|`` (norm over all but dim 0, as ``torch.nn.utils.weight_norm``)
    for every ``weight_g``/``weight_v`` or ``parametrizations.weight.original0/1`` pair."""
    out: dict[str, torch.Tensor] = {}
    pairs = {".weight_g": ".weight_v", ".parametrizations.weight.original0": ".parametrizations.weight.original1"}
    for name, tensor in state.items():
        for g_suffix, v_suffix in pairs.items():
            if name.endswith(g_suffix):
                prefix = name[: -len(g_suffix)]
                v = state[prefix + v_suffix].float()
                norm = v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
                out[prefix + ".weight"] = (tensor.float() * v / norm).to(tensor.dtype)
                break
        else:
            if not any(name.endswith(v) for v in pairs.values()):
                out[name] = tensor
    return out


def _read_checkpoint(path: str | Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - released files pickle their OmegaConf config
        return torch.load(path, map_location="cpu", weights_only=False)


def _card_checkpoint(card: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(_HUB_REPO, CARDS[card][0]))
    except OSError as err:  # offline and not cached, or the Hub refused
        raise FileNotFoundError(f"AudioSeal card {card!r}: {_HUB_REPO}/{CARDS[card][0]} is not in the Hugging Face "
                                f"cache and could not be downloaded ({type(err).__name__}); pass a checkpoint "
                                "file instead") from err


def _load(cls, source: str | Path, card_default: str):
    """A model from a card name (its config here, its weights from the Hub cache) or a
    checkpoint file in the released layout (config from its ``xp.cfg``, else the card's)."""
    if str(source) in CARDS:
        causal = CARDS[str(source)][1]
        cfg_dict: dict[str, Any] = {"seanet": {"causal": causal}}
        path = _card_checkpoint(str(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"AudioSeal generator/detector {source!r} is neither a card "
                                    f"({', '.join(CARDS)}) nor a checkpoint file")
        cfg_dict = {"seanet": {"causal": CARDS[card_default][1]}}
    ckpt = _read_checkpoint(path)
    if "xp.cfg" in ckpt:
        saved = dict(ckpt["xp.cfg"])
        cfg_dict = {**saved, "seanet": {**cfg_dict["seanet"], **dict(saved.get("seanet") or {})}}
        if str(source) in CARDS:
            cfg_dict["seanet"]["causal"] = CARDS[str(source)][1]
    state = ckpt.get("best_state", {}).get("model") if "best_state" in ckpt else ckpt.get("model", ckpt)
    model = cls(SEANetConfig.from_dict(cfg_dict))
    load_weights(model, fold_weight_norm(state).items(), name_map=lambda n: released_name(n) or n)
    return model.eval()


def load_generator(source: str | Path = "audioseal_wm_streaming") -> AudioSealGenerator:
    return _load(AudioSealGenerator, source, "audioseal_wm_streaming")


def load_detector(source: str | Path = "audioseal_detector_streaming") -> AudioSealDetector:
    return _load(AudioSealDetector, source, "audioseal_detector_streaming")


class AudioWatermarkKnobs(Knobs):
    """``model_kwargs.audio_watermark``: AudioSeal on a speech model's output, off by default."""

    enabled: bool = False
    """Mark every request's audio."""

    message: int | str = 0
    """The 16-bit payload: an int in [0, 65535] or 16 characters of 0/1 (most significant first)."""

    alpha: float = Field(1.0, gt=0.0, le=4.0)
    """The mark's strength (the generator's output is scaled by it)."""

    generator: str = "audioseal_wm_streaming"
    """An AudioSeal card name (weights from the Hugging Face cache) or a checkpoint file."""

    @field_validator("message")
    @classmethod
    def _payload(cls, value: int | str) -> int | str:
        message_bits(value)
        return value

    def build(self, device: torch.device | str = "cpu", *, dummy: bool = False,
              seed: int = 0) -> AudioSealGenerator | None:
        """The generator, or None when off; a card under ``dummy`` gets seeded random weights."""
        if not self.enabled:
            return None
        if dummy and self.generator in CARDS:
            model = AudioSealGenerator(SEANetConfig(causal=CARDS[self.generator][1]))
            init_dummy_weights(model, seed=seed, std=0.1)
            model.eval()
        else:
            model = load_generator(self.generator)
        if not model.cfg.causal:
            raise ValueError(f"model_kwargs.audio_watermark.generator: {self.generator!r} is not a "
                             "streaming (causal) generator; audio is marked chunk by chunk")
        return model.to(device)


def detect_file(path: str | Path, detector: AudioSealDetector, *, rate: int = 24000, threshold: float = 0.5,
                expected: int | str | None = None) -> dict[str, Any]:
    """A sound file's verdict: the share of its samples the detector scores marked, the decoded
    payload and, given the ``expected`` payload, whether it matches. The file is mixed to mono
    and brought to ``rate`` first (the mark is found at the rate it was added at)."""
    import numpy as np
    import soundfile as sf

    from mstar.audio.io import resample

    samples, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = resample(np.ascontiguousarray(samples.mean(axis=1)), int(file_rate), rate)
    found = detector.detect(torch.from_numpy(np.asarray(mono, dtype=np.float32)), threshold)
    nbits = detector.cfg.nbits
    out: dict[str, Any] = {"file": str(path), "probability": found.probability, "message": found.message,
                           "message_bits": format(found.message, f"0{nbits}b"), "rate": rate,
                           "file_rate": int(file_rate), "seconds": round(len(samples) / file_rate, 3)}
    if expected is not None:
        out["message_matches"] = found.message == bits_to_int(message_bits(expected, nbits))
    return out
