"""Waypoint's checkpoint: a tiny directory in the released layout, in the hub cache, loads into
the same DiT and TAEHV that wrote it (the rollout's frames equal the source modules'); a tensor
the model lacks or a parameter the checkpoint lacks fails naming it; ``ae_uri`` may point
elsewhere; dummy weights need no files."""

from __future__ import annotations

from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

from mstar.model.waypoint.checkpoint import WaypointCheckpoint
from mstar.model.waypoint.rollout import WaypointWorld
from mstar.model.weights import WeightLoadError
from tests.support.waypoint import snapshot_dir, write_checkpoint

REPO = "Overworld/Waypoint-1.5-1B"
CPU = torch.device("cpu")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def frames(world: WaypointWorld, seed: int = 3) -> list[torch.Tensor]:
    rollout = world.new_rollout(seed)
    world.start(rollout, torch.rand(3, 16, 32, generator=torch.Generator().manual_seed(1)))
    controls = torch.randn(3, world.dit.config.control_dim, generator=torch.Generator().manual_seed(2))
    return [world.step(rollout, row) for row in controls]


def test_hub_cache_checkpoint_loads_the_source(tmp_path: Path, offline) -> None:
    cache = tmp_path / "hub"
    dit, tae = write_checkpoint(snapshot_dir(cache, REPO))
    ckpt = WaypointCheckpoint.locate(REPO, str(cache))
    assert ckpt.config().n_buttons == 5 and ckpt.ae_config().latent_channels == 4
    loaded = ckpt.load_world(CPU, torch.float32)
    want = frames(WaypointWorld(dit, tae, CPU))
    got = frames(loaded)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert max(int(f.max()) - int(f.min()) for f in got) > 10  # not flat frames


def test_ae_uri_may_point_elsewhere(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "model", ae_subdir="../taehv")
    ckpt = WaypointCheckpoint.locate(str(tmp_path / "model"))
    assert ckpt.ae_dir().resolve() == (tmp_path / "taehv").resolve()
    ckpt.load_world(CPU, torch.float32)


@pytest.mark.parametrize("part", ["model.safetensors", "ae/taehv.safetensors"])
def test_coverage_is_checked_both_ways(tmp_path: Path, part: str) -> None:
    write_checkpoint(tmp_path)
    path = tmp_path / part
    tensors = load_file(str(path))
    dropped = sorted(tensors)[0]
    save_file({**{k: v for k, v in tensors.items() if k != dropped}, "extra.weight": torch.zeros(1)}, str(path))
    with pytest.raises(WeightLoadError) as err:
        WaypointCheckpoint.locate(str(tmp_path)).load_world(CPU, torch.float32)
    assert dropped in str(err.value) and "extra.weight" in str(err.value)


def test_dummy_weights_read_no_tensors(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "ae" / "taehv.safetensors").unlink()
    world = WaypointCheckpoint.locate(str(tmp_path)).load_world(CPU, torch.float32, dummy=True, seed=0)
    assert frames(world)[0].shape == (4, 16, 32, 3)


def test_a_text_prompted_config_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path)
    with open(tmp_path / "config.yaml", "a") as f:
        f.write("prompt_conditioning: cross_attention\n")
    with pytest.raises(ValueError, match="prompt_conditioning"):
        WaypointCheckpoint.locate(str(tmp_path)).config()


def test_bfloat16_keeps_the_noise_conditioner_in_float32(tmp_path: Path) -> None:
    dit, tae = write_checkpoint(tmp_path)
    world = WaypointCheckpoint.locate(str(tmp_path)).load_world(CPU, torch.bfloat16)
    assert world.dit.denoise_step_emb.mlp.fc1.weight.dtype == torch.float32
    assert world.dit.unpatchify.weight.dtype == torch.bfloat16
    got = frames(world)
    want = frames(WaypointWorld(dit, tae, CPU))
    assert all(g.shape == w.shape for g, w in zip(got, want))
    # bf16 drifts from the float32 rollout, but stays near it on the first step
    assert (got[0].float() - want[0].float()).abs().mean() < 20


