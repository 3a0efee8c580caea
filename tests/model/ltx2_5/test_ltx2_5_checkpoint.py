"""LTX-2.5 checkpoints in the diffusers layout: each folder of the tiny checkpoint loads into our
modules with coverage checked both ways (what we do not build, the VAE encoders and Gemma's
towers, is skipped by name; anything else left over or unfilled fails); a checkpoint of another
LTX generation is refused by name; and ``load_format: dummy`` builds diffusers' default LTX-2
shapes with the LTX-2.5 switches on the meta device, equal to diffusers' modules' shapes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mstar.model.ltx2_5.checkpoint import NAME_MAPS, LtxCheckpoint
from mstar.model.ltx2_5.engine import SEEDS, build_component
from mstar.model.weights import WeightLoadError, load_weights

FOLDERS = sorted(SEEDS)


def loader(ckpt):
    def load(make, folder, offset, **options):
        return ckpt.load(make, folder, device=torch.device("cpu"), dtype=torch.float32, dummy=False, seed=offset,
                         **options)
    return load


@pytest.mark.parametrize("folder", FOLDERS)
def test_folders_load_with_full_coverage(checkpoint, folder):
    ckpt = LtxCheckpoint(checkpoint.root)
    ckpt.check_variant()
    module = build_component(ckpt, folder, loader(ckpt))
    reference = checkpoint.modules[folder].state_dict()
    ours = module.state_dict()
    rename = NAME_MAPS.get(folder, lambda n: n)
    for name, tensor in load_file(next((checkpoint.root / folder).glob("*.safetensors"))).items():
        target = rename(name)
        if target is not None:
            assert torch.equal(ours[target], tensor), name
    assert len(ours) <= len(reference)


def test_a_stray_or_missing_tensor_fails(checkpoint, tmp_path):
    ckpt = LtxCheckpoint(checkpoint.root)
    module = build_component(ckpt, "transformer", loader(ckpt))
    tensors = load_file(checkpoint.root / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(WeightLoadError, match="stray"):
        load_weights(module, [*tensors.items(), ("stray.weight", torch.zeros(1))])
    tensors.pop("proj_out.weight")
    with pytest.raises(WeightLoadError, match="proj_out.weight"):
        load_weights(module, tensors.items())


def test_other_generations_are_refused(checkpoint, tmp_path):
    root = tmp_path / "ltx2_0"
    shutil.copytree(checkpoint.root, root)
    text = json.loads((root / "text_encoder" / "config.json").read_text())
    text["text_config"]["model_type"] = "gemma3_text"
    (root / "text_encoder" / "config.json").write_text(json.dumps(text))
    with pytest.raises(ValueError, match="Gemma 3"):
        LtxCheckpoint(root).check_variant()


def test_dummy_real_shapes_on_meta():
    """diffusers' default LTX-2 widths (48 layers, 4096 / 2048 wide) with the LTX-2.5 switches:
    our DiT, connectors and decoders have exactly diffusers' parameter shapes, built on the
    meta device (nothing allocated)."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    from mstar.model.ltx2_5.audio_vae import LtxAudioVae, LtxAudioVaeConfig
    from mstar.model.ltx2_5.config import LtxTransformerConfig
    from mstar.model.ltx2_5.connectors import LtxConnectorsConfig, LtxTextConnectors
    from mstar.model.ltx2_5.transformer import LtxTransformer
    from mstar.model.ltx2_5.video_vae import LtxVideoVae, LtxVideoVaeConfig
    from mstar.model.ltx2_5.vocoder import build_vocoder
    from mstar.model.weights import init_dummy_weights

    switches = dict(rope_type="split", gated_attn=True, audio_gated_attn=True, cross_attn_mod=True,
                    audio_cross_attn_mod=True, use_prompt_embeddings=False, ff_bias=False,
                    use_prompt_adaln_single=False, use_keyframes_abs_pos_embedding=True)
    connectors = dict(per_modality_projections=True, rope_type="split", video_gated_attn=True, audio_gated_attn=True,
                      video_connector_num_attention_heads=32, audio_connector_num_attention_heads=32,
                      audio_connector_attention_head_dim=64)
    with torch.device("meta"):
        pairs = [
            (LTX2VideoTransformer3DModel(**switches),
             lambda r: LtxTransformer(LtxTransformerConfig.from_dict(dict(r.config)))),
            (LTX2TextConnectors(**connectors),
             lambda r: LtxTextConnectors(LtxConnectorsConfig.from_dict(dict(r.config)))),
            (AutoencoderKLLTX2Video(), lambda r: LtxVideoVae(LtxVideoVaeConfig.from_dict(dict(r.config)))),
            (AutoencoderKLLTX2Audio(), lambda r: LtxAudioVae(LtxAudioVaeConfig.from_dict(dict(r.config)))),
            (LTX2VocoderWithBWE(), lambda r: build_vocoder({"_class_name": "LTX2VocoderWithBWE", **dict(r.config)})),
        ]
        for ref, build in pairs:
            ours = build(ref)
            init_dummy_weights(ours, seed=0)
            want = {k: v.shape for k, v in ref.state_dict().items() if not k.startswith("encoder.")}
            got = {k: v.shape for k, v in ours.state_dict().items()}
            assert got == want, type(ref).__name__
            assert all(p.is_meta for p in ours.parameters())
    assert sum(v.numel() for k, v in pairs[0][0].state_dict().items()) > 10e9  # a >10B DiT: the shapes are real-sized


def test_deployment_yaml_places_every_node():
    from pathlib import Path

    import yaml

    from mstar.config import parse_config
    from mstar.model.registry import model_class

    path = Path(__file__).parents[3] / "configs" / "ltx2_5.yaml"
    config = parse_config(yaml.safe_load(path.read_text()))
    graph = model_class("ltx2_5")(config).graph()
    placed = [n for group in config.node_groups for n in group.node_names]
    assert sorted(placed) == sorted(graph.nodes)
    assert sorted(graph.walks) == ["t2av", "t2v"]
