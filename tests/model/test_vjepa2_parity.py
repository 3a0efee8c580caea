"""V-JEPA 2 against its references, float32 on the CPU, tiny random configs.

* ``vjepa2``: transformers' ``VJEPA2Model`` (encoder, and predictor for fixed context/target
  masks), weights saved in its key layout and loaded into ours through ``VJEPA2Checkpoint``.
* ``vjepa2_ac``: the official modules of ``cc-vjepa2==0.0.3``, recorded by
  ``vjepa2/record_reference.py`` into ``vjepa2/ac_reference.safetensors`` (the package does not
  install beside our torch): the encoder per frame and two action-conditioned predictors (with
  and without extrinsics), loaded from a ``.pt`` in the released layout through
  ``VJEPA2ACCheckpoint``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from mstar.model.vjepa2.checkpoint import AC_FILE, VJEPA2ACCheckpoint, VJEPA2Checkpoint
from mstar.model.weights import WeightLoadError

CPU = torch.device("cpu")
FIXTURE = Path(__file__).with_name("vjepa2") / "ac_reference.safetensors"


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> float:
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1.0))
    assert err <= tol, f"max relative error {err:.3g} > {tol}"
    return err


# --------------------------------------------------------------------------- vjepa2 (HF)
HF_TINY = dict(patch_size=8, crop_size=32, frames_per_clip=4, tubelet_size=2, hidden_size=64,
               num_attention_heads=4, num_hidden_layers=2, mlp_ratio=2.0, pred_hidden_size=48,
               pred_num_attention_heads=3, pred_num_hidden_layers=2, pred_num_mask_tokens=3,
               pred_zero_init_mask_tokens=False)


def write_hf_checkpoint(root: Path, seed: int = 0):
    """A tiny ``VJEPA2Model`` saved like the hub repo (``config.json``, ``model.safetensors``)."""
    from transformers import VJEPA2Config, VJEPA2Model

    torch.manual_seed(seed)
    reference = VJEPA2Model(VJEPA2Config(**HF_TINY)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    root.mkdir(parents=True, exist_ok=True)
    reference.config.to_json_file(root / "config.json")
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(root / "model.safetensors"))
    return reference


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vjepa2-hf")
    reference = write_hf_checkpoint(root)
    ours = VJEPA2Checkpoint.locate(str(root)).load_model(CPU, torch.float32, dummy=False, seed=0)
    return reference, ours, root


def video(batch: int, frames: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, frames, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_encoder_matches_transformers(hf_pair) -> None:
    reference, ours, _ = hf_pair
    clip = video(2, 4, 0)
    with torch.no_grad():
        want = reference(clip, skip_predictor=True).last_hidden_state
        got = ours.encoder(clip)
    assert got.shape == (2, 2 * 16, 64)
    close(got, want)


def test_single_frame_fills_a_tubelet(hf_pair) -> None:
    reference, ours, _ = hf_pair
    clip = video(1, 1, 3)
    with torch.no_grad():
        close(ours.encoder(clip), reference(clip, skip_predictor=True).last_hidden_state)


def test_predictor_matches_transformers_for_a_fixed_mask(hf_pair) -> None:
    reference, ours, _ = hf_pair
    clip = video(2, 4, 1)
    gen = torch.Generator().manual_seed(7)
    order = torch.stack([torch.randperm(32, generator=gen) for _ in range(2)])
    context, target = order[:, :20].sort(1).values, order[:, 20:]  # target left unsorted on purpose
    with torch.no_grad():
        out = reference(clip, context_mask=[context], target_mask=[target])
        hidden = ours.encoder(clip)
        got = ours.predictor(hidden, context, target)
    assert got.shape == (2, 12, 64)
    close(got, out.predictor_output.last_hidden_state)
    with torch.no_grad():  # the default: every token is context and target
        full = torch.arange(32).expand(2, -1)
        want = reference(clip).predictor_output.last_hidden_state
        close(ours.predictor(hidden, full, full), want)


def test_batch_equals_one_at_a_time(hf_pair) -> None:
    _, ours, _ = hf_pair
    clip = video(3, 4, 2)
    context, target = torch.arange(0, 32, 2).expand(3, -1), torch.arange(1, 32, 2).expand(3, -1)
    with torch.no_grad():
        hidden = ours.encoder(clip)
        predicted = ours.predictor(hidden, context, target)
        for i in range(3):
            one = ours.encoder(clip[i:i + 1])
            close(one, hidden[i:i + 1], 1e-6)
            close(ours.predictor(one, context[:1], target[:1]), predicted[i:i + 1], 1e-6)


def test_checkpoint_coverage_both_ways(hf_pair, tmp_path) -> None:
    from safetensors.torch import load_file

    _, _, root = hf_pair
    tensors = load_file(str(root / "model.safetensors"))
    for name, edit in (("missing", lambda t: t.pop("predictor.proj.bias")),
                       ("extra", lambda t: t.__setitem__("encoder.surplus", torch.zeros(1)))):
        broken = tmp_path / name
        broken.mkdir()
        (broken / "config.json").write_text((root / "config.json").read_text())
        edited = dict(tensors)
        edit(edited)
        save_file(edited, str(broken / "model.safetensors"))
        with pytest.raises(WeightLoadError, match="predictor.proj.bias" if name == "missing" else "encoder.surplus"):
            VJEPA2Checkpoint.locate(str(broken)).load_model(CPU, torch.float32, dummy=False, seed=0)


def test_dummy_weights_are_seeded_and_skip_the_file(hf_pair, tmp_path) -> None:
    _, _, root = hf_pair
    (tmp_path / "config.json").write_text((root / "config.json").read_text())  # no weights at all
    ckpt = VJEPA2Checkpoint.locate(str(tmp_path))
    a = ckpt.load_model(CPU, torch.float32, dummy=True, seed=3)
    b = ckpt.load_model(CPU, torch.float32, dummy=True, seed=3)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


# ------------------------------------------------------------------------ vjepa2_ac (official)
def read_fixture() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(FIXTURE), "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()


def write_ac_checkpoint(root: Path, predictor: str) -> None:
    """The fixture's weights as the release lays them out: one ``.pt`` with ``encoder`` and
    ``predictor`` state dicts under ``module.backbone.``, and a ``config.json`` of dimensions."""
    tensors, meta = read_fixture()
    state = {"encoder": {k[len("encoder."):]: v for k, v in tensors.items() if k.startswith("encoder.module.")},
             "predictor": {k[len(predictor) + 1:]: v for k, v in tensors.items()
                           if k.startswith(f"{predictor}.module.")}}
    root.mkdir(parents=True, exist_ok=True)
    torch.save(state, root / AC_FILE)
    config = {"encoder": json.loads(meta["encoder"]), "predictor": json.loads(meta["predictors"])[predictor]}
    (root / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("predictor", ["plain", "extrinsics"])
def test_ac_matches_the_official_modules(tmp_path, predictor: str) -> None:
    tensors, meta = read_fixture()
    assert meta["reference"] == "cc-vjepa2==0.0.3"
    write_ac_checkpoint(tmp_path, predictor)
    model = VJEPA2ACCheckpoint.locate(str(tmp_path)).load_model(CPU, torch.float32, dummy=False, seed=0)
    with torch.no_grad():
        tokens = model.encode_frames(tensors["video"], normalize=False)
        close(tokens, tensors["encoder_tokens"])
        normed = F.layer_norm(tensors["encoder_tokens"], tokens.shape[-1:])
        extrinsics = tensors["extrinsics"] if predictor == "extrinsics" else None
        got = model.predictor(normed, tensors["actions"], tensors["states"], extrinsics)
    close(got, tensors[f"{predictor}.predicted"])


def test_ac_batch_equals_one_at_a_time(tmp_path) -> None:
    tensors, _ = read_fixture()
    write_ac_checkpoint(tmp_path, "plain")
    model = VJEPA2ACCheckpoint.locate(str(tmp_path / AC_FILE)).load_model(CPU, torch.float32, dummy=False, seed=0)
    with torch.no_grad():
        tokens = model.encode_frames(tensors["video"])
        out = model.predict(tokens, tensors["actions"], tensors["states"])
        for i in range(2):
            one = model.encode_frames(tensors["video"][i:i + 1])
            close(one, tokens[i:i + 1], 1e-6)
            close(model.predict(one, tensors["actions"][i:i + 1], tensors["states"][i:i + 1]), out[i:i + 1], 1e-6)


def test_ac_is_frame_causal(tmp_path) -> None:
    """Changing the last frame's action changes only the last frame's prediction."""
    tensors, _ = read_fixture()
    write_ac_checkpoint(tmp_path, "plain")
    model = VJEPA2ACCheckpoint.locate(str(tmp_path)).load_model(CPU, torch.float32, dummy=False, seed=0)
    actions = tensors["actions"][:1].clone()
    with torch.no_grad():
        tokens = model.encode_frames(tensors["video"][:1])
        before = model.predict(tokens, actions, tensors["states"][:1])
        actions[:, -1] += 1.0
        after = model.predict(tokens, actions, tensors["states"][:1])
    assert torch.equal(before[:, :32], after[:, :32])
    assert not torch.allclose(before[:, 32:], after[:, 32:])


def test_ac_checkpoint_names_a_stray_tensor(tmp_path) -> None:
    write_ac_checkpoint(tmp_path, "plain")
    state = torch.load(tmp_path / AC_FILE, weights_only=True)
    state["predictor"]["module.backbone.surplus"] = torch.zeros(1)
    del state["encoder"]["module.backbone.norm.bias"]
    torch.save(state, tmp_path / AC_FILE)
    with pytest.raises(WeightLoadError, match="surplus|layernorm.bias"):
        VJEPA2ACCheckpoint.locate(str(tmp_path)).load_model(CPU, torch.float32, dummy=False, seed=0)
