"""The duplex input side from a folder of VoiceChat-named safetensors (``stt_model.*``)
against NeMo's own duplex STT code.

The fixture (``fixtures/duplex_stt_reference.pt``, written by ``record_reference.py`` from
nemo-toolkit 3.0.0's ``ConformerEncoder`` in VoiceChat's causal layout, its perception's
projection, ``DuplexSTTModel.forward`` and ``DuplexSTTStreamingInference``, with transformers'
``NemotronHForCausalLM`` as the LLM; torch 2.13, fp32 on the CPU) holds a tiny encoder's and
LLM's weights under the released names, fixed log-mels (NeMo's featurizer is not run), NeMo's
perception output, and its greedy tokens and text logits per frame for a call with a system
prompt and one without, at user and text channel weights 0.7 and 1.3. Its ``tools`` cases add
the release's tool-call head and channel (weight 0.9) and NeMo's inference boosts (pad 0.6, BOS
-0.4, EOS 0.5) with repetition and presence penalties (1.4, 0.3), as ``record_reference.py``
writes them out around NeMo's ``offline_inference`` steps (NeMo 3.0.0 has no tool head)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import NemotronHConfig as HFConfig

from mstar.engine.base import EngineItem
from mstar.model.fastconformer.config import FastConformerConfig
from mstar.model.fastconformer.stream import EncoderStream
from mstar.model.nemotron_duplex.checkpoint import load_encoder, load_llm
from mstar.model.nemotron_duplex.config import DuplexConfig
from mstar.model.nemotron_duplex.engines import DuplexRules, NanoEngine
from mstar.model.nemotron_duplex.modeling import DuplexLLM, SpeechEncoder
from mstar.model.nemotron_h import NemotronHConfig, NemotronHForCausalLM
from mstar.model.nemotron_h.engine import nemotron_h_engine
from mstar.model.weights import WeightLoadError

FIXTURE = Path(__file__).parent / "fixtures" / "duplex_stt_reference.pt"
PARAMS = {"sampling": {"temperature": 0.0}, "max_new_tokens": 1 << 30, "stop_token_ids": []}
# tensors the loader skips on purpose: they must not fail the load
SKIPPED = {"stt_model.perception.preprocessor.featurizer.fb": torch.zeros(1, 4, 3),
           "stt_model.perception.preprocessor.featurizer.window": torch.zeros(8),
           "stt_model.rnnt_joint.joint_net.2.weight": torch.zeros(5, 4),
           "stt_model.rnnt_decoder.prediction.embed.weight": torch.zeros(5, 4),
           "tts_model.tts_model.bos_emb": torch.zeros(4)}


@pytest.fixture(scope="module")
def ref():
    return torch.load(FIXTURE, weights_only=True)


def save(folder: Path, state: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / name))
    return folder


def llm_config(ref) -> NemotronHConfig:
    return NemotronHConfig.from_hf_dict(HFConfig(**ref["llm_config"]).to_dict())


def run_call(ref, llm, prompt: list[int], chunks: list[int], frames: torch.Tensor | None = None,
             rules: DuplexRules | None = None, params: dict = PARAMS) -> tuple[list[int], list[torch.Tensor]]:
    """Prime, then feed the frames (the fixture's NeMo perception output scaled by the user
    channel's weight, as the encoder node's projection does, unless given) in chunks; the
    tokens and each frame's logits (with ``rules``: the text logits the sampler saw, and the
    engine's ``tool_tokens`` and ``tool_logits`` recorded on the function)."""
    inner = nemotron_h_engine(llm, max_slots=2, state_dtype=torch.float32, num_pages=16, page_size=8,
                              max_seq_len=64, device=torch.device("cpu"), dtype=torch.float32, rules=rules)
    tools = ref["tools"]["function_weight"] if rules is not None else 1.0
    engine = NanoEngine(inner, llm, pad_token_id=ref["pad"], user_weight=ref["user_weight"],
                        text_weight=ref["text_weight"], function_weight=tools)
    seen: list[torch.Tensor] = []
    if rules is None:
        llm.compute_logits = lambda h: seen.append(NemotronHForCausalLM.compute_logits(llm, h)) or seen[-1]
    else:
        raw: list[torch.Tensor] = []
        llm.compute_logits = lambda h: raw.append(DuplexLLM.compute_logits(llm, h)) or raw[-1]
        rules.adjust = lambda text, seqs: seen.append(DuplexRules.adjust(rules, text, seqs)) or seen[-1]
    try:
        engine.run([EngineItem("a", "prime", 0, {"prompt_ids": torch.tensor(prompt, dtype=torch.int64)}, params)])
        primed = len(seen)
        frames = ref["frames"] * ref["user_weight"] if frames is None else frames
        tokens, tool_tokens, start = [], [], 0
        for i, size in enumerate(chunks):
            out = engine.run([EngineItem("a", "frame", i, {"frame": frames[start:start + size]}, params)])
            tokens += out[0].outputs["token"].tolist()
            tool_tokens += out[0].outputs["tool_token"].tolist() if rules is not None else []
            start += size
    finally:
        del llm.compute_logits
    engine.release("a")
    assert inner.pool.num_used_pages == 0 and not engine.last and not engine.tool
    if rules is not None:
        run_call.tool_tokens = tool_tokens
        run_call.tool_logits = [x[-1, llm.config.vocab_size:] for x in raw[primed:]]
    return tokens, [x[-1] for x in seen[primed:]]


