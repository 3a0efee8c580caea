"""Record the duplex input side's fixture from NeMo's own speech-to-text model code.

nemo-toolkit 3.0.0 does not install beside this project's torch, so its files are imported
directly, with the NeMo helpers they name (Lightning, PEFT, metrics, tokenizer, loaders,
typing and adapter mixins) stubbed:

* the perception's encoder: ``asr/modules/conformer_encoder.py`` (``ConformerEncoder`` in the
  VoiceChat's causal layout: ``causal_downsampling``, ``chunked_limited`` attention over the
  frame and the ones before it, causal convolutions with a LayerNorm, per-layer position
  biases) with its submodules; ``AudioPerceptionModule.forward`` around it is glue (an
  identity modality adapter, then ``proj`` over the transposed frames) and is written out
  here. The featurizer is not run: the encoder takes fixed log-mel frames (VoiceChat's
  featurizer predates NeMo 2.5's and is checked elsewhere);
* ``speechlm2/models/duplex_stt_model.py`` (``DuplexSTTModel``, whose ``forward`` runs the
  LLM and its text head) and ``speechlm2/streaming/duplex_stt_inference.py``
  (``DuplexSTTStreamingInference``: how a call's sequence is laid out, the system prompt
  before the first frame, and how each frame is fused with the previous agent token). The LLM
  is transformers' ``NemotronHForCausalLM`` taken apart as NeMo's constructor takes it apart
  (``llm`` the backbone without its embedding table, ``embed_tokens``, ``lm_head``); its
  perception output is the encoder's above.

The ``tools`` case adds what NeMo 3.0.0 does not have but the release's STT model (NeMo's
``nemotron-labs-voicechat`` branch, not installable here) does, written out below
(``run_release``) around NeMo's own ``offline_inference`` steps: a tool-call head
(``function_head``, a linear over the LLM's final hidden state) whose greedy token is fed back
into the next position as ``embed_tokens(token) * duplex_function_channel_weight`` (the pad at
the prompt's positions and at the first frame), and repetition and presence penalties over the
agent text tokens said so far (the pad, BOS and EOS excepted; transformers' repetition
penalty, then the presence penalty subtracted) applied to the text logits after NeMo's own
``inference_pad_boost``/``inference_bos_boost``/``inference_eos_boost`` (set in the model's
config, added by ``DuplexSTTModel.forward``). The LLM runs NeMo's no-cache path (the whole
sequence every step), so none of it shares code with the served engine's incremental steps.

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
MEL_FRAMES = 60  # 8x subsampled: 8 perception frames
ENCODER = dict(feat_in=16, n_layers=2, d_model=16, subsampling="dw_striding", subsampling_factor=8,
               subsampling_conv_channels=4, causal_downsampling=True, ff_expansion_factor=2,
               self_attention_model="rel_pos", n_heads=2, att_context_size=[6, 0], att_context_style="chunked_limited",
               xscaling=True, untie_biases=True, conv_kernel_size=5, conv_norm_type="layer_norm",
               conv_context_size="causal", dropout=0.0, dropout_pre_encoder=0.0, dropout_emb=0.0, dropout_att=0.0)
PROMPT = [BOS, 17, 40, 7, 55, EOS]  # NeMo's layout of a system prompt: BOS, its text, EOS
# the ``tools`` case: the release's tool-call channel and NeMo's logit adjustments
FUNCTION_WEIGHT = 0.9
BOOSTS = {"inference_pad_boost": 0.6, "inference_bos_boost": -0.4, "inference_eos_boost": 0.5}
REPETITION, PRESENCE = 1.4, 0.3


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


def _conformer_module(nemo: Path):
    """NeMo's ``conformer_encoder`` module, its few NeMo-wide helpers stubbed."""
    import contextlib
    import dataclasses

    def module(name: str, **attrs):
        mod = _Stub(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    class Access:
        def is_access_enabled(self, guid=None):
            return False

    def typecheck(*args, **kwargs):
        return lambda f: f

    @dataclasses.dataclass
    class CacheAwareStreamingConfig:
        chunk_size: int = 0
        shift_size: int = 0
        cache_drop_size: int = 0
        last_channel_cache_size: int = 0
        valid_out_len: int = 0
        pre_encode_cache_size: int = 0
        drop_extra_pre_encoded: int = 0
        last_channel_num: int = 0
        last_time_num: int = 0

    for name in ("nemo.collections.asr", "nemo.collections.asr.parts", "nemo.collections.asr.parts.submodules",
                 "nemo.collections.asr.parts.utils", "nemo.collections.asr.parts.mixins",
                 "nemo.collections.asr.models", "nemo.collections.asr.modules", "nemo.collections.common.parts",
                 "nemo.core.classes", "nemo.collections.asr.parts.submodules.adapters",
                 "nemo.collections.asr.parts.utils.adapter_utils"):
        module(name)
    sys.modules["nemo.utils"].avoid_float16_autocast_context = contextlib.nullcontext
    module("nemo.core.classes.common", typecheck=typecheck)
    module("nemo.core.classes.exportable", Exportable=type("Exportable", (), {}))
    module("nemo.core.classes.module", NeuralModule=nn.Module)
    module("nemo.core.classes.mixins", AccessMixin=Access, adapter_mixins=types.SimpleNamespace(
        AdapterModuleMixin=type("AdapterModuleMixin", (), {}), get_registered_adapter=lambda cls: cls))
    module("nemo.collections.asr.models.configs", CacheAwareStreamingConfig=CacheAwareStreamingConfig)
    module("nemo.collections.asr.parts.mixins.streaming", StreamingEncoder=type("StreamingEncoder", (), {}))
    module("nemo.collections.asr.parts.submodules.adapters.attention_adapter_mixin",
           AttentionAdapterModuleMixin=type("AttentionAdapterModuleMixin", (),
                                            {"is_adapter_available": lambda self: False}))
    asr = nemo / "collections/asr"
    for name, path in (("asr.parts.submodules.causal_convs", "parts/submodules/causal_convs.py"),
                       ("asr.parts.submodules.batchnorm", "parts/submodules/batchnorm.py"),
                       ("asr.parts.utils.activations", "parts/utils/activations.py"),
                       ("asr.parts.utils.regularization_utils", "parts/utils/regularization_utils.py"),
                       ("common.parts.utils", "../common/parts/utils.py"),
                       ("asr.parts.submodules.multi_head_attention", "parts/submodules/multi_head_attention.py"),
                       ("asr.parts.submodules.subsampling", "parts/submodules/subsampling.py"),
                       ("asr.parts.submodules.conformer_modules", "parts/submodules/conformer_modules.py")):
        _load("nemo.collections." + name, asr / path)
    return _load("nemo.collections.asr.modules.conformer_encoder", asr / "modules/conformer_encoder.py")


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) if p.ndim == 1
                    else torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
            if "norm" in name and name.endswith("weight"):
                p.add_(1.0)


