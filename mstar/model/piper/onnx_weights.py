"""Reading a Piper voice's weights straight out of its exported ONNX graph.

Piper ships each voice as ``<voice>.onnx`` plus ``<voice>.onnx.json``; there is no PyTorch
checkpoint. The graph's initializers hold the weights, mostly under their PyTorch names
(``enc_p.encoder.attn_layers.0.conv_q.weight``). Three things need resolving:

- weight norm was removed before export, and the tracer then gives some folded weights
  anonymous names (``onnx::Conv_8168``). We name those by the node that consumes them: input 1
  of ``/flow/flows.6/enc/in_layers.0/Conv`` is ``flow.flows.6.enc.in_layers.0.weight``;
- the phoneme embedding is exported under the name ``sid`` (the tracer reused an input name);
  it is input 0 of ``/enc_p/emb/Gather``, which is how we find it;
- the duration predictor's first affine flow keeps ``logs`` only as ``-logs``: either as the
  anonymous input of ``/dp/flows.0/Exp`` (a plain export) or folded further into
  ``/dp/flows.0/Exp_output_0`` = ``exp(-logs)`` (the released voices, simplified after export).
  Both turn back into ``logs``.

Every other initializer is a shape or scalar constant of the traced graph (integers, or
0-d floats such as ``sqrt(hidden)``), listed as known-ignored; anything else is an error. The
architecture (``PiperArch``) is read back from the weights' shapes and the convolutions'
stride and dilation attributes, so any Piper voice of the VITS family loads without a
hand-written config.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mstar.model.piper.config import PiperArch
from mstar.model.weights import WeightLoadError

__all__ = ["PiperGraphWeights", "read_piper_onnx"]

_PARAM_OPS = {"Conv": ("weight", "bias"), "ConvTranspose": ("weight", "bias"), "Gather": ("weight",)}
_AFFINE_EXP = re.compile(r"^/dp/flows\.0/Exp_output_0$")


@dataclass(frozen=True)
class PiperGraphWeights:
    """Named weights in our module's layout, the architecture, and what was skipped."""

    tensors: dict[str, torch.Tensor]
    arch: PiperArch
    ignored: tuple[str, ...]


def _node_param_name(node_name: str, op: str, index: int) -> str | None:
    """``/flow/flows.6/enc/in_layers.0/Conv`` input 1 -> ``flow.flows.6.enc.in_layers.0.weight``."""
    slots = _PARAM_OPS.get(op)
    offset = 0 if op == "Gather" else 1
    if slots is None or not node_name.startswith("/") or not 0 <= index - offset < len(slots):
        return None
    module = ".".join(node_name.strip("/").split("/")[:-1])
    return f"{module}.{slots[index - offset]}" if module else None


def _attrs(node: object) -> dict[str, object]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}  # type: ignore[attr-defined]


