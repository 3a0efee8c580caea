"""Wan2.2 checkpoints in the diffusers layout: each folder of the tiny checkpoint loads into our
modules with coverage checked both ways (a parameter left unfilled and a tensor nothing loads
each fail); other Wan variants are refused by name; and ``load_format: dummy`` builds the real
TI2V-5B shapes on the meta device (nothing allocated), equal to diffusers' / transformers'
modules built from the same configs."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from mstar.config import parse_config
from mstar.model.wan22.checkpoint import WanCheckpoint
from mstar.model.wan22.engine import FP32_PARAMETERS
from mstar.model.wan22.transformer import WanTransformer
from mstar.model.wan22.umt5 import UMT5Encoder
from mstar.model.wan22.vae import WanVAE
from mstar.model.weights import WeightLoadError, iter_safetensors, load_weights

# The configs of Wan-AI/Wan2.2-TI2V-5B-Diffusers (latent statistics replaced: shapes only).
REAL_DIT = {"_class_name": "WanTransformer3DModel", "added_kv_proj_dim": None, "attention_head_dim": 128,
            "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 14336, "freq_dim": 256, "image_dim": None,
            "in_channels": 48, "num_attention_heads": 24, "num_layers": 30, "out_channels": 48,
            "patch_size": [1, 2, 2], "pos_embed_seq_len": None, "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 1024, "text_dim": 4096}
REAL_VAE = {"_class_name": "AutoencoderKLWan", "attn_scales": [], "base_dim": 160, "decoder_base_dim": 256,
            "dim_mult": [1, 2, 4, 4], "dropout": 0.0, "in_channels": 12, "is_residual": True,
            "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48, "num_res_blocks": 2, "out_channels": 12,
            "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
            "temperal_downsample": [False, True, True], "z_dim": 48}
REAL_UMT5 = {"architectures": ["UMT5EncoderModel"], "d_ff": 10240, "d_kv": 64, "d_model": 4096,
             "dense_act_fn": "gelu_new", "feed_forward_proj": "gated-gelu", "is_gated_act": True,
             "layer_norm_epsilon": 1e-06, "model_type": "umt5", "num_heads": 64, "num_layers": 24,
             "relative_attention_max_distance": 128, "relative_attention_num_buckets": 32, "vocab_size": 256384}


def folder_config(root, folder):
    return json.loads((root / folder / "config.json").read_text())


@pytest.mark.parametrize("folder", ["transformer", "vae", "text_encoder"])
def test_folders_load_with_full_coverage(checkpoint, folder):
    ckpt = WanCheckpoint(checkpoint.root)
    module = {"transformer": lambda: WanTransformer(ckpt.transformer_config()),
              "vae": lambda: WanVAE(ckpt.vae_config()),
              "text_encoder": lambda: ckpt.text().build_encoder()}[folder]()
    load_weights(module, iter_safetensors(checkpoint.root / folder))
    reference = {"transformer": checkpoint.transformer, "vae": checkpoint.vae,
                 "text_encoder": checkpoint.text_encoder}[folder]
    ours = module.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours[name], tensor), name


def test_text_encoder_matches_the_pipeline(checkpoint):
    ckpt = WanCheckpoint(checkpoint.root)
    text = ckpt.text()
    encoder = text.build_encoder().eval()
    load_weights(encoder, iter_safetensors(checkpoint.root / "text_encoder"))
    prompts = ["a cat", "a dog walks on the sunlit floor"]
    want = checkpoint.pipeline()._get_t5_prompt_embeds(prompts, max_sequence_length=512,
                                                       device=torch.device("cpu"))
    tokens = [text.tokenize(p) for p in prompts]
    got = torch.stack(text.encode(encoder, [ids for ids, _ in tokens], [mask for _, mask in tokens]))
    assert got.shape == want.shape == (2, 512, 32)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_coverage_is_checked_both_ways(checkpoint):
    root = checkpoint.root
    tensors = load_file(root / "transformer" / "diffusion_pytorch_model.safetensors")
    dit = WanTransformer(WanCheckpoint(root).transformer_config())
    missing = {k: v for k, v in tensors.items() if k != "scale_shift_table"}
    with pytest.raises(WeightLoadError, match="did not fill.*scale_shift_table"):
        load_weights(dit, missing.items())
    extra = {**tensors, "blocks.0.attn2.add_k_proj.weight": torch.zeros(24, 32)}
    with pytest.raises(WeightLoadError, match="nothing loads.*add_k_proj"):
        load_weights(dit, extra.items())


@pytest.mark.parametrize("change, message", [
    ({"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875}, "A14B"),
    ({"image_encoder": ["transformers", "CLIPVisionModel"]}, "Wan2.1 I2V"),
    ({"expand_timesteps": False}, "expand_timesteps"),
])
def test_other_variants_are_refused(checkpoint, tmp_path, change, message):
    index = json.loads((checkpoint.root / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, **change}))
    with pytest.raises(ValueError, match=message):
        WanCheckpoint(tmp_path).check_variant()


def test_dummy_weights_at_real_shapes_on_meta(tmp_path):
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    for folder, data in (("transformer", REAL_DIT), ("vae", REAL_VAE), ("text_encoder", REAL_UMT5)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "config.json").write_text(json.dumps(data))
    ckpt = WanCheckpoint(tmp_path)
    config = parse_config({"model": "wan22", "model_path": str(tmp_path), "load_format": "dummy"})
    load = ckpt.loader(config, 0, torch.device("meta"))
    ours = {"transformer": load(lambda: WanTransformer(ckpt.transformer_config()), "transformer", 2),
            "vae": load(lambda: WanVAE(ckpt.vae_config()), "vae", 3),
            "text_encoder": load(lambda: UMT5Encoder(ckpt.text_config()), "text_encoder", 1)}
    with torch.device("meta"):
        theirs = {"transformer": WanTransformer3DModel.from_config(REAL_DIT),
                  "vae": AutoencoderKLWan.from_config(REAL_VAE),
                  "text_encoder": UMT5EncoderModel(UMT5Config(**REAL_UMT5))}
    for folder, module in ours.items():
        assert all(p.is_meta for p in module.parameters()), folder
        shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        want = {k: tuple(v.shape) for k, v in theirs[folder].state_dict().items()}
        assert shapes == want, folder
    billions = sum(p.numel() for p in ours["transformer"].parameters()) / 1e9
    print(f"[shapes] DiT {billions:.2f}B parameters")
    assert 4.9 < billions < 5.1


def test_bf16_keeps_diffusers_fp32_parameters(checkpoint):
    """In a bfloat16 deployment the time MLP, the modulation tables and the cross-attention norm
    stay float32 (diffusers' ``_keep_in_fp32_modules``), and the DiT's bf16 output follows
    diffusers' bf16 model loaded from the same folder."""
    ckpt = WanCheckpoint(checkpoint.root)
    config = parse_config({"model": "wan22", "model_path": str(checkpoint.root), "dtype": "bfloat16"})

    dit = ckpt.loader(config, 0, torch.device("cpu"))(lambda: WanTransformer(ckpt.transformer_config()),
                                                     "transformer", 2, fp32=FP32_PARAMETERS)
    # diffusers' bf16 model as from_pretrained(torch_dtype=bfloat16) builds it (accelerate is not
    # installed here): its _keep_in_fp32_modules' parameters float32, the rest bfloat16
    ref = copy.deepcopy(checkpoint.transformer).to(torch.bfloat16)
    keep = set(ref._keep_in_fp32_modules)
    for name, p in ref.named_parameters():
        if keep & set(name.split(".")):
            p.data = checkpoint.transformer.get_parameter(name).data.clone()
    kept = {name for name, p in dit.named_parameters() if p.dtype == torch.float32}
    assert kept == {name for name, p in ref.named_parameters() if p.dtype == torch.float32}
    assert kept and dit.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 4, 3, 4, 2, generator=gen).bfloat16()
    text = torch.randn(1, 7, 32, generator=gen).bfloat16()
    t = torch.tensor([[0.0, 0.0, 700.0, 700.0, 700.0, 700.0]])
    with torch.no_grad():
        want = ref(latents, t, text, return_dict=False)[0].float()
        got = dit(latents, t, text).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"[parity] bf16 DiT: max rel err {err:.2e}")
    assert err <= 1e-3  # 0 on this CPU: the same bf16 arithmetic


