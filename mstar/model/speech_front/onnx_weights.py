"""Parameters of the released ONNX front ends, read into our PyTorch modules.

CosyVoice3 (Fun-CosyVoice3-0.5B-2512) ships its speech tokenizer as ``speech_tokenizer_v3.onnx``:
an inference graph, not a state dict. Its weights are the graph's initializers, and the name
an initializer carries is not always a parameter name, so the reader walks the nodes:

* the two input convolutions are ``/conv1/Conv`` and ``/conv2/Conv`` (weight and bias inputs);
* every ``nn.Linear`` was exported as a ``MatMul`` whose weight input is anonymous
  (``onnx::MatMul_1234``) and stored transposed, ``[in, out]``, followed by an ``Add`` of the
  bias (a named initializer or a ``Constant`` node); the node names keep the module path, e.g.
  ``/blocks.0/attn/query/MatMul``;
* each LayerNorm is decomposed: its weight is the second input of ``.../attn_ln/Mul``, its bias
  the non-scalar operand of an ``.../attn_ln/Add*`` (another ``Add`` adds the scalar epsilon);
* the FSMN depthwise kernels keep their state-dict names (``blocks.0.attn.fsmn_block.weight``);
* the FSQ projection is ``/quantizer/project_in/MatMul`` + ``quantizer.project_in.bias``.

This is the layout the ``s3tokenizer`` package's own converter (``onnx2torch_v3``) reads; the
tests build a file in it and check our state dict against that converter's. CAM++'s
``campplus.onnx`` is read by ``campplus_onnx_state`` (its folded BatchNorms are described
there). The ``onnx``
package is imported only here and only when a file is read (the ``cosyvoice3`` extra).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["OnnxGraph", "OnnxWeights", "campplus_onnx_state", "read_onnx", "s3_tokenizer_v3_onnx_state"]


@dataclass
class OnnxGraph:
    """What the readers need of an ONNX model: tensors by name (initializers and ``Constant``
    node outputs) and the nodes as ``(name, op_type, inputs)``."""

    initializers: dict[str, np.ndarray]
    constants: dict[str, np.ndarray]
    nodes: list[tuple[str, str, list[str]]]

    def tensor(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return self.initializers[name]
        return self.constants.get(name)


@dataclass
class OnnxWeights:
    """Our state dict from an ONNX file, with the initializers nothing used: ``unused`` are
    float tensors of more than one element (a weight the reader does not know: an error for the
    loader), ``ignored`` the integer and scalar ones (shapes, axes, epsilons of the graph)."""

    state: dict[str, torch.Tensor]
    unused: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("reading the released ONNX front ends needs the `onnx` package: "
                          "pip install -e '.[cosyvoice3]' (or pip install onnx)") from err
    return onnx


def read_onnx(path: str | Path) -> OnnxGraph:
    """Load an ONNX file's initializers, ``Constant`` values and node list (no runtime needed)."""
    onnx = _onnx()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    model = onnx.load(str(path))
    to_array = onnx.numpy_helper.to_array
    initializers = {t.name: to_array(t) for t in model.graph.initializer}
    constants: dict[str, np.ndarray] = {}
    nodes: list[tuple[str, str, list[str]]] = []
    for node in model.graph.node:
        nodes.append((node.name, node.op_type, list(node.input)))
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    constants[node.output[0]] = to_array(attr.t)
    return OnnxGraph(initializers, constants, nodes)


_LINEAR = re.compile(
    r"^/(blocks\.\d+/(?:attn/(?:query|key|value|out)|mlp/mlp\.[02])|quantizer/project_in)/(MatMul|Add)$")
_NORM = re.compile(r"^/blocks\.(\d+)/(attn_ln|mlp_ln)/(Mul|Add(?:_\d+)?)$")
_CONV = re.compile(r"^/(conv[12])/Conv$")
_FSMN = re.compile(r"^blocks\.\d+\.attn\.fsmn_block\.weight$")


def _linear_name(path: str) -> str:
    """``blocks.0/attn/query`` -> ``encoder.blocks.0.attn.query`` (``mlp/mlp.0`` is the export's
    scope for ``mlp.0``); the FSQ projection is our ``quantizer._codebook.project_down``."""
    if path == "quantizer/project_in":
        return "quantizer._codebook.project_down"
    return "encoder." + path.replace("/mlp/mlp.", "/mlp.").replace("/", ".")


def _operand(graph: OnnxGraph, inputs: list[str], *, vector: bool) -> tuple[str, np.ndarray] | None:
    """The input of a node that is a stored tensor (for an ``Add``: a vector, not the epsilon)."""
    for name in inputs:
        value = graph.tensor(name)
        if value is not None and (not vector or value.size > 1):
            return name, value
    return None


