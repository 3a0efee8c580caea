"""Record the duplex input side's fixture from NeMo's own speech-to-text model code.

nemo-toolkit 3.0.0 does not install beside this project's torch, so two of its files are
imported directly: ``speechlm2/models/duplex_stt_model.py`` (``DuplexSTTModel``, whose
``forward`` runs the LLM and its text head) and ``speechlm2/streaming/duplex_stt_inference.py``
(``DuplexSTTStreamingInference``: how a call's sequence is laid out, the system prompt
before the first frame, and how each frame is fused with the previous agent token). The NeMo
helpers they name (Lightning, PEFT, metrics, tokenizer, loaders) are stubbed. The LLM is
transformers' ``NemotronHForCausalLM`` taken apart as NeMo's constructor takes it apart
(``llm`` the backbone without its embedding table, ``embed_tokens``, ``lm_head``).

NeMo's perception module (``AudioPerceptionModule``: its ConformerEncoder and featurizer) is
not run: it imports most of NeMo's ASR collection. The fixture's perception output is fixed
frames standing in for it, so the fixture checks everything after the encoder's projection.

    pip download nemo-toolkit==3.0.0 --no-deps -d /tmp/eartts-src
    (cd /tmp/eartts-src && unzip -q nemo_toolkit-3.0.0-*.whl)
    pip install --target /tmp/eartts-ref/site omegaconf==2.3.0
    PYTHONPATH=$PWD:/tmp/eartts-ref/site NEMO_SRC=/tmp/eartts-src \\
        python tests/model/nemotron_duplex/record_reference.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent
OUT = HERE / "fixtures" / "duplex_stt_reference.pt"

PAD, BOS, EOS = 3, 1, 2
LLM = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
           intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
           chunk_size=16, layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=BOS,
           pad_token_id=PAD, hybrid_override_pattern="M*-M-*M")
USER_WEIGHT, TEXT_WEIGHT = 0.7, 1.3
FRAMES = 7
PROMPT = [BOS, 17, 40, 7, 55, EOS]  # NeMo's layout of a system prompt: BOS, its text, EOS


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _Lightning(nn.Module):
    def save_hyperparameters(self, *args, **kwargs):
        pass

    @property
    def device(self):
        return torch.device("cpu")


def _stub_nemo() -> None:
    def module(name: str, **attrs) -> None:
        mod = _Stub(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    class _Log:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    for name in ("nemo", "nemo.collections", "nemo.collections.common", "nemo.collections.speechlm2",
                 "nemo.collections.speechlm2.parts", "nemo.collections.speechlm2.parts.metrics",
                 "nemo.collections.speechlm2.data", "nemo.collections.speechlm2.models",
                 "nemo.collections.speechlm2.streaming", "nemo.collections.audio", "nemo.collections.audio.parts",
                 "nemo.collections.audio.parts.utils", "nemo.core", "nemo.collections.common.tokenizers",
                 "nemo.collections.speechlm2.parts.hf_hub", "nemo.collections.speechlm2.parts.label_prep",
                 "nemo.collections.speechlm2.parts.lora", "nemo.collections.speechlm2.parts.metrics.bleu",
                 "nemo.collections.speechlm2.parts.metrics.empty_text",
                 "nemo.collections.speechlm2.parts.metrics.results_logger",
                 "nemo.collections.speechlm2.parts.metrics.turn_taking", "nemo.collections.speechlm2.parts.metrics.wer",
                 "nemo.collections.speechlm2.parts.optim_setup", "nemo.collections.speechlm2.parts.pretrained",
                 "nemo.collections.speechlm2.parts.text_utils", "nemo.collections.audio.parts.utils.transforms",
                 "nemo.core.neural_types", "peft", "soundfile"):
        module(name)
    module("lightning", LightningModule=_Lightning)
    module("nemo.collections.speechlm2.data.utils", get_pad_id=lambda tokenizer: PAD)
    module("nemo.utils", logging=_Log())


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class _Perception(nn.Module):
    """Stands in for NeMo's perception module: the fixed frames, whatever the audio."""

    def __init__(self, frames: torch.Tensor) -> None:
        super().__init__()
        self.frames = frames

    def forward(self, input_signal, input_signal_length, return_encoder_emb=False):
        lengths = torch.full((input_signal.shape[0],), self.frames.shape[0], dtype=torch.long)
        return self.frames[None].expand(input_signal.shape[0], -1, -1).clone(), lengths, None


