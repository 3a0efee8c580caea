"""Kokoro's voices and voice blends.

A voice is a table ``[rows, 1, 2 * style_dim]``: the style for an utterance of ``n`` phonemes is
row ``n - 1`` (clamped to the table). A request names one voice (``af_heart``) or a blend,
``af_bella+af_sky`` (equal weights) or ``af_bella(2)+af_sky(1)`` (weights normalised to sum
to one); the blend is the weighted mean of the tables.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Sequence

import torch

from mstar.contract import RequestError

__all__ = ["DUMMY_VOICES", "VoiceBank", "parse_voice"]

DUMMY_VOICES = (
    "af_alloy", "af_aoede", "af_bella", "af_heart", "af_jessica", "af_kore", "af_nicole", "af_nova", "af_river",
    "af_sarah", "af_sky", "am_adam", "am_echo", "am_eric", "am_fenrir", "am_liam", "am_michael", "am_onyx",
    "am_puck", "am_santa", "bf_alice", "bf_emma", "bf_isabella", "bf_lily", "bm_daniel", "bm_fable", "bm_george",
    "bm_lewis",
    "ef_dora", "em_alex", "em_santa", "ff_siwis", "hf_alpha", "hf_beta", "hm_omega", "hm_psi", "if_sara", "im_nicola",
    "jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo", "pf_dora", "pm_alex", "pm_santa",
    "zf_xiaobei", "zf_xiaoni", "zf_xiaoxiao", "zf_xiaoyi", "zm_yunjian", "zm_yunxi", "zm_yunxia", "zm_yunyang",
)
"""Voices a ``load_format: dummy`` deployment offers (Kokoro-82M's, all nine languages), each a
seeded random table."""

_PART = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*(?:\(\s*([0-9]*\.?[0-9]+)\s*\))?\s*$")
MAX_BLEND = 8


def parse_voice(spec: str) -> list[tuple[str, float]]:
    """``"a(2)+b"`` -> ``[("a", 2/3), ("b", 1/3)]``; a malformed spec is a ``RequestError``
    naming ``voice``."""
    parts = spec.split("+")
    if len(parts) > MAX_BLEND:
        raise RequestError("voice", f"a blend takes at most {MAX_BLEND} voices, got {len(parts)}")
    named: list[tuple[str, float]] = []
    for part in parts:
        match = _PART.match(part)
        if match is None:
            raise RequestError("voice", f"{spec!r} is not a voice or a blend such as 'af_bella+af_sky' or "
                                        "'af_bella(2)+af_sky(1)'")
        weight = float(match.group(2)) if match.group(2) else 1.0
        named.append((match.group(1), weight))
    total = sum(w for _, w in named)
    if total <= 0:
        raise RequestError("voice", f"the weights of {spec!r} must not all be zero")
    return [(name, w / total) for name, w in named]


class VoiceBank:
    """The tables of a deployment's voices, loaded on first use and kept."""

    def __init__(self, names: Sequence[str], load: Callable[[str], torch.Tensor]) -> None:
        self.names = list(names)
        self._load = load
        self._tables: dict[str, torch.Tensor] = {}

    @classmethod
    def dummy(cls, width: int, rows: int = 510, seed: int = 0) -> VoiceBank:
        def table(name: str) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            return 0.3 * torch.randn(rows, 1, width, generator=g)

        return cls(DUMMY_VOICES, table)

    def table(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise RequestError("voice", f"unknown voice {name!r}; voices are {', '.join(self.names)}")
        if name not in self._tables:
            self._tables[name] = self._load(name)
        return self._tables[name]

    def blend(self, spec: str) -> torch.Tensor:
        """The table of ``spec`` (a voice or a blend)."""
        parts = parse_voice(spec)
        tables = [self.table(name) for name, _ in parts]
        if len({t.shape for t in tables}) > 1:
            raise RequestError("voice", f"the voices of {spec!r} have tables of different shapes")
        return sum(w * t for (_, w), t in zip(parts, tables))

    @staticmethod
    def style(table: torch.Tensor, phonemes: int) -> torch.Tensor:
        """The style row for an utterance of ``phonemes`` phonemes ``[2 * style_dim]``."""
        return table[min(max(phonemes, 1), table.shape[0]) - 1, 0]
