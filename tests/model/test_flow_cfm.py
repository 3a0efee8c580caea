"""The CFM mel decoder (``mstar.model.flow``) against CosyVoice2's own modules.

The reference outputs are recorded in ``fixtures/flow_cfm.pt`` by ``flow_cfm_fixtures.py``
(``cosyvoice-minicpmo==0.1.0``'s ``ConditionalDecoder`` / ``CausalConditionalDecoder`` and
``ConditionalCFM.solve_euler``, which need ``conformer``, absent in CI). Tiny random configs,
float32 on the CPU: a plain two-level U-Net and the causal one-level shape CosyVoice2 ships.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.engine.denoise import DenoiseEngine
from mstar.model.flow import (
    CosineFlowSchedule,
    EstimatorConfig,
    FlowEstimator,
    FlowFront,
    FlowFrontConfig,
    chunk_attention_mask,
    estimator_name_map,
    flow_front_name_map,
    noise_table,
    solve_euler,
    velocity_fn,
)
from mstar.model.weights import WeightLoadError, load_weights

FIXTURES = torch.load(Path(__file__).parent / "fixtures" / "flow_cfm.pt")
VELOCITY_TOL = 1e-5  # relative to the reference's peak
MEL_TOL = 1e-4


def estimator(case: dict, state: dict | None = None) -> FlowEstimator:
    cfg = case["config"]
    config = EstimatorConfig(
        mel_channels=80, cond_channels=240, channels=tuple(cfg["channels"]), num_heads=cfg["num_heads"],
        head_dim=cfg["attention_head_dim"], blocks_per_level=cfg["n_blocks"], mid_levels=cfg["num_mid_blocks"],
        causal=cfg["causal"], static_chunk_size=cfg.get("static_chunk_size", 50),
        left_chunks=cfg.get("num_decoding_left_chunks", -1))
    module = FlowEstimator(config).eval()
    load_weights(module, (state or case["state"]).items(), name_map=estimator_name_map)  # strict: both ways
    return module


def cond_stack(inputs: dict, rows=slice(None)) -> torch.Tensor:
    return FlowEstimator.conditioning(inputs["mu"][rows], inputs["spks"][rows], inputs["cond"][rows])


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, f"max error {err:.2e} of the reference's peak (tolerance {tol:.0e})"


@pytest.mark.parametrize("name", ["plain", "causal"])
def test_estimator_matches_reference(name):
    case = FIXTURES[name]
    inputs = case["inputs"]
    module = estimator(case)
    with torch.no_grad():
        ours = module(inputs["x"], inputs["mask"], cond_stack(inputs), inputs["t"])
        assert_close(ours, case["velocity"], VELOCITY_TOL)
        if case["velocity_streamed"] is not None:
            streamed = module(inputs["x"], inputs["mask"], cond_stack(inputs), inputs["t"], streaming=True)
            assert_close(streamed, case["velocity_streamed"], VELOCITY_TOL)
            assert not torch.allclose(streamed, ours)  # the chunked mask did something


@pytest.mark.parametrize("name", ["plain", "causal"])
def test_guided_euler_solve_matches_reference(name):
    case = FIXTURES[name]
    inputs = case["inputs"]
    module = estimator(case)
    with torch.no_grad():
        mel = solve_euler(module, inputs["noise"], inputs["mask"][:1], cond_stack(inputs, slice(0, 1)),
                          num_steps=case["steps"], cfg_rate=case["cfg_rate"])
        assert_close(mel, case["mel"], MEL_TOL)
        if case["mel_streamed"] is not None:
            mel = solve_euler(module, inputs["noise"], inputs["mask"][:1], cond_stack(inputs, slice(0, 1)),
                              num_steps=case["steps"], cfg_rate=case["cfg_rate"], streaming=True)
            assert_close(mel, case["mel_streamed"], MEL_TOL)


def test_denoise_engine_runs_the_same_solve():
    """The mel decode as the image models' denoise loop: noisy mel as latents, the
    conditioning stack as text, zeros as negative_text, guidance scale 1 + cfg_rate."""
    case = FIXTURES["causal"]
    inputs = case["inputs"]
    module = estimator(case)
    engine = DenoiseEngine(velocity_fn(module), CosineFlowSchedule(), torch.device("cpu"), torch.float32)
    text = cond_stack(inputs, slice(0, 1))[0].T
    latents = inputs["noise"][0].T
    params = {"num_steps": case["steps"], "image_seq_len": 0, "guidance_scale": 1 + case["cfg_rate"]}
    for i in range(case["steps"]):
        item = EngineItem("r", "step", i, {"latents": latents, "text": text, "negative_text": torch.zeros_like(text)},
                          params)
        latents = engine.run([item])[0].outputs["latents"]
    assert_close(latents.T[None], case["mel"], MEL_TOL)


def test_denoise_engine_batches_rows_of_one_length():
    """Two requests of one length, one streaming and one not, share the engine's steps; each
    ends where its own solve does."""
    case = FIXTURES["causal"]
    inputs = case["inputs"]
    module = estimator(case)
    engine = DenoiseEngine(velocity_fn(module), CosineFlowSchedule(), torch.device("cpu"), torch.float32)
    stacks = [cond_stack(inputs, slice(row, row + 1)) for row in (0, 1)]
    noises = [inputs["noise"], inputs["x"][1:]]
    latents = [noise[0].T for noise in noises]
    for i in range(3):
        items = [EngineItem(f"r{row}", "step", i, {"latents": latents[row], "text": stacks[row][0].T,
                                                  "negative_text": torch.zeros_like(stacks[row][0].T)},
                            {"num_steps": 3, "image_seq_len": 0, "guidance_scale": 1.7, "streaming": row == 1})
                 for row in (0, 1)]
        latents = [out.outputs["latents"] for out in engine.run(items)]
    assert list(engine.forward_rows) == [4, 4, 4]  # both requests' guided pairs in every forward
    full = torch.ones(1, 1, latents[0].shape[0])
    with torch.no_grad():
        for row in (0, 1):
            solo = solve_euler(module, noises[row], full, stacks[row], num_steps=3, streaming=row == 1)
            assert_close(latents[row].T[None], solo, MEL_TOL)


def test_streaming_prefix_is_the_whole_decode_prefix():
    """Causal, one level, chunked attention: frames of whole chunks decoded alone equal the
    same frames of a longer decode (CosyVoice3 decodes the mel received so far each time)."""
    case = FIXTURES["causal"]
    inputs = case["inputs"]
    module = estimator(case)
    chunk = module.config.static_chunk_size
    full_mask = torch.ones(1, 1, inputs["noise"].shape[-1])
    stack = cond_stack(inputs, slice(0, 1))
    with torch.no_grad():
        whole = solve_euler(module, inputs["noise"], full_mask, stack, num_steps=3, streaming=True)
        for frames in (chunk, 2 * chunk):
            part = solve_euler(module, inputs["noise"][..., :frames], full_mask[..., :frames], stack[..., :frames],
                               num_steps=3, streaming=True)
            assert torch.allclose(part, whole[..., :frames], atol=1e-5, rtol=0), frames


def test_chunk_mask():
    mask = torch.ones(1, 1, 5)
    allowed = chunk_attention_mask(mask, chunk=2)[0].int().tolist()
    assert allowed == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    left = chunk_attention_mask(mask, chunk=2, left_chunks=0)[0].int().tolist()
    assert left[3] == [0, 0, 1, 1, 0]
    padded = chunk_attention_mask(torch.tensor([[[1.0, 1.0, 0.0]]]))[0].int().tolist()
    assert padded == [[1, 1, 0]] * 3


def test_loading_reports_missing_and_extra_names():
    case = FIXTURES["causal"]
    module = estimator(case)
    state = dict(case["state"])
    dropped = state.pop("decoder.estimator.final_proj.weight")
    with pytest.raises(WeightLoadError, match="final_proj"):
        load_weights(module, state.items(), name_map=estimator_name_map)
    state["decoder.estimator.final_proj.weight"] = dropped
    state["decoder.estimator.surplus.weight"] = dropped
    with pytest.raises(WeightLoadError, match="surplus"):
        load_weights(module, state.items(), name_map=estimator_name_map)
    # the rest of the flow module is not the estimator's
    assert estimator_name_map("encoder_proj.weight") is None
    assert estimator_name_map("flow.decoder.estimator.final_proj.bias", "flow.decoder.estimator.") == "final_proj.bias"
    assert flow_front_name_map("flow.spk_embed_affine_layer.bias", "flow.") == "speaker_proj.bias"
    assert flow_front_name_map("flow.decoder.estimator.final_proj.bias", "flow.") is None


def test_noise_table_is_the_reference_table():
    assert torch.equal(noise_table()[:, :, :32], FIXTURES["flow"]["noise_head"])


@pytest.mark.parametrize("streaming", [False, True])
def test_flow_inference_matches_reference(streaming):
    """The flow module's inference around the estimator: token embedding, speaker and encoder
    projections, the prompt mel as ``cond``, the fixed noise table, ten guided steps, the
    prompt's frames cut off. The conformer encoder is a stand-in on both sides."""
    case = FIXTURES["flow"]
    state, inputs = case["state"], case["inputs"]
    front = FlowFront(FlowFrontConfig(vocab_size=50, token_dim=16, encoder_dim=20, speaker_dim=12)).eval()
    load_weights(front, state.items(), name_map=flow_front_name_map)  # strict: coverage both ways
    module = estimator(FIXTURES["causal"], state)
    encoder = torch.nn.Linear(16, 20)
    encoder.load_state_dict({"weight": state["encoder.proj.weight"], "bias": state["encoder.proj.bias"]})
    tokens = torch.cat([inputs["prompt_token"], inputs["token"]], dim=1)
    with torch.no_grad():
        encoded = encoder(front.embed_tokens(tokens, torch.tensor([tokens.shape[1]]))).repeat_interleave(2, dim=1)
        stack = front.conditioning(encoded, inputs["embedding"], inputs["prompt_feat"])
        frames = stack.shape[-1]
        mel = solve_euler(module, noise_table()[:, :, :frames], torch.ones(1, 1, frames), stack, num_steps=10,
                          cfg_rate=0.7, streaming=streaming)
    reference = case["mel_streamed" if streaming else "mel"]
    assert_close(FlowFront.new_frames(mel, inputs["prompt_feat"]), reference, MEL_TOL)


def test_released_geometry_names_and_shapes():
    """Every estimator parameter of CosyVoice2-0.5B's ``flow.pt`` (names and shapes recorded
    from the reference at the released config) maps onto ``FlowEstimator()``, and back."""
    released = json.loads((Path(__file__).parent / "fixtures" / "flow_cfm_keys.json").read_text())
    with torch.device("meta"):
        ours = {name: list(t.shape) for name, t in FlowEstimator().state_dict().items()}
    mapped = {estimator_name_map(name): shape for name, shape in released.items()}
    assert mapped == ours
