"""The CTC vocabulary and its decoding.

The release's tokenizer is a SentencePiece model; only its piece table is needed to decode
(a CTC model never encodes text), so the table is read from the model file's protobuf here
rather than through the ``sentencepiece`` package. transformers' layout ships the same pieces
as ``tokenizer.json``.

Decoding a clip's per-frame argmax: runs of one id collapse to one, blanks (id 0) and control
pieces drop, pieces join, and SentencePiece's word marker becomes a space.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

WORD_MARK = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class CtcVocabulary:
    pieces: tuple[str, ...]
    kinds: tuple[int, ...]  # SentencePiece's piece types (NORMAL, CONTROL, ...)
    blank_id: int = 0

    def __len__(self) -> int:
        return len(self.pieces)

    def decode(self, frame_ids: list[int]) -> str:
        """The text of one clip's per-frame ids."""
        out = bytearray()
        for token, _ in groupby(frame_ids):
            if token == self.blank_id or not 0 <= token < len(self.pieces):
                continue
            kind, piece = self.kinds[token], self.pieces[token]
            if kind in (CONTROL, UNUSED):
                continue
            if kind == BYTE and piece.startswith("<0x") and piece.endswith(">"):
                out.append(int(piece[3:-1], 16))
            elif kind == UNKNOWN:
                out.extend(" \u2047 ".encode())
            else:
                out.extend(piece.encode())
        return out.decode("utf-8", errors="replace").replace(WORD_MARK, " ").strip()

    @classmethod
    def synthetic(cls, size: int) -> CtcVocabulary:
        """A stand-in for dummy weights: four control pieces, then ``▁a``, ``b``, ... cycling."""
        letters = "abcdefghijklmnopqrstuvwxyz"
        pieces = ["<s>", "<pad>", "</s>", "<unk>"]
        kinds = [CONTROL, CONTROL, CONTROL, UNKNOWN]
        for i in range(4, size):
            letter = letters[i % 26]
            pieces.append(WORD_MARK + letter if i % 3 == 0 else letter)
            kinds.append(NORMAL)
        return cls(tuple(pieces[:size]), tuple(kinds[:size]))

    @classmethod
    def from_sentencepiece(cls, path: str | Path) -> CtcVocabulary:
        pieces, kinds = [], []
        for piece, kind in _sentencepiece_pieces(Path(path).read_bytes()):
            pieces.append(piece)
            kinds.append(kind)
        if not pieces:
            raise ValueError(f"{path}: no pieces (not a SentencePiece model)")
        return cls(tuple(pieces), tuple(kinds))

    @classmethod
    def from_tokenizer_json(cls, path: str | Path) -> CtcVocabulary:
        """transformers' layout: a ``tokenizers`` file; its added special tokens are control
        pieces, and so is its unknown piece (transformers' decode skips both)."""
        data = json.loads(Path(path).read_text())
        vocab = data["model"]["vocab"]
        if isinstance(vocab, dict):
            table = {int(i): tok for tok, i in vocab.items()}
        else:  # unigram: [piece, score] rows
            table = {i: row[0] for i, row in enumerate(vocab)}
        special = {int(t["id"]) for t in data.get("added_tokens", []) if t.get("special")}
        unk = data["model"].get("unk_token")
        special |= {i for i, tok in table.items() if unk is not None and tok == unk}
        size = max(table) + 1
        pieces = tuple(table.get(i, "") for i in range(size))
        kinds = tuple(CONTROL if i in special else NORMAL for i in range(size))
        return cls(pieces, kinds)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of a protobuf message, one level deep."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def _sentencepiece_pieces(model: bytes):
    """(piece, type) of every ``ModelProto.pieces`` entry (field 1; a piece's text is its
    field 1, its type field 3, NORMAL when absent)."""
    for number, wire, value in _fields(model):
        if number != 1 or wire != 2:
            continue
        piece, kind = "", NORMAL
        for sub, sub_wire, sub_value in _fields(value):
            if sub == 1 and sub_wire == 2:
                piece = sub_value.decode("utf-8")
            elif sub == 3 and sub_wire == 0:
                kind = sub_value
        yield piece, kind


def encode_sentencepiece(pieces: list[tuple[str, int]]) -> bytes:
    """A minimal ``ModelProto`` holding ``pieces`` ((text, type) rows): what the tests write
    to stand for a released tokenizer."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            byte = n & 0x7F
            n >>= 7
            out.append(byte | (0x80 if n else 0))
            if not n:
                return bytes(out)

    def field(number: int, payload: bytes) -> bytes:
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    blob = bytearray()
    for text, kind in pieces:
        raw = text.encode("utf-8")
        body = field(1, raw) + varint(2 << 3 | 5) + b"\x00\x00\x00\x00" + varint(3 << 3) + varint(kind)
        blob.extend(field(1, body))
    return bytes(blob)
