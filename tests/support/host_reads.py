"""Counting the operations that make the host wait for the device, on the CPU.

On CUDA, a step that reads a device tensor back (``.item()``, ``int(t)``, ``bool(t)``,
``if t:``, ``.tolist()``, ``.cpu()``), or whose output shape depends on the data (boolean
indexing, ``nonzero``, ``torch.unique``, ``repeat_interleave`` without ``output_size``),
waits for every kernel queued before it: a host synchronisation. A blocking copy of host
data to the device (``torch.tensor(ids, device=dev)``: PyTorch copies pageable memory and
synchronises the stream) waits the same way. No GPU is needed to find them: the same ATen
ops run on the CPU, where ``HostReads`` sees them through a ``TorchDispatchMode`` (and the
Python-level reads no ATen op shows on the CPU, ``tolist``, ``cpu``, ``numpy``, through a
``TorchFunctionMode``), each with the innermost ``mstar/`` frame that issued it.

    with HostReads() as seen:
        engine.run(items)
    assert seen.count() == 2, seen.report()

On the CPU every tensor is a host tensor: a read of a tensor that lives on the host in a
GPU run too (the front end's samples) is counted all the same; a test names such sites
(``ignore``) with its reason. ``x.to("cpu")`` counts only with the name ``"cpu"`` (on the CPU the
engine's ``torch.device`` is the CPU too) and not with ``non_blocking`` (a copy the next
blocking read waits for). ``uploads`` lists the blocking host-to-device copies of host
data the CPU shows unambiguously (``torch.tensor``/``torch.as_tensor`` given a ``device``);
``x.to(device)`` of a host tensor is a no-op on the CPU and cannot be seen here.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ATen ops that read a device value back on the host, or whose output's shape is the data's.
# Under ``torch.inference_mode`` the mode sees the composite ops (``item``, ``is_nonzero``,
# ``where(mask)``, ...) before they decompose; outside it, what they decompose to.
_READS = {
    aten._local_scalar_dense.default: "item",  # .item(), int(t), float(t), bool(t), if t:
    aten.item.default: "item",
    aten.is_nonzero.default: "item",  # bool(t), if t:
    aten.allclose.default: "item",
    aten.nonzero.default: "nonzero",  # nonzero, torch.where(mask), argwhere
    aten.nonzero_numpy.default: "nonzero",
    aten.where.default: "nonzero",  # torch.where(mask), one argument
    aten.argwhere.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_dim_consecutive.default: "unique",
    aten.bincount.default: "bincount",  # its length is the largest value
    aten.equal.default: "equal",  # a host bool
}
_BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_REPEATS = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_HOST_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}
_UPLOADS = {torch.tensor, torch.as_tensor}
_HERE = __file__
_PACKAGE = str(Path(__import__("mstar").__file__).parent)  # what a site names


@dataclass(frozen=True)
class Read:
    what: str  # "item", "nonzero", "bool index", "tolist", ... or "upload"
    site: str  # the innermost mstar/ frame: "mstar/model/x.py:123 (function)"


def _site() -> str:
    """The innermost frame in the mstar package (else the innermost outside this file and torch)."""
    frame, outer = sys._getframe(1), None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PACKAGE):
            return f"mstar{name[len(_PACKAGE) :]}:{frame.f_lineno} ({frame.f_code.co_name})"
        if outer is None and name != _HERE and "/torch/" not in name:
            outer = f"{name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return outer or "?"


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _READS.get(func)
        if what is None and func in _BOOL_INDEXED and _bool_index(args):
            what = "bool index"
        if what is None and func in _REPEATS and kwargs.get("output_size") is None:
            what = "repeat_interleave"
        if what is not None:
            self.owner._add(what)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_METHODS:
            self.owner._add(_HOST_METHODS[func])
        elif func is torch.Tensor.to and _to_host(args, kwargs):
            self.owner._add("to host")
        elif func in _UPLOADS and _device(kwargs) and not isinstance(args[0], torch.Tensor):
            self.owner._add("upload")
        return func(*args, **kwargs)


def _device(kwargs) -> bool:
    """A ``device=`` given, other than the name ``"cpu"`` (the host in a GPU run too; an
    engine's own ``torch.device`` is the CPU here, and counts)."""
    device = kwargs.get("device")
    return device is not None and device != "cpu"


def _to_host(args, kwargs) -> bool:
    """``x.to("cpu", ...)`` without ``non_blocking``. Only the name ``"cpu"`` counts: on the CPU
    the engine's own ``torch.device`` is the CPU too, and ``x.to(device)`` moves a tensor there."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    blocking = not kwargs.get("non_blocking", any(a is True for a in args[2:]))
    return target == "cpu" and blocking


@dataclass
class HostReads:
    """The host synchronisations of the code run inside it (``reads``), and the blocking
    uploads of host data (``uploads``). ``ignore``: sites (substrings of ``Read.site``) whose
    tensors live on the host in a GPU run too."""

    ignore: tuple[str, ...] = ()
    reads: list[Read] = field(default_factory=list)
    uploads: list[Read] = field(default_factory=list)

    def __enter__(self) -> HostReads:
        self._modes = (_Function(self), _Dispatch(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def _add(self, what: str) -> None:
        site = _site()
        if any(part in site for part in self.ignore):
            return
        (self.uploads if what == "upload" else self.reads).append(Read(what, site))

    def count(self) -> int:
        return len(self.reads)

    def sites(self, uploads: bool = False) -> Counter[Read]:
        """Each (what, site) with how many times it ran."""
        return Counter(self.uploads if uploads else self.reads)

    def report(self) -> str:
        """One line per site, most frequent first: what a failing assertion prints."""
        lines = [f"{n:4d} x {r.what:<17} {r.site}" for r, n in self.sites().most_common()]
        lines += [f"{n:4d} x {r.what:<17} {r.site}" for r, n in self.sites(uploads=True).most_common()]
        return "\n".join(lines) or "(none)"