def s3_tokenizer_v3_onnx_state(source: str | Path | OnnxGraph) -> OnnxWeights:
    """``speech_tokenizer_v3.onnx`` as an ``S3Tokenizer`` state dict (see the module docstring)."""
    graph = source if isinstance(source, OnnxGraph) else read_onnx(source)
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def put(key: str, name: str, value: np.ndarray, *, transpose: bool = False) -> None:
        array = value.T if transpose else value
        state[key] = torch.from_numpy(np.ascontiguousarray(array).copy())
        used.add(name)

    for node_name, _op, inputs in graph.nodes:
        if m := _CONV.match(node_name):
            for slot, param in ((1, "weight"), (2, "bias")):
                if len(inputs) > slot and (value := graph.tensor(inputs[slot])) is not None:
                    put(f"encoder.{m[1]}.{param}", inputs[slot], value)
        elif m := _LINEAR.match(node_name):
            found = _operand(graph, inputs[1:] if m[2] == "MatMul" else inputs, vector=m[2] == "Add")
            if found is not None:
                param = "weight" if m[2] == "MatMul" else "bias"
                put(f"{_linear_name(m[1])}.{param}", *found, transpose=param == "weight")
        elif m := _NORM.match(node_name):
            found = _operand(graph, inputs, vector=True)
            if found is not None:
                param = "weight" if m[3] == "Mul" else "bias"
                put(f"encoder.blocks.{m[1]}.{m[2]}.{param}", *found)
    for name, value in graph.initializers.items():
        if _FSMN.match(name):
            put(f"encoder.{name}", name, value)
    unused, ignored = [], []
    for name, value in graph.initializers.items():
        if name in used:
            continue
        weight_like = np.issubdtype(value.dtype, np.floating) and value.size > 1
        (unused if weight_like else ignored).append(name)
    return OnnxWeights(state, unused, ignored)


# CAM++ (``campplus.onnx``): the module path of a convolution whose BatchNorm the export folded
# into it -> that BatchNorm's path (the conv is the BatchNorm's only input).
_FOLDED_BN = [
    (re.compile(r"^(head(?:\.layer\d+\.\d+)?)\.conv(\d)$"), r"\1.bn\2"),
    (re.compile(r"^(head\.layer\d+\.\d+\.shortcut)\.0$"), r"\1.1"),
    (re.compile(r"^(xvector\.tdnn)\.linear$"), r"\1.nonlinear.batchnorm"),
    (re.compile(r"^(xvector\.block\d+\.tdnnd\d+)\.linear1$"), r"\1.nonlinear2.batchnorm"),
    (re.compile(r"^xvector\.transit\d+\.linear$"), "xvector.out_nonlinear.batchnorm"),
    (re.compile(r"^(xvector\.dense)\.linear$"), r"\1.nonlinear.batchnorm"),
]
_CONV_NODE = re.compile(r"^/((?:head|xvector)/.*)/Conv$")


def _folded_bn(conv: str) -> str:
    for pattern, repl in _FOLDED_BN:
        if pattern.match(conv):
            return pattern.sub(repl, conv)
    raise ValueError(f"campplus.onnx: conv {conv} has a folded (anonymous) weight but no BatchNorm follows it")


def campplus_onnx_state(source: str | Path | OnnxGraph, eps: float = 1e-5) -> OnnxWeights:
    """``campplus.onnx`` as a ``CampPlus`` state dict.

    CosyVoice exported CAM++ in eval mode with constant folding, which folds every BatchNorm
    that directly follows a convolution into it: the conv's weight and bias become anonymous
    ``onnx::Conv_*`` initializers, and the BatchNorm's own tensors are gone. The pair cannot be
    split back, but it loads exactly into our unchanged modules: the folded kernel into the
    conv, and the BatchNorm set to add the folded bias (scale 1, shift 0, running mean minus
    the bias, running variance ``1 - eps`` so that the normaliser is 1; this also serves the
    scale-free BatchNorm of the final dense layer). Everything else (the pre-activation
    BatchNorms, the CAM layers, the unfolded transits) keeps its state-dict name.
    """
    graph = source if isinstance(source, OnnxGraph) else read_onnx(source)
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for node_name, op, inputs in graph.nodes:
        m = _CONV_NODE.match(node_name)
        if op != "Conv" or not m or len(inputs) < 2 or not inputs[1].startswith("onnx::"):
            continue
        conv = re.sub(r"/[^/]*\.(\d+)$", r".\1", m[1]).replace("/", ".")  # /layer1/layer1.0/ -> layer1.0
        conv = re.sub(r"\.(layer\d+)\.\1\.", r".\1.", conv)
        weight, bias = graph.tensor(inputs[1]), graph.tensor(inputs[2]) if len(inputs) > 2 else None
        if weight is None or bias is None:
            raise ValueError(f"campplus.onnx: folded conv {node_name} lacks its weight or bias")
        bn = _folded_bn(conv)
        state[f"{conv}.weight"] = torch.from_numpy(weight.copy())
        channels = bias.shape[0]
        if not bn.startswith("xvector.dense."):  # the dense layer's BatchNorm has no scale and shift
            state[f"{bn}.weight"] = torch.ones(channels)
            state[f"{bn}.bias"] = torch.zeros(channels)
        state[f"{bn}.running_mean"] = -torch.from_numpy(bias.copy())
        state[f"{bn}.running_var"] = torch.full((channels,), 1.0 - eps)
        used.update(inputs[1:3])
    for name, value in graph.initializers.items():
        if not name.startswith("onnx::") and name not in used:
            state[name] = torch.from_numpy(value.copy())
            used.add(name)
    for name in [k for k in state if k.endswith(".running_var")]:  # a counter eval never reads
        state[name.replace(".running_var", ".num_batches_tracked")] = torch.zeros((), dtype=torch.long)
    unused, ignored = [], []
    for name, value in graph.initializers.items():
        if name not in used:
            (unused if np.issubdtype(value.dtype, np.floating) and value.size > 1 else ignored).append(name)
    return OnnxWeights(state, unused, ignored)
