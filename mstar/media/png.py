"""PNG encoding of RGB pixels on several cores at once.

A 1024x1024 image is 3 MB of pixels; one core deflating it at zlib's fastest level takes
20-100 ms (more for noise-like content), which would be a large share of a 4-step image's
latency. The image's rows are cut into horizontal strips, each filtered and deflated on a
thread of its own (numpy and zlib release the GIL for this work), and the pieces are joined
into ONE valid zlib stream the way pigz does it: every strip but the last ends with a sync
flush (an empty stored block that leaves the stream byte-aligned and not final), so the raw
deflate outputs concatenate; the stream's Adler-32 is combined from the strips' checksums.
Each strip's output is an IDAT chunk of its own (PNG reads consecutive IDATs as one stream),
so the chunks' CRC-32s are computed on the strips' threads too and nothing serial touches
the whole image but the final join.

Every row uses PNG's "Sub" filter (the byte minus the same channel of the pixel to its left)
and deflate looks for runs only (``Z_RLE``): OpenCV's fast PNG settings, which on photographs
compress as well as zlib's full match search at its fastest level, in less time. Decoders see
an ordinary 8-bit RGB PNG.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SUB_FILTER = 1
_ADLER_MOD = 65521
_MIN_STRIP_BYTES = 256 * 1024  # below this a strip is not worth a thread hand-off
_MAX_THREADS = 16

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


_ZLIB_HEADER = b"\x78\x01"  # deflate, 32 KiB window, "fastest" level hint; FCHECK makes it a multiple of 31


def _threads() -> int:
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads(), thread_name_prefix="mstar-png")
        return _pool


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


def _adler32_combine(first: int, second: int, second_length: int) -> int:
    """Adler-32 of ``A + B`` from that of ``A``, that of ``B`` and ``len(B)`` (zlib's
    adler32_combine, which Python's zlib module does not expose)."""
    rem = second_length % _ADLER_MOD
    a1, b1 = first & 0xFFFF, first >> 16
    a2, b2 = second & 0xFFFF, second >> 16
    a = (a1 + a2 - 1) % _ADLER_MOD
    b = (b1 + b2 + rem * a1 - rem) % _ADLER_MOD
    return (b << 16) | a


def _filtered(rows: np.ndarray) -> bytes:
    """PNG scanlines of ``rows`` (``uint8 [h, w, 3]``): a filter-type byte, then the row with
    the Sub filter applied (``x[i] - x[i - 3]`` modulo 256)."""
    h = rows.shape[0]
    flat = rows.reshape(h, -1)
    out = np.empty((h, flat.shape[1] + 1), dtype=np.uint8)
    out[:, 0] = _SUB_FILTER
    out[:, 1:4] = flat[:, :3]
    np.subtract(flat[:, 3:], flat[:, :-3], out=out[:, 4:])
    return out.tobytes()


def _deflate_strip(rows: np.ndarray, level: int, first: bool, last: bool) -> tuple[bytes, int, int, int]:
    """One strip's IDAT payload (its raw deflate data, sync-flushed unless it ends the stream;
    the zlib header in front of the first), the chunk's running CRC-32 over type and payload,
    and the Adler-32 and length of the strip's scanlines."""
    data = _filtered(rows)
    packer = zlib.compressobj(level, zlib.DEFLATED, -15, 8, zlib.Z_RLE)
    body = packer.compress(data) + packer.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)
    if first:
        body = _ZLIB_HEADER + body
    return body, zlib.crc32(body, zlib.crc32(b"IDAT")), zlib.adler32(data), len(data)


def encode_png(pixels: np.ndarray, level: int = 1, threads: int | None = None) -> bytes:
    """``pixels`` (``uint8 [H, W, 3]``) as PNG bytes, deflated at zlib ``level`` (0-9) on up
    to ``threads`` threads (default: the cores, at most 8)."""
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"PNG encoding takes uint8 [H, W, 3] pixels, got {pixels.dtype} {list(pixels.shape)}")
    if not 0 <= level <= 9:
        raise ValueError(f"zlib level must be 0-9, got {level}")
    height, width, _ = pixels.shape
    if height == 0 or width == 0:
        raise ValueError(f"a PNG needs at least one pixel, got {width}x{height}")
    pixels = np.ascontiguousarray(pixels)
    row_bytes = 3 * width + 1
    strips = max(1, min(threads or _threads(), height, (height * row_bytes) // _MIN_STRIP_BYTES))
    bounds = np.linspace(0, height, strips + 1).astype(int)
    jobs = [(pixels[a:b], level, i == 0, i == strips - 1) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    if strips == 1:
        parts = [_deflate_strip(*jobs[0])]
    else:
        parts = list(_executor().map(lambda job: _deflate_strip(*job), jobs))
    checksum = 1  # Adler-32 of nothing
    for _, _, adler, length in parts:
        checksum = _adler32_combine(checksum, adler, length)
    trailer = struct.pack(">I", checksum)  # the zlib stream's Adler-32 ends the last chunk
    chunks = []
    for i, (body, crc, _, _) in enumerate(parts):
        tail = trailer if i == len(parts) - 1 else b""
        crc = zlib.crc32(tail, crc)
        chunks += [struct.pack(">I", len(body) + len(tail)), b"IDAT", body, tail, struct.pack(">I", crc)]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"".join([_SIGNATURE, _chunk(b"IHDR", header), *chunks, _chunk(b"IEND", b"")])