def perception(nemo: Path, gen: torch.Generator) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """NeMo's encoder and the perception's projection on fixed log-mels: the released
    tensors, the log-mels ``[T, mel]`` and the perception output ``[T', llm hidden]``."""
    conformer = _conformer_module(nemo)
    encoder = conformer.ConformerEncoder(**ENCODER).eval()
    proj = nn.Linear(ENCODER["d_model"], LLM["hidden_size"])
    _randomize(encoder, gen)
    _randomize(proj, gen)
    mel = torch.randn(1, ENCODER["feat_in"], MEL_FRAMES, generator=gen)
    with torch.no_grad():
        encoded, _ = encoder(audio_signal=mel, length=torch.tensor([MEL_FRAMES]))
        frames = proj(encoded.transpose(1, 2))[0]  # AudioPerceptionModule: identity adapter, then proj
    state = {"stt_model.perception.encoder." + k: v.clone() for k, v in encoder.state_dict().items()}
    state |= {"stt_model.perception.proj." + k: v.clone() for k, v in proj.state_dict().items()}
    return state, mel[0].T.contiguous(), frames


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


def run_release(model, function_head: nn.Linear, prompt: list[int] | None) -> dict[str, torch.Tensor]:
    """``offline_inference``'s steps (greedy) with the release's tool-call channel and the
    penalties (see the module's docstring): per generated frame, the text token, the tool-call
    token, the text logits the argmax read (boosted by NeMo, then penalised) and the head's."""
    inference = model.streaming_inference
    step_inference = type(inference)._step_inference
    forward = type(model).forward
    hidden: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
    start = len(prompt) if prompt else 0
    specials = {PAD, BOS, EOS}
    tools: list[int] = []  # per position
    record = {"tokens": [], "tools": [], "logits": [], "tool_logits": []}
    state: dict = {}

    def released(self, input_embeds, cache=None, **kwargs):
        out = forward(self, input_embeds, cache=cache, **kwargs)  # NeMo adds the boosts
        t = input_embeds.shape[1] - 1
        text = out["text_logits"][0, -1]
        said = {int(x) for x in state["gen_text"][0, start:t].tolist()} - specials if t >= start else set()
        for token in sorted(said):
            score = text[token]
            score = score * REPETITION if score < 0 else score / REPETITION
            text[token] = score - PRESENCE
        tool_logits = function_head(hidden[-1][0, -1])
        tools.append(int(tool_logits.argmax()) if t >= start else PAD)
        if t >= start:
            record["logits"].append(text.clone())
            record["tool_logits"].append(tool_logits.clone())
        return out

    def step(self, t, inference_state, ans):
        tool = model.embed_tokens(torch.tensor([tools[t - 1]])) * FUNCTION_WEIGHT
        inference_state["input_embeds"][:, t] += tool[0]
        return step_inference(self, t, inference_state, ans)

    type(model).forward = released
    type(inference)._step_inference = step
    try:
        prompt_tokens = torch.tensor([prompt]) if prompt else None
        lens = torch.tensor([len(prompt)]) if prompt else None
        with torch.no_grad():
            state.update(inference._init_inference(torch.zeros(1, 16000), torch.tensor([16000]), 0,
                                                   prompt_tokens, lens))
            state["input_embeds"][:, 0] += model.embed_tokens(torch.tensor([PAD]))[0] * FUNCTION_WEIGHT
            ans, _ = inference._step_zero(state)
            for t in range(1, state["T"]):
                ans = inference._step_inference(t, state, ans)
    finally:
        type(model).forward = forward
        type(inference)._step_inference = step_inference
        hook.remove()
    return {"tokens": state["gen_text"][0, start:].clone(), "tools": torch.tensor(tools[start:]),
            "logits": torch.stack(record["logits"]), "tool_logits": torch.stack(record["tool_logits"])}