def _resolve(model: object) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, object]], list[str]]:
    from onnx import numpy_helper

    graph = model.graph  # type: ignore[attr-defined]
    consumers: dict[str, list[tuple[object, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))
    tensors: dict[str, torch.Tensor] = {}
    conv_attrs: dict[str, dict[str, object]] = {}
    ignored: list[str] = []
    for init in graph.initializer:
        array = numpy_helper.to_array(init)
        named = None
        for node, index in consumers.get(init.name, []):
            named = _node_param_name(node.name, node.op_type, index)
            if named is not None:
                if node.op_type in ("Conv", "ConvTranspose"):
                    conv_attrs[named] = _attrs(node)
                break
        if named is None and _AFFINE_EXP.match(init.name):
            tensors["dp.flows.0.logs"] = torch.from_numpy(-np.log(array.astype(np.float32)))
            continue
        if named is None and any(n.name == "/dp/flows.0/Exp" for n, _ in consumers.get(init.name, [])):
            tensors["dp.flows.0.logs"] = torch.from_numpy(-array.astype(np.float32))
            continue
        if named is None and not init.name.startswith(("/", "onnx::")) and array.dtype.kind == "f" and array.ndim:
            named = init.name
        if named is None:
            if array.dtype.kind != "f" or array.ndim == 0:
                ignored.append(init.name)
                continue
            raise WeightLoadError(f"Piper ONNX initializer {init.name!r} {array.shape} is not a known weight")
        tensors[named] = torch.from_numpy(array.copy())
    return tensors, conv_attrs, ignored


def _count(tensors: dict[str, torch.Tensor], pattern: str) -> int:
    found = {int(m.group(1)) for k in tensors if (m := re.match(pattern, k))}
    return len(found)


def _arch(t: dict[str, torch.Tensor], attrs: dict[str, dict[str, object]]) -> PiperArch:
    """Read the hyperparameters back from shapes and convolution attributes."""
    emb = t["enc_p.emb.weight"]
    rel = t["enc_p.encoder.attn_layers.0.emb_rel_k"]
    ffn = t["enc_p.encoder.ffn_layers.0.conv_1.weight"]
    flow_ids = sorted({int(m.group(1)) for k in t if (m := re.match(r"flow\.flows\.(\d+)\.", k))})
    dp_ids = sorted({int(m.group(1)) for k in t if (m := re.match(r"dp\.flows\.(\d+)\.proj", k))})
    n_ups = _count(t, r"dec\.ups\.(\d+)\.weight")
    n_res = _count(t, r"dec\.resblocks\.(\d+)\.")
    n_k = n_res // n_ups
    type1 = "dec.resblocks.0.convs1.0.weight" in t
    conv = "convs1" if type1 else "convs"
    dilations = []
    kernels = []
    for j in range(n_k):
        kernels.append(int(t[f"dec.resblocks.{j}.{conv}.0.weight"].shape[-1]))
        n_conv = _count(t, rf"dec\.resblocks\.{j}\.{conv}\.(\d+)\.weight")
        dilations.append(tuple(int(attrs[f"dec.resblocks.{j}.{conv}.{c}.weight"]["dilations"][0])  # type: ignore[index]
                               for c in range(n_conv)))
    flow0 = f"flow.flows.{flow_ids[0]}.enc"
    emb_g = t.get("emb_g.weight")
    return PiperArch(
        n_vocab=emb.shape[0], hidden=emb.shape[1], filter_channels=ffn.shape[0], kernel_size=ffn.shape[-1],
        n_heads=emb.shape[1] // rel.shape[-1], n_layers=_count(t, r"enc_p\.encoder\.attn_layers\.(\d+)\."),
        window_size=(rel.shape[1] - 1) // 2, inter_channels=t["enc_p.proj.weight"].shape[0] // 2,
        dp_filter_channels=t["dp.pre.weight"].shape[0], dp_kernel_size=t["dp.convs.convs_sep.0.weight"].shape[-1],
        dp_n_flows=len(dp_ids) + 1, dp_num_bins=(t[f"dp.flows.{dp_ids[0]}.proj.weight"].shape[0] + 1) // 3,
        flow_n_couplings=len(flow_ids), flow_kernel_size=t[f"{flow0}.in_layers.0.weight"].shape[-1],
        flow_n_layers=_count(t, rf"flow\.flows\.{flow_ids[0]}\.enc\.in_layers\.(\d+)\.weight"),
        flow_dilation_rate=int(attrs[f"{flow0}.in_layers.1.weight"]["dilations"][0])  # type: ignore[index]
        if f"{flow0}.in_layers.1.weight" in attrs else 1,
        resblock="1" if type1 else "2", resblock_kernel_sizes=tuple(kernels),
        resblock_dilation_sizes=tuple(dilations),
        upsample_rates=tuple(int(attrs[f"dec.ups.{i}.weight"]["strides"][0]) for i in range(n_ups)),  # type: ignore[index]
        upsample_initial_channel=t["dec.conv_pre.weight"].shape[0],
        upsample_kernel_sizes=tuple(int(t[f"dec.ups.{i}.weight"].shape[-1]) for i in range(n_ups)),
        n_speakers=emb_g.shape[0] if emb_g is not None else 1,
        gin_channels=emb_g.shape[1] if emb_g is not None else 0,
    )


def read_piper_onnx(path: str | Path) -> PiperGraphWeights:
    """Load ``path`` with the ``onnx`` package (no runtime) and return weights + architecture."""
    import onnx

    model = onnx.load(str(path))
    tensors, attrs, ignored = _resolve(model)
    return PiperGraphWeights(tensors=tensors, arch=_arch(tensors, attrs), ignored=tuple(ignored))


def iter_named(weights: PiperGraphWeights) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors as ``(name, tensor)`` pairs for ``load_weights``."""
    yield from weights.tensors.items()
