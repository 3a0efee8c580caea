"""Write an ONNX file in the released ``speech_tokenizer_v3.onnx`` layout from a state dict.

The file carries the nodes and initializers the weight readers look at (named as the released
export names them: see ``mstar.model.speech_front.onnx_weights``), not a runnable graph: the
tests check which tensor lands in which parameter, and the token parity comes from running
our module with those parameters against the recorded reference. ``record_onnx_reference.py``
checks that the ``s3tokenizer`` package's own converter reads a file written here into the
same state dict, so the layout is the one that converter expects of the released file.
Used by the record script (in its separate venv) as well as the tests: numpy, torch and onnx
only.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch


def write_s3_v3_onnx(state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` (names as ``S3Tokenizer`` / the package's ``S3TokenizerV3`` call them) as a
    released-layout ONNX file. The attention and MLP biases of even blocks are named
    initializers, of odd blocks ``Constant`` nodes (the converter reads both); shape and
    epsilon constants stand beside them, as in an exported graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    initializers: list = []
    nodes: list = []
    counter = iter(range(1000, 100000))

    def tensor(name: str, value: np.ndarray):
        return numpy_helper.from_array(np.ascontiguousarray(value), name)

    def add_init(name: str, value: np.ndarray) -> str:
        initializers.append(tensor(name, value))
        return name

    def add_const(value: np.ndarray) -> str:
        out = f"/Constant_{next(counter)}_output_0"
        nodes.append(helper.make_node("Constant", [], [out], name=f"/Constant_{next(counter)}",
                                      value=tensor(out, value)))
        return out

    def node(op: str, name: str, inputs: list[str]) -> None:
        nodes.append(helper.make_node(op, inputs, [f"{name}_output_0"], name=name))

    def arr(key: str) -> np.ndarray:
        return state[key].detach().float().numpy()

    for conv in ("conv1", "conv2"):
        node("Conv", f"/{conv}/Conv", ["x", add_init(f"{conv}.weight", arr(f"encoder.{conv}.weight")),
                                       add_init(f"{conv}.bias", arr(f"encoder.{conv}.bias"))])
    blocks = sorted({int(m[1]) for k in state if (m := re.match(r"encoder\.blocks\.(\d+)\.", k))})
    for i in blocks:
        pre = f"encoder.blocks.{i}"
        for ln in ("attn_ln", "mlp_ln"):
            node("Add", f"/blocks.{i}/{ln}/Add", ["var", add_const(np.array(1e-5, dtype=np.float32))])
            node("Mul", f"/blocks.{i}/{ln}/Mul", ["x", add_init(f"blocks.{i}.{ln}.weight", arr(f"{pre}.{ln}.weight"))])
            node("Add", f"/blocks.{i}/{ln}/Add_1", ["x", add_init(f"blocks.{i}.{ln}.bias", arr(f"{pre}.{ln}.bias"))])
        linears = [f"attn/{p}" for p in ("query", "key", "value", "out")] + ["mlp/mlp.0", "mlp/mlp.2"]
        for sub in linears:
            dotted = sub.replace("/", ".").replace("mlp.mlp", "mlp")
            weight = add_init(f"onnx::MatMul_{next(counter)}", arr(f"{pre}.{dotted}.weight").T)
            node("MatMul", f"/blocks.{i}/{sub}/MatMul", ["x", weight])
            if f"{pre}.{dotted}.bias" in state:
                bias = arr(f"{pre}.{dotted}.bias")
                name = add_init(f"blocks.{i}.{dotted}.bias", bias) if i % 2 == 0 else add_const(bias)
                node("Add", f"/blocks.{i}/{sub}/Add", [name, f"/blocks.{i}/{sub}/MatMul_output_0"])
        fsmn = add_init(f"blocks.{i}.attn.fsmn_block.weight", arr(f"{pre}.attn.fsmn_block.weight"))
        node("Conv", f"/blocks.{i}/attn/fsmn_block/Conv", ["x", fsmn])
        node("Reshape", f"/blocks.{i}/attn/Reshape", ["x", add_init(f"onnx::Reshape_{next(counter)}",
                                                                      np.array([0, 0, 2, -1], dtype=np.int64))])
    down = "quantizer._codebook.project_down"
    down_weight = add_init(f"onnx::MatMul_{next(counter)}", arr(f"{down}.weight").T)
    node("MatMul", "/quantizer/project_in/MatMul", ["x", down_weight])
    node("Add", "/quantizer/project_in/Add", ["x", add_init("quantizer.project_in.bias", arr(f"{down}.bias"))])
    graph = helper.make_graph(nodes, "speech_tokenizer_v3",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)],
                              initializer=initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]), str(path))