@pytest.mark.parametrize("case", ["prompt", "no_prompt"])
def test_frame_steps_from_the_released_names_equal_nemo(ref, tmp_path, case):
    folder = save(tmp_path, ref["state"] | SKIPPED)
    llm = NemotronHForCausalLM(llm_config(ref)).eval()
    load_llm(llm, folder)
    want = ref["cases"][case]
    prompt = ref["prompt"] if case == "prompt" else []
    tokens, logits = run_call(ref, llm, prompt, [1, 3, 1, 4])
    assert tokens == want["tokens"].tolist()
    assert len(logits) == len(want["logits"]) == ref["frames"].shape[0]
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(logits, want["logits"]))
    assert worst < 1e-5, worst


# our encoder names -> NeMo ConformerEncoder's (causal dw_striding subsampling)
_TO_NEMO = [(re.compile(p), r) for p, r in (
    (r"^subsampling\.conv_in\.", "pre_encode.conv.0."),
    (r"^subsampling\.layers\.0\.depthwise_conv\.", "pre_encode.conv.2."),
    (r"^subsampling\.layers\.0\.pointwise_conv\.", "pre_encode.conv.3."),
    (r"^subsampling\.layers\.1\.depthwise_conv\.", "pre_encode.conv.5."),
    (r"^subsampling\.layers\.1\.pointwise_conv\.", "pre_encode.conv.6."),
    (r"^subsampling\.linear\.", "pre_encode.out."), (r"\.conv\.norm\.", ".conv.batch_norm."),
    (r"\.([qkv])_proj\.", r".linear_\1."), (r"\.o_proj\.", ".linear_out."),
    (r"\.relative_k_proj\.", ".linear_pos."), (r"\.bias_([uv])$", r".pos_bias_\1"))]


def nemo_names(encoder: SpeechEncoder) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in encoder.state_dict().items():
        if name.startswith("proj."):
            out["stt_model.perception." + name] = tensor.clone()
            continue
        rest = name[len("encoder."):]
        for pattern, replacement in _TO_NEMO:
            rest = pattern.sub(replacement, rest)
        out["stt_model.perception.encoder." + rest] = tensor.clone()
    return out


