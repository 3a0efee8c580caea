"""How the released Nemotron VoiceChat checkpoint's input-side tensors map onto the duplex
model's speech encoder (``SpeechEncoder``) and nano LLM (``NemotronHForCausalLM``).

NeMo's ``NemotronVoiceChat`` keeps its speech-to-text half, ``DuplexSTTModel``, under
``stt_model.`` (its talker under ``tts_model.``, read by ``mstar/model/eartts/checkpoint.py``).
The STT model takes the Hugging Face LLM apart: ``llm`` is the Nemotron-H backbone without its
embedding table (``llm_attr_name: backbone``, ``embed_tokens_attr_name: embeddings``), the
table is ``embed_tokens`` and the text head ``lm_head``; its ``perception`` is an
``AudioPerceptionModule`` (the FastConformer ``encoder``, an identity ``modality_adapter`` and
the ``proj`` linear to the LLM's width). So, from NeMo 3.0's module paths:

* ``stt_model.perception.encoder.*``: NeMo ``ConformerEncoder`` names in its causal layout,
  mapped as ``encoder_name`` says (``pre_encode.conv.{0,2,3,5,6}`` the causal subsampling's
  convolutions, ``pre_encode.out`` its linear, ``linear_q/k/v/out/pos`` and ``pos_bias_u/v``
  the attention's, ``conv.batch_norm`` the conv module's norm, a LayerNorm in this layout
  whatever its name);
* ``stt_model.perception.proj.{weight,bias}``: the projection to the LLM's width;
* ``stt_model.llm.{layers.<i>.*,norm_f.weight}``, ``stt_model.embed_tokens.weight``,
  ``stt_model.lm_head.weight`` and ``stt_model.function_head.weight``: the nano LLM (our
  ``backbone.*``, ``backbone.embeddings``, ``lm_head`` and ``function_head``).

Skipped on purpose (the served walk does not use them): the front end's buffers
(``stt_model.perception.preprocessor.*``: its window and filterbank, recomputed by
``features.py``), the user-transcript heads (``stt_model.rnnt_decoder.*``,
``stt_model.rnnt_joint.*``, ``stt_model.asr_head.*``). Any other tensor, a modality
adapter's or ``stt_model.embed_asr_tokens`` (a user-text channel fed back into the LLM) among
them, fails the load naming it, as does a parameter no tensor fills.

The tool-call head ``stt_model.function_head.weight`` is the nano LLM's ``function_head``
(``DuplexLLM``): the release's STT model (NeMo's ``nemotron-labs-voicechat`` branch) feeds its
greedy token back into every position as a channel of its own. A checkpoint with the head needs
``use_function_head: true`` in ``config.json`` (the load fails naming the tensor otherwise),
and one without it needs the flag off (the head's parameter is then unfilled).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from mstar.model.fastconformer.nemo_names import conformer_renamer

ENCODER = "stt_model.perception.encoder."
PROJ = "stt_model.perception.proj."
LLM = "stt_model.llm."
EMBED = "stt_model.embed_tokens.weight"
HEAD = "stt_model.lm_head.weight"
TALKER = "tts_model."
FUNCTION_HEAD = "stt_model.function_head."
SKIPPED = ("stt_model.perception.preprocessor.", "stt_model.rnnt_decoder.", "stt_model.rnnt_joint.",
           "stt_model.asr_head.")

_conformer_name = conformer_renamer((  # the causal subsampling's convolutions, then the layers'
    (r"^pre_encode\.conv\.0\.", "subsampling.conv_in."),
    (r"^pre_encode\.conv\.2\.", "subsampling.layers.0.depthwise_conv."),
    (r"^pre_encode\.conv\.3\.", "subsampling.layers.0.pointwise_conv."),
    (r"^pre_encode\.conv\.5\.", "subsampling.layers.1.depthwise_conv."),
    (r"^pre_encode\.conv\.6\.", "subsampling.layers.1.pointwise_conv."),
    (r"^pre_encode\.out\.", "subsampling.linear.")))


def encoder_name(name: str) -> str | None:
    """The ``SpeechEncoder`` parameter a released tensor fills (None: not the encoder's)."""
    if name.startswith(ENCODER):
        return "encoder." + _conformer_name(name[len(ENCODER):])
    if name.startswith(PROJ):
        return "proj." + name[len(PROJ):]
    return None


def llm_name(name: str) -> str | None:
    """The ``NemotronHForCausalLM`` parameter a released tensor fills (None: not the LLM's)."""
    if name.startswith(LLM):
        return "backbone." + name[len(LLM):]
    if name == EMBED:
        return "backbone.embeddings.weight"
    if name == HEAD:
        return "lm_head.weight"
    if name.startswith(FUNCTION_HEAD):
        return "function_head." + name[len(FUNCTION_HEAD):]
    return None


def _known(name: str) -> bool:
    return (name.startswith((TALKER, *SKIPPED)) or encoder_name(name) is not None
            or llm_name(name) is not None)


def read_part(folder: Path, rename) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``folder`` that ``rename`` maps (as ``(our name, tensor)``), read
    lazily; first every name of the checkpoint is checked, and a tensor no part of the
    VoiceChat layout reads fails the load (``WeightLoadError`` naming it)."""
    from safetensors import safe_open

    from mstar.model.weights import WeightLoadError, _safetensors_files

    files = _safetensors_files(folder)
    names = []
    for file in files:
        with safe_open(file, framework="pt") as handle:
            names += list(handle.keys())
    unknown = [name for name in names if not _known(name)]
    if unknown:
        shown = ", ".join(sorted(unknown)[:8]) + (f" (and {len(unknown) - 8} more)" if len(unknown) > 8 else "")
        raise WeightLoadError(f"{folder}: checkpoint tensors outside the VoiceChat layout: {shown}")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                ours = rename(name)
                if ours is not None:
                    yield ours, handle.get_tensor(name)


def load_encoder(encoder: torch.nn.Module, folder: Path, dtype: torch.dtype | None = None) -> None:
    """Fill ``encoder`` (a ``SpeechEncoder``) from the folder, coverage checked both ways."""
    from mstar.model.weights import load_weights

    load_weights(encoder, read_part(folder, encoder_name), dtype=dtype)


def load_llm(llm: torch.nn.Module, folder: Path, dtype: torch.dtype | None = None) -> None:
    """Fill ``llm`` (the nano ``DuplexLLM``) from the folder, coverage checked both ways (an
    untied head: the release stores ``lm_head`` apart from the embeddings)."""
    from mstar.model.weights import WeightLoadError, load_weights

    def rename(name: str) -> str | None:
        if name.startswith(FUNCTION_HEAD) and getattr(llm, "function_head", None) is None:
            raise WeightLoadError(f"{folder}: the checkpoint has a tool-call head ({name}); set "
                                  "use_function_head: true in config.json to run its channel")
        return llm_name(name)

    load_weights(llm, read_part(folder, rename), dtype=dtype)
