"""The S3 speech tokenizer (v2 and v3, as the ``s3tokenizer`` package runs them): 16 kHz speech
-> 25 speech tokens a second from a 6561-entry codebook. CosyVoice2, CosyVoice3 and
Chatterbox's S3Gen read their prompt this way.

The maths:

- **log-mel** (``log_mel``): Whisper's 128-bin features without Whisper's 30 s padding: a
  centred STFT (400-point periodic Hann, hop 160, reflect padding), power, all but the last
  frame, a Slaney mel filterbank, ``log10`` floored at 1e-10, floored again 8 decades under
  the clip's own maximum, mapped by ``(x + 4) / 4``; 100 frames a second.
- **encoder** (``S3Encoder``): two ``kernel 3, stride 2`` convolutions with GELU (100 -> 25
  frames a second; padded frames are zeroed before each), then pre-norm transformer blocks.
  Each block's attention adds rotary positions (rotate-half, on the 64-channel heads) to
  queries and keys, scales both by ``head_dim ** -0.25``, masks padded keys, and adds an
  FSMN memory: a depthwise ``kernel 31`` convolution of the (masked) values plus the values
  themselves. The MLP is ``4 d`` wide with exact GELU.
- **quantiser** (``FSQ``): a linear map to 8 channels, ``tanh``, scaled by 0.999 and rounded
  to {-1, 0, 1}; the eight ternary digits, shifted to {0, 1, 2}, are the token
  ``sum(digit_i * 3**i)`` (0..6560).

v3 (CosyVoice3's ``speech_tokenizer_v3``) is the same network with 12 blocks instead of 6
(``S3TokenizerConfig.v3()``); the package's own v3 class differs only in layer count.

Clips longer than 30 s (3000 mel frames) are tokenised as the package does: 30 s windows
every 26 s, each run on its own, the 2 s on each side of an inner seam dropped
(``_long_clip_tokens``).

Parameter names are the package's state dict (``encoder.conv1.weight``,
``encoder.blocks.<i>.attn.query.weight``, ``quantizer._codebook.project_down.weight``, ...),
what ``S3TokenizerV2.init_from_pt`` loads; Chatterbox stores the same under ``tokenizer.``
in ``s3gen.safetensors`` (``s3_tokenizer_name_map``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.audio.mel import mel_filterbank
from mstar.layers.rotary import RotaryEmbedding, apply_rotary

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
TOKEN_RATE = 25  # tokens a second: 4 mel frames a token
CODEBOOK_SIZE = 3**8  # 6561
WINDOW_FRAMES = 3000  # 30 s: the longest clip encoded in one pass
STRIDE_FRAMES = 2600  # long clips: a window every 26 s (4 s overlap)
SEAM_TOKENS = 50  # long clips: tokens dropped on each side of a seam (half the overlap)


@dataclass(frozen=True)
class S3TokenizerConfig:
    """The encoder's dimensions. The defaults are the released v2 tokenizer."""

    n_mels: int = 128
    d_model: int = 1280
    n_heads: int = 20
    n_layers: int = 6
    fsmn_kernel: int = 31
    rope_theta: float = 10000.0

    @classmethod
    def v3(cls) -> S3TokenizerConfig:
        """CosyVoice3's ``speech_tokenizer_v3``: twelve blocks, otherwise v2."""
        return cls(n_layers=12)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# ----------------------------------------------------------------------------- features