def tiny_duplex(ref) -> DuplexConfig:
    """The fixture encoder's config (NeMo's: 16 wide, 2 layers, left context 6, xscaling)."""
    encoder = FastConformerConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                  subsampling_conv_channels=4, num_mel_bins=16, conv_kernel_size=5, causal=True,
                                  left_context=6, default_lookahead=0, scale_input=True)
    return DuplexConfig(encoder, llm_config(ref), n_mels=16, user_channel_weight=ref["user_weight"])


def released_encoder(ref, tmp_path) -> SpeechEncoder:
    encoder = SpeechEncoder(tiny_duplex(ref)).eval()
    load_encoder(encoder, save(tmp_path, ref["encoder_state"] | ref["state"] | SKIPPED))
    return encoder


def test_the_perception_from_the_released_names_equals_nemo(ref, tmp_path):
    encoder = released_encoder(ref, tmp_path)
    want = ref["frames"] * ref["user_weight"]
    with torch.no_grad():
        offline = encoder(ref["mel"])
        stream, streamed = EncoderStream(encoder.encoder), []
        for at in range(0, ref["mel"].shape[0], 8):  # 80 ms of mel frames at a time
            mel = ref["mel"][at:at + 8]
            streamed.append(stream.push(mel, last=at + 8 >= ref["mel"].shape[0]))
        streamed = encoder.project(torch.cat(streamed))
    assert offline.shape == streamed.shape == want.shape
    for got in (offline, streamed):
        assert ((got - want).abs().max() / want.abs().max()).item() < 2e-6


@pytest.mark.parametrize("case", ["prompt", "no_prompt"])
def test_the_whole_input_side_equals_nemo(ref, tmp_path, case):
    """Our encoder's frames from the fixture's log-mels into our LLM: NeMo's tokens and logits."""
    encoder = released_encoder(ref, tmp_path / "encoder")
    with torch.no_grad():
        frames = encoder(ref["mel"])
    llm = NemotronHForCausalLM(llm_config(ref)).eval()
    load_llm(llm, save(tmp_path / "llm", ref["state"] | ref["encoder_state"]))
    want = ref["cases"][case]
    tokens, logits = run_call(ref, llm, ref["prompt"] if case == "prompt" else [], [2, 7], frames)
    assert tokens == want["tokens"].tolist()
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(logits, want["logits"]))
    assert worst < 1e-5, worst


def test_the_encoder_loads_from_nemo_names(ref, tmp_path):
    config = tiny_duplex(ref)
    assert set(nemo_names(SpeechEncoder(config))) == set(ref["encoder_state"])  # NeMo's own names
    torch.manual_seed(3)
    source = SpeechEncoder(config)
    for p in source.parameters():
        torch.nn.init.normal_(p)
    state = nemo_names(source)
    assert "stt_model.perception.encoder.pre_encode.conv.0.weight" in state
    assert "stt_model.perception.encoder.layers.1.self_attn.linear_pos.weight" in state
    assert "stt_model.perception.encoder.layers.0.conv.batch_norm.weight" in state
    target = SpeechEncoder(config)
    load_encoder(target, save(tmp_path, state | ref["state"] | SKIPPED))
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name


def test_coverage_is_checked_both_ways(ref, tmp_path):
    llm = NemotronHForCausalLM(llm_config(ref))
    stray = ref["state"] | {"stt_model.embed_asr_tokens.weight": torch.zeros(96, 32)}
    with pytest.raises(WeightLoadError, match="embed_asr_tokens"):
        load_llm(llm, save(tmp_path / "stray", stray))
    adapter = ref["state"] | {"stt_model.perception.modality_adapter.layers.0.w": torch.zeros(2)}
    with pytest.raises(WeightLoadError, match="modality_adapter"):
        load_encoder(SpeechEncoder(tiny_duplex(ref)), save(tmp_path / "adapter", adapter))
    missing = {k: v for k, v in ref["state"].items() if k != "stt_model.lm_head.weight"}
    with pytest.raises(WeightLoadError, match="lm_head"):
        load_llm(llm, save(tmp_path / "missing", missing))
    wrong = ref["state"] | {"stt_model.llm.layers.0.mixer.bogus": torch.zeros(2)}
    with pytest.raises(WeightLoadError, match="bogus"):
        load_llm(llm, save(tmp_path / "wrong", wrong))
    # no encoder tensors: the encoder's parameters are named as unfilled
    with pytest.raises(WeightLoadError, match="did not fill .*encoder.layers.0.conv"):
        load_encoder(SpeechEncoder(tiny_duplex(ref)), save(tmp_path / "llm_only", ref["state"]))