@pytest.mark.parametrize("vae_dtype", ["float32", "bfloat16"])
def test_vae_dtype_is_its_own(checkpoint, vae_dtype):
    """The VAE runs in ``vae_dtype`` (float32 by default, as the model card loads it) whatever
    the deployment's dtype."""
    from mstar.engine.base import EngineItem
    from mstar.model.wan22.engine import wan_engines
    from mstar.model.wan22.knobs import WanKnobs

    loaded = {}

    class Recording(WanCheckpoint):
        def load(self, make, folder, **kwargs):
            module = super().load(make, folder, **kwargs)
            loaded[folder] = {p.dtype for p in module.parameters()}
            return module

    config = parse_config({"model": "wan22", "model_path": str(checkpoint.root), "dtype": "bfloat16"})
    knobs = WanKnobs.parse({} if vae_dtype == "float32" else {"vae_dtype": vae_dtype})
    vae = wan_engines(Recording(checkpoint.root), knobs, config, {"vae"}, torch.device("cpu"))["vae"]
    assert loaded == {"vae": {getattr(torch, vae_dtype)}}
    [out] = vae.run([EngineItem("r", "decode", 0, {"latents": torch.randn(4, 2, 2, 2)}, {})])
    assert out.outputs["frames"].shape == (5, 32, 32, 3) and out.outputs["frames"].dtype == torch.uint8
