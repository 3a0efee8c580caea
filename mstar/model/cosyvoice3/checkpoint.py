"""Released weight names (``llm.pt`` and ``flow.pt`` of Fun-CosyVoice3-0.5B, ``llm.pt`` of
CosyVoice2-0.5B) as our modules call them.

``llm.pt`` is the reference ``CosyVoice3LM`` / ``Qwen2LM`` state dict: the Qwen2 backbone under
``llm.model.`` (a ``Qwen2ForCausalLM``, so ``llm.model.model.*`` and its text head
``llm.model.lm_head.weight``), ``speech_embedding``, ``llm_decoder`` and (CosyVoice2)
``llm_embedding``. The text head is never read by the speech LM (its tied copy is the token
embedding, which is kept), so its name is skipped. ``flow.pt`` is ``CausalMaskedDiffWithDiT``'s:
``input_embedding``, ``spk_embed_affine_layer``, ``pre_lookahead_layer`` and the DiT under
``decoder.estimator.``. Each map returns None for a name it skips on purpose and leaves any
other name unchanged, so ``load_weights`` (strict) reports a name nothing fills.

The clip front ends ship as ONNX graphs: ``speech_tokenizer_v3.onnx`` is read into our
``S3Tokenizer`` (``load_speech_tokenizer``) and ``campplus.onnx`` into ``CampPlus``
(``load_speaker_encoder``); both need the ``onnx`` package, and errors name the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.model.cosyvoice3.dit import DiTEstimator
from mstar.model.cosyvoice3.flow import CosyVoice3Flow, FlowConfig
from mstar.model.cosyvoice3.lm import SpeechLM, SpeechLMConfig
from mstar.model.cosyvoice3.qwen2 import qwen2_config
from mstar.model.speech_front.campplus import CampPlus, CampPlusConfig
from mstar.model.speech_front.onnx_weights import OnnxWeights, campplus_onnx_state, s3_tokenizer_v3_onnx_state
from mstar.model.speech_front.s3_tokenizer import S3Tokenizer, S3TokenizerConfig
from mstar.model.vocoder import HiFTConfig, HiFTGenerator, hift_state
from mstar.model.weights import WeightLoadError, building, load_weights

__all__ = ["LLM_SKIPPED", "CosyVoice3Parts", "build_flow", "dit_name_map", "flow_name_map", "llm_name_map",
           "load_parts", "load_speaker_encoder", "load_speech_tokenizer"]

TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
SPEAKER_FILE = "campplus.onnx"

LLM_SKIPPED = frozenset({"llm.model.lm_head.weight"})

_DIT_RENAMES = [
    (r"^time_embed\.time_mlp\.0\.", "time_in."),
    (r"^time_embed\.time_mlp\.2\.", "time_out."),
    (r"^input_embed\.proj\.", "input_proj."),
    (r"^input_embed\.conv_pos_embed\.(conv[12])\.0\.", r"pos_conv.\1."),
    (r"^rotary_embed\.inv_freq$", "rotary_inv_freq"),
    (r"^transformer_blocks\.", "blocks."),
    (r"\.attn_norm\.linear\.", ".modulation."),
    (r"\.attn\.to_out\.0\.", ".attn.to_out."),
    (r"\.ff\.ff\.0\.0\.", ".ff_in."),
    (r"\.ff\.ff\.2\.", ".ff_out."),
    (r"^norm_out\.linear\.", "final_modulation."),
]

_FLOW_RENAMES = {
    "input_embedding.": "token_embedding.",
    "spk_embed_affine_layer.": "speaker_proj.",
    "pre_lookahead_layer.": "lookahead.",
}


def llm_name_map(name: str) -> str | None:
    """A released ``llm.pt`` name as ``SpeechLM`` calls it (None: the unused text head)."""
    if name in LLM_SKIPPED:
        return None
    return "llm.model." + name[len("llm.model.model."):] if name.startswith("llm.model.model.") else name


def dit_name_map(name: str) -> str:
    """A name of the reference ``DiT`` as ``DiTEstimator`` calls it."""
    for pattern, repl in _DIT_RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def flow_name_map(name: str) -> str:
    """A released ``flow.pt`` name as ``CosyVoice3Flow`` calls it."""
    if name.startswith("decoder.estimator."):
        return "estimator." + dit_name_map(name[len("decoder.estimator."):])
    for old, new in _FLOW_RENAMES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass
class CosyVoice3Parts:
    lm: SpeechLM
    flow: CosyVoice3Flow
    hift: HiFTGenerator


def build_flow(config: FlowConfig, device: torch.device | str = "cpu",
               estimator_dtype: torch.dtype = torch.float32) -> CosyVoice3Flow:
    """The flow made on ``device``: float32, its DiT in ``estimator_dtype`` (bfloat16 serves
    faster), each made in its dtype at once (``weights.building``), never float32 then cast.
    The DiT's rotary frequencies stay float32 (its constructor computes them so: rounded to
    bfloat16 they would be off by up to 0.4%, an angle error that grows with the position);
    the Euler state and the conditioning are float32 (``CosyVoice3Flow.velocity`` casts)."""
    with building(device, estimator_dtype):
        estimator = DiTEstimator(config.dit)
    with building(device, torch.float32):
        return CosyVoice3Flow(config, estimator)


def _state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (a Fun-CosyVoice3 directory holds llm.pt, flow.pt and hift.pt)")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_parts(model_dir: str | Path, *, speech_token_size: int = 6561, flow: FlowConfig | None = None,
               hift: HiFTConfig | None = None, device: torch.device | str = "cpu",
               lm_dtype: torch.dtype = torch.float32, estimator_dtype: torch.dtype = torch.float32) -> CosyVoice3Parts:
    """The three models of a Fun-CosyVoice3 directory (as the reference's ``CosyVoice3`` reads
    it): the LM from ``CosyVoice-BlankEN/config.json`` and ``llm.pt``, the flow from ``flow.pt``,
    the causal HiFT from ``hift.pt``, each loaded strictly. The other hyper-parameters are the
    released ``cosyvoice3.yaml``'s (the defaults here), not read from the YAML. The LM is made
    on ``device`` in ``lm_dtype`` and the flow by ``build_flow`` (its DiT in
    ``estimator_dtype``); the released float32 tensors are cast to each parameter's dtype as
    they are copied in. HiFT is float32 (the reference's precision), made on the CPU and moved."""
    root = Path(model_dir)
    backbone = qwen2_config(json.loads((root / "CosyVoice-BlankEN" / "config.json").read_text()))
    with building(device, lm_dtype):
        lm = SpeechLM(SpeechLMConfig(backbone=backbone, speech_token_size=speech_token_size))
    load_weights(lm, _state(root / "llm.pt").items(), name_map=llm_name_map)
    flow_model = build_flow(flow or FlowConfig(), device, estimator_dtype)
    load_weights(flow_model, _state(root / "flow.pt").items(), name_map=flow_name_map)
    vocoder = HiFTGenerator(hift or HiFTConfig(causal=True))
    load_weights(vocoder, hift_state(_state(root / "hift.pt")).items())
    return CosyVoice3Parts(lm.eval(), flow_model.eval(), vocoder.to(device).eval())


def _load_onnx(path: Path, read: Callable[[Path], OnnxWeights], module: torch.nn.Module,
               device: torch.device | str) -> torch.nn.Module:
    """``module`` filled from the ONNX file ``path`` by the reader ``read``, strictly: every
    parameter filled, and a float initializer the reader does not place is an error (integer
    and scalar initializers are the graph's shapes and epsilons); every error names the file."""
    try:
        weights = read(path)
    except ImportError as err:
        raise ImportError(f"{path}: {err}") from err
    if weights.unused:
        shown = ", ".join(weights.unused[:8])
        raise WeightLoadError(f"{path}: {len(weights.unused)} initializers no parameter takes ({shown})")
    try:
        load_weights(module, weights.state.items())
    except WeightLoadError as err:
        raise WeightLoadError(f"{path}: {err}") from err
    return module.to(device).eval()


def load_speech_tokenizer(model_dir: str | Path, config: S3TokenizerConfig | None = None,
                          device: torch.device | str = "cpu") -> S3Tokenizer:
    """The S3 tokenizer v3 from the directory's ``speech_tokenizer_v3.onnx``, loaded strictly
    (``_load_onnx``)."""
    return _load_onnx(Path(model_dir) / TOKENIZER_FILE, s3_tokenizer_v3_onnx_state,
                      S3Tokenizer(config or S3TokenizerConfig.v3()), device)


def load_speaker_encoder(model_dir: str | Path, config: CampPlusConfig | None = None,
                         device: torch.device | str = "cpu") -> CampPlus:
    """CAM++ from the directory's ``campplus.onnx``: its conv-then-BatchNorm pairs are folded in
    the export and load as a conv plus a BatchNorm that adds the folded bias (see
    ``campplus_onnx_state``); strict as ``load_speech_tokenizer``."""
    return _load_onnx(Path(model_dir) / SPEAKER_FILE, campplus_onnx_state, CampPlus(config or CampPlusConfig()),
                      device)