def log_mel(wave: torch.Tensor, n_mels: int = 128) -> torch.Tensor:
    """Log-mel features ``[n_mels, len // 160]`` (float32) of one 16 kHz clip ``[len]``; the
    floor sits 8 decades under this clip's own peak, so clips are featurised one at a time."""
    if wave.dim() != 1:
        raise ValueError(f"expected one mono clip [num_samples], got {tuple(wave.shape)}")
    if wave.shape[0] < 2 * HOP:
        raise ValueError(f"a clip of {wave.shape[0]} samples is too short to tokenize (at least {2 * HOP})")
    wave = wave.to(torch.float32)
    window = torch.hann_window(N_FFT, dtype=torch.float32, device=wave.device)
    stft = torch.stft(wave, N_FFT, HOP, window=window, return_complex=True)
    power = stft[:, :-1].abs() ** 2
    filters = mel_filterbank(n_mels, N_FFT, SAMPLE_RATE, SAMPLE_RATE / 2).to(wave.device, torch.float32)
    log_spec = (filters @ power).clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def pad_mels(mels: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``[n_mels, T_i]`` features into ``[B, n_mels, max T]`` (zeros after each) and their
    lengths ``[B]``."""
    lengths = torch.tensor([m.shape[-1] for m in mels], dtype=torch.long, device=mels[0].device)
    batch = mels[0].new_zeros(len(mels), mels[0].shape[0], int(lengths.max()))
    for row, mel in enumerate(mels):
        batch[row, :, : mel.shape[-1]] = mel
    return batch, lengths


def _valid(lengths: torch.Tensor, size: int) -> torch.Tensor:
    """``[B, size]`` True where a frame is inside its clip."""
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


def _halve(lengths: torch.Tensor) -> torch.Tensor:
    """Frames after a ``kernel 3, stride 2, padding 1`` convolution."""
    return (lengths - 1) // 2 + 1


# ----------------------------------------------------------------------------- encoder
class FSMNAttention(nn.Module):
    """Rotary self-attention over the clip's frames plus the FSMN memory of its values."""

    def __init__(self, config: S3TokenizerConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        # depthwise, centred ("same" length), no bias
        self.fsmn_block = nn.Conv1d(d, d, config.fsmn_kernel, groups=d, bias=False)
        self.fsmn_pad = ((config.fsmn_kernel - 1) // 2, config.fsmn_kernel - 1 - (config.fsmn_kernel - 1) // 2)

    def fsmn(self, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The memory term ``(conv(v) + v) * keep`` of values ``[B, T, d]``, padding zeroed."""
        v = v * keep
        memory = self.fsmn_block(F.pad(v.transpose(1, 2), self.fsmn_pad)).transpose(1, 2)
        return (memory + v) * keep

    def forward(self, x: torch.Tensor, keep: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d]``, ``keep [B, T, 1]`` (1.0 inside the clip), rotary tables ``[T, head_dim]``."""
        b, t, d = x.shape
        q = self.query(x).view(b, t, self.n_heads, -1)
        k = self.key(x).view(b, t, self.n_heads, -1)
        v = self.value(x)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        key_mask = keep[:, None, None, :, 0] > 0  # [B, 1, 1, T]: padded keys get no weight
        heads = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.view(b, t, self.n_heads, -1).transpose(1, 2),
            attn_mask=key_mask)
        return self.out(heads.transpose(1, 2).reshape(b, t, d)) + self.fsmn(v, keep)


class S3Block(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: S3TokenizerConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attn = FSMNAttention(config)
        self.attn_ln = nn.LayerNorm(d, eps=1e-5)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.mlp_ln = nn.LayerNorm(d, eps=1e-5)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x), keep, cos, sin)
        return x + self.mlp(self.mlp_ln(x))


class S3Encoder(nn.Module):
    """Log-mel ``[B, n_mels, T]`` -> hidden states ``[B, ceil(T / 4), d]`` at 25 Hz."""

    def __init__(self, config: S3TokenizerConfig) -> None:
        super().__init__()
        if config.head_dim != 64:
            # the reference's rotary table is built for 64-channel heads and fails on others
            raise ValueError(f"S3 tokenizer heads must be 64 wide, got d_model/n_heads = {config.head_dim}")
        d = config.d_model
        self.conv1 = nn.Conv1d(config.n_mels, d, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList(S3Block(config) for _ in range(config.n_layers))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and their lengths ``[B]`` (frames past a clip's length are padding)."""
        x = F.gelu(self.conv1(mel * _valid(lengths, mel.shape[-1])[:, None, :]))
        lengths = _halve(lengths)
        x = F.gelu(self.conv2(x * _valid(lengths, x.shape[-1])[:, None, :]))
        lengths = _halve(lengths)
        x = x.transpose(1, 2)
        keep = _valid(lengths, x.shape[1])[..., None].to(x.dtype)
        cos, sin = self.rotary.cos_sin(torch.arange(x.shape[1], device=x.device), x.dtype)
        for block in self.blocks:
            x = block(x, keep, cos, sin)
        return x, lengths


class FSQCodebook(nn.Module):
    """Finite scalar quantisation: 8 ternary digits -> one of 3**8 tokens."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.project_down = nn.Linear(d_model, 8)
        # digit i weighs 3**i; not a checkpoint tensor
        self.register_buffer("powers", 3 ** torch.arange(8, dtype=torch.float32), persistent=False)

    def digits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The ternary digits ``{0, 1, 2}`` ``[..., 8]`` (float32)."""
        # 0.999 as the released graph stores it (float32), so values at a rounding edge agree
        h = torch.tanh(self.project_down(hidden).float()) * 0.9990000128746033
        return h.round() + 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Tokens ``[...]`` (int64) of hidden states ``[..., d]``."""
        return (self.digits(hidden) * self.powers).sum(-1).long()


class FSQ(nn.Module):
    """The quantiser wrapper, named as the checkpoint names it (``quantizer._codebook``)."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self._codebook = FSQCodebook(d_model)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._codebook(hidden)


# ----------------------------------------------------------------------------- tokenizer
class S3Tokenizer(nn.Module):
    """16 kHz clips -> S3 speech tokens, batched over clips of different lengths.

    ``tokens, lengths = S3Tokenizer(config)(clips)`` with ``clips`` a list of ``[num_samples]``
    tensors (or one ``[B, num_samples]`` tensor of equal-length clips): ``tokens [B, max]``
    (int64, zeros after each clip's ``lengths[i]``). ``max_tokens`` keeps a prompt's first
    tokens only (Chatterbox's T3 prompt), cutting the features before the encoder as the
    reference does.
    """

    def __init__(self, config: S3TokenizerConfig | None = None) -> None:
        super().__init__()
        self.config = config or S3TokenizerConfig()
        self.encoder = S3Encoder(self.config)
        self.quantizer = FSQ(self.config.d_model)

    def features(self, clips: Sequence[torch.Tensor] | torch.Tensor,
                 max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded log-mel ``[B, n_mels, T]`` and lengths ``[B]`` of 16 kHz clips."""
        device = self.encoder.conv1.weight.device
        mels = [log_mel(torch.as_tensor(clip).to(device), self.config.n_mels) for clip in clips]
        if max_tokens is not None:
            mels = [m[:, : 4 * max_tokens] for m in mels]
        return pad_mels(mels)

    def encode(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-quantiser hidden states ``[B, T', d]`` and token counts ``[B]`` of padded log-mel
        of clips up to 30 s (computed in the weights' dtype)."""
        return self.encoder(mel.to(self.encoder.conv1.weight.dtype), lengths)

    def tokenize_mel(self, mel: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[B, max]`` and their counts ``[B]`` of padded log-mel; a clip over 30 s is cut
        into overlapping windows (``_long_clip_tokens``)."""
        if int(lengths.max()) <= WINDOW_FRAMES:
            hidden, counts = self.encode(mel, lengths)
            return self.quantizer(hidden) * _valid(counts, hidden.shape[1]), counts
        rows = [self._long_clip_tokens(mel[i, :, : int(n)]) for i, n in enumerate(lengths)]
        counts = torch.tensor([len(r) for r in rows], dtype=torch.long, device=mel.device)
        tokens = torch.zeros(len(rows), int(counts.max()), dtype=torch.long, device=mel.device)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = row
        return tokens, counts

    def _long_clip_tokens(self, mel: torch.Tensor) -> torch.Tensor:
        """One clip's tokens ``[n]``: 30 s windows every 26 s, batched, each padded to 30 s; the
        first 2 s of every window but the first and the last 2 s of every window but the last
        are dropped, so each seam keeps the tokens that saw context on both sides."""
        frames = mel.shape[-1]
        starts = list(range(0, frames, STRIDE_FRAMES)) if frames > WINDOW_FRAMES else [0]
        windows = [mel[:, s: s + WINDOW_FRAMES] for s in starts]
        lengths = torch.tensor([w.shape[-1] for w in windows], dtype=torch.long, device=mel.device)
        batch = torch.stack([F.pad(w, (0, WINDOW_FRAMES - w.shape[-1])) for w in windows])
        hidden, counts = self.encode(batch, lengths)
        tokens = self.quantizer(hidden)
        kept = []
        for i, count in enumerate(counts.tolist()):
            first = 0 if i == 0 else SEAM_TOKENS
            last = count if i == len(starts) - 1 else count - SEAM_TOKENS
            kept.append(tokens[i, first:max(first, last)])
        return torch.cat(kept)

    @torch.no_grad()
    def forward(self, clips: Sequence[torch.Tensor] | torch.Tensor,
                max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokenize_mel(*self.features(clips, max_tokens))


def s3_tokenizer_name_map(prefix: str = "") -> Callable[[str], str | None]:
    """A ``load_weights`` name map for a checkpoint that stores the tokenizer under ``prefix``
    (``"tokenizer."`` in Chatterbox's ``s3gen.safetensors``, ``""`` for the package's ``.pt``):
    other tensors are skipped, and so are the mel filterbank and window buffers Chatterbox's
    subclass registers (this module computes both)."""
    derived = {"_mel_filters", "window"}

    def rename(name: str) -> str | None:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix):]
        return None if name in derived else name

    return rename