def tools_rules(ref) -> DuplexRules:
    boosts = ref["tools"]["boosts"]
    return DuplexRules(96, boosts={ref["pad"]: boosts["inference_pad_boost"], 1: boosts["inference_bos_boost"],
                                   2: boosts["inference_eos_boost"]}, specials={ref["pad"], 1, 2}, function_head=True)


@pytest.mark.parametrize("case", ["tools_prompt", "tools_no_prompt"])
def test_the_tool_call_channel_and_logit_adjustments_equal_the_reference(ref, tmp_path, case):
    """The head's greedy token fed back each frame, NeMo's boosts, the penalties: the same text
    and tool-call tokens, the sampler's text logits and the head's logits within 1e-5."""
    tools = ref["tools"]
    llm = DuplexLLM(llm_config(ref), function_head=True).eval()
    load_llm(llm, save(tmp_path, ref["state"] | tools["function_head"] | SKIPPED))
    params = PARAMS | {"text_penalties": {"repetition": tools["repetition_penalty"],
                                          "presence": tools["presence_penalty"]}}
    want = tools["cases"][case]
    tokens, logits = run_call(ref, llm, ref["prompt"] if case == "tools_prompt" else [], [1, 3, 1, 4],
                              rules=tools_rules(ref), params=params)
    assert tokens == want["tokens"].tolist()
    assert run_call.tool_tokens == want["tools"].tolist()
    assert len(logits) == len(run_call.tool_logits) == len(want["logits"]) == ref["frames"].shape[0]
    for got, wanted in ((logits, want["logits"]), (run_call.tool_logits, want["tool_logits"])):
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, wanted))
        assert worst < 1e-5, worst
    # the adjustments matter here: without them the text differs
    plain = DuplexRules(96, boosts={}, specials={ref["pad"], 1, 2}, function_head=True)
    assert run_call(ref, llm, ref["prompt"] if case == "tools_prompt" else [], [9], rules=plain)[0] != tokens


def test_penalties_and_boosts_of_a_step(ref):
    """The adjustments on known logits: boosts first, then the penalties over what was said."""
    from mstar.engine.sequence import Sequence

    rules = DuplexRules(4, boosts={0: 0.5}, specials={0}, function_head=False)
    seq = Sequence([0], 1, state=rules.start({"text_penalties": {"repetition": 2.0, "presence": 0.25}}))
    for token in (0, 2, 3):
        rules.outputs(seq, token)
    assert seq.state.said == {2, 3}
    got = rules.adjust(torch.tensor([[1.0, 1.0, 1.0, -1.0]]), [seq])
    assert torch.equal(got, torch.tensor([[1.5, 1.0, 0.25, -2.25]]))


def test_a_tool_call_head_needs_use_function_head(ref, tmp_path):
    head = ref["tools"]["function_head"]
    with pytest.raises(WeightLoadError, match="stt_model.function_head.weight.*use_function_head"):
        load_llm(NemotronHForCausalLM(llm_config(ref)), save(tmp_path / "tools", ref["state"] | head))
    with pytest.raises(WeightLoadError, match="function_head"):
        load_llm(DuplexLLM(llm_config(ref), function_head=True), save(tmp_path / "plain", ref["state"]))
    llm = DuplexLLM(llm_config(ref), function_head=True)
    load_llm(llm, save(tmp_path / "both", ref["state"] | head))
    assert torch.equal(llm.function_head.weight, head["stt_model.function_head.weight"])