def build(stt_module, hf_model, frames: torch.Tensor):
    """A ``DuplexSTTModel`` assembled as its constructor does, without loading anything."""
    from omegaconf import DictConfig

    model = stt_module.DuplexSTTModel.__new__(stt_module.DuplexSTTModel)
    nn.Module.__init__(model)
    model.cfg = DictConfig({"pretrained_llm": "nvidia/NVIDIA-Nemotron-Nano-9B-v2", "predict_user_text": False,
                            "duplex_user_channel_weight": USER_WEIGHT, "duplex_text_channel_weight": TEXT_WEIGHT})
    model.predict_user_text = False
    model.tokenizer = types.SimpleNamespace(bos_id=BOS, eos_id=EOS)
    model.llm = hf_model.model  # llm_attr_name: the backbone
    model.lm_head = hf_model.lm_head
    model.embed_tokens = model.llm.embeddings  # embed_tokens_attr_name, taken out of the backbone
    delattr(model.llm, "embeddings")
    model.perception = _Perception(frames)
    model._use_fsdp = False
    model._use_tp = False
    model.streaming_inference = sys.modules["duplex_stt_inference"].DuplexSTTStreamingInference(model)
    return model.eval()


def run(model, prompt: list[int] | None) -> dict[str, torch.Tensor]:
    """NeMo's ``offline_inference`` (greedy), with the text logits of every generated frame."""
    logits = []
    forward = type(model).forward

    def recorded(self, input_embeds, cache=None, **kwargs):
        out = forward(self, input_embeds, cache=cache, **kwargs)
        logits.append(out["text_logits"][0, -1].clone())
        return out

    type(model).forward = recorded
    try:
        kwargs = {}
        if prompt:
            kwargs = {"prompt_tokens": torch.tensor([prompt]), "prompt_token_lens": torch.tensor([len(prompt)])}
        with torch.no_grad():
            state = model.streaming_inference._init_inference(torch.zeros(1, 16000), torch.tensor([16000]), 0,
                                                              kwargs.get("prompt_tokens"),
                                                              kwargs.get("prompt_token_lens"))
            ans, state = model.streaming_inference._step_zero(state)
            for t in range(1, state["T"]):
                ans = model.streaming_inference._step_inference(t, state, ans)
    finally:
        type(model).forward = forward
    start = len(prompt) if prompt else 0
    return {"tokens": state["gen_text"][0, start:].clone(), "logits": torch.stack(logits[start:])}


def main():
    src = Path(os.environ.get("NEMO_SRC", "/tmp/eartts-src")) / "nemo/collections/speechlm2"
    import transformers
    from transformers import NemotronHConfig, NemotronHForCausalLM

    _stub_nemo()
    _load("duplex_stt_inference", src / "streaming/duplex_stt_inference.py")
    sys.modules["nemo.collections.speechlm2.streaming.duplex_stt_inference"] = sys.modules["duplex_stt_inference"]
    stt = _load("duplex_stt_model", src / "models/duplex_stt_model.py")

    torch.manual_seed(0)
    hf = NemotronHForCausalLM(NemotronHConfig(**LLM)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else 0.15 * torch.randn(p.shape, generator=gen))
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.add_(1.0)
    state = {}
    for name, tensor in hf.state_dict().items():
        if name == "model.embeddings.weight":
            state["stt_model.embed_tokens.weight"] = tensor.clone()
        elif name.startswith("model."):
            state["stt_model.llm." + name[len("model."):]] = tensor.clone()
        else:
            state["stt_model." + name] = tensor.clone()
    # the perception output (already projected, before the user channel's weight)
    frames = torch.randn(FRAMES, LLM["hidden_size"], generator=gen)
    model = build(stt, hf, frames)
    cases = {"prompt": run(model, PROMPT), "no_prompt": run(model, None)}
    OUT.parent.mkdir(exist_ok=True)
    torch.save({
        "versions": {"nemo-toolkit": "3.0.0", "torch": str(torch.__version__),
                     "transformers": str(transformers.__version__)},
        "llm_config": {k: v for k, v in LLM.items()}, "user_weight": USER_WEIGHT, "text_weight": TEXT_WEIGHT,
        "pad": PAD, "prompt": PROMPT, "frames": frames, "state": state, "cases": cases,
    }, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    for name, case in cases.items():
        print(name, case["tokens"].tolist())


if __name__ == "__main__":
    main()