def other_spellings(dit, config) -> dict[str, torch.Tensor]:
    """``dit``'s state dict as world_engine's other spellings have it: split conditioning heads
    (the module's own), ``dit_mlp``, the fusion's ``fc1_x`` / ``fc1_c`` / ``fc2``, a transposed-
    conv ``unpatchify`` with a per-channel bias and a flat ``patchify``."""
    ph, pw = config.patch
    out = {}
    for name, tensor in dit.state_dict().items():
        if ".mlp." in name and ".ctrl_mlpfusion." not in name and ".ctrl_emb." not in name and "transformer." in name:
            out[name.replace(".mlp.", ".dit_mlp.")] = tensor
        elif name.endswith("ctrl_mlpfusion.mlp.fc1.weight"):
            x, c = tensor.chunk(2, dim=1)
            prefix = name.removesuffix(".mlp.fc1.weight")
            out[f"{prefix}.fc1_x.weight"], out[f"{prefix}.fc1_c.weight"] = x.contiguous(), c.contiguous()
        elif name.endswith("ctrl_mlpfusion.mlp.fc2.weight"):
            out[name.replace(".mlp.fc2.", ".fc2.")] = tensor
        elif name == "unpatchify.weight":
            out[name] = tensor.reshape(config.channels, ph, pw, -1).permute(3, 0, 1, 2).contiguous()
        elif name == "unpatchify.bias":
            out[name] = tensor[::ph * pw].contiguous()
        elif name == "patchify.weight":
            out[name] = tensor.flatten(1)
        else:
            out[name] = tensor
    return {name: tensor.clone() for name, tensor in out.items()}  # tied tensors saved as copies


def test_world_engine_spellings_load(tmp_path: Path) -> None:
    from mstar.model.waypoint.dit import WorldDiT
    from tests.support.waypoint import randomize, tiny_dit_config

    _, tae = write_checkpoint(tmp_path)
    config = tiny_dit_config(split_cond_heads=True)
    dit = randomize(WorldDiT(config), 5)
    with torch.no_grad():  # a per-channel bias, as a transposed conv has
        dit.unpatchify.bias.copy_(dit.unpatchify.bias[::2].repeat_interleave(2))
    saved = other_spellings(dit, config)
    assert any(".attn_cond_head." in k for k in saved) and "transformer.blocks.0.dit_mlp.fc1.weight" in saved
    save_file(saved, str(tmp_path / "model.safetensors"))
    loaded = WaypointCheckpoint.locate(str(tmp_path)).load_world(CPU, torch.float32)
    assert loaded.dit.config.split_cond_heads
    got, want = frames(loaded), frames(WaypointWorld(dit, tae, CPU))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_taehv_pth_with_wider_time_grow_loads(tmp_path: Path) -> None:
    """taehv's own ``.pth`` files; a time-grow conv saved for 2x upscaling keeps its last time
    step's channels when the config turns that upscaling off (taehv's loader does the same)."""
    dit, tae = write_checkpoint(tmp_path)
    (tmp_path / "ae" / "taehv.safetensors").unlink()
    state = {k: v.clone() for k, v in tae.state_dict().items()}
    grow = "decoder.7.conv.weight"  # the first time-grow block: stride 1 in the default flags
    assert state[grow].shape[0] == 256
    state[grow] = torch.cat((torch.randn_like(state[grow]), state[grow]))  # as if saved for stride 2
    torch.save(state, tmp_path / "ae" / "taehv1_5.pth")
    torch.save({}, tmp_path / "ae" / "taew2_1.pth")  # another variant beside it: the 1.5 file is taken
    loaded = WaypointCheckpoint.locate(str(tmp_path)).load_world(CPU, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(frames(loaded), frames(WaypointWorld(dit, tae, CPU))))