def main():
    nemo = Path(os.environ.get("NEMO_SRC", "/tmp/eartts-src")) / "nemo"
    src = nemo / "collections/speechlm2"
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
    # the perception output (projected, before the user channel's weight)
    encoder_state, mel, frames = perception(nemo, gen)
    model = build(stt, hf, frames)
    cases = {"prompt": run(model, PROMPT), "no_prompt": run(model, None)}
    function_head = nn.Linear(LLM["hidden_size"], LLM["vocab_size"], bias=False)
    with torch.no_grad():
        function_head.weight.copy_(0.15 * torch.randn(function_head.weight.shape,
                                                      generator=torch.Generator().manual_seed(2)))
    model.cfg.update({"duplex_function_channel_weight": FUNCTION_WEIGHT, "use_function_head": True} | BOOSTS)
    tools = {"tools_prompt": run_release(model, function_head, PROMPT),
             "tools_no_prompt": run_release(model, function_head, None)}
    OUT.parent.mkdir(exist_ok=True)
    torch.save({
        "versions": {"nemo-toolkit": "3.0.0", "torch": str(torch.__version__),
                     "transformers": str(transformers.__version__)},
        "llm_config": {k: v for k, v in LLM.items()}, "user_weight": USER_WEIGHT, "text_weight": TEXT_WEIGHT,
        "pad": PAD, "prompt": PROMPT, "frames": frames, "state": state, "cases": cases,
        "encoder_config": ENCODER, "encoder_state": encoder_state, "mel": mel,
        "tools": {"cases": tools, "function_weight": FUNCTION_WEIGHT,
                  "function_head": {"stt_model.function_head.weight": function_head.weight.detach().clone()},
                  "boosts": BOOSTS,
                  "repetition_penalty": REPETITION, "presence_penalty": PRESENCE},
    }, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    for name, case in (cases | tools).items():
        print(name, case["tokens"].tolist(), case.get("tools", torch.tensor([])).tolist())


if __name__ == "__main__":
    main()
