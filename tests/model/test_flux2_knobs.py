"""FLUX.2 [klein] deployment knobs: lora (folded at load), compile, max_batch_size, and the
flux2_klein_9b registration. Uses the tiny checkpoint of test_flux2_klein_walk."""

import pytest
import torch
from safetensors.torch import save_file
from test_flux2_klein_walk import reference  # noqa: F401  (the tiny checkpoint fixture)

from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.model.flux2.knobs import Flux2Knobs
from mstar.model.flux2.model import Flux2Klein
from mstar.model.flux2.positions import image_ids, text_ids
from mstar.model.registry import model_class
from tests.support.markers import needs_cuda

LORA_TARGETS = {"transformer_blocks.0.attn.to_q": (32, 32), "proj_out": (16, 32),
                "single_transformer_blocks.0.attn.to_qkv_mlp_proj": (288, 32)}


def build_dit(root, device="cpu", dtype="float32", **kwargs):
    spec = model_class("flux2_klein")(parse_config({"model": "flux2_klein", "model_path": str(root), "device": device,
                                                    "dtype": dtype, "model_kwargs": kwargs}))
    return spec.build_engines({"dit"}, torch.device(device))["dit"]


def step_items(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {"num_steps": 2, "image_seq_len": 6, "rows": 2, "cols": 3}
    return [EngineItem(f"r{i}", "step", 0, {"latents": torch.randn(6, 16, generator=g),
                                           "text": torch.randn(20, 48, generator=g)}, params)
            for i in range(count)]


def test_cudnn_attention_switch_runs_the_same_maths(reference):  # noqa: F811
    """attention_backend: cudnn only reorders which fused kernels may run; where cuDNN
    cannot (here: the CPU) the DiT's output is the reference's, bit for bit."""
    want = build_dit(reference[0]).run(step_items(2))
    got = build_dit(reference[0], attention_backend="cudnn").run(step_items(2))
    for w, g in zip(want, got):
        assert torch.equal(g.outputs["latents"], w.outputs["latents"])


@needs_cuda
def test_cudnn_attention_and_inductor_on_the_gpu_match_eager(reference):  # noqa: F811
    """On the GPU in bf16: the DiT step with cuDNN attention, and compiled by inductor with
    it, equals the eager PyTorch-attention step within bf16 rounding; cuDNN's kernel ran."""
    from torch.profiler import ProfilerActivity, profile

    root = reference[0]
    want = build_dit(root, "cuda", "bfloat16").run(step_items(2))
    engine = build_dit(root, "cuda", "bfloat16", attention_backend="cudnn")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = engine.run(step_items(2))
    assert any("cudnn_attention" in e.key for e in prof.key_averages()), "cuDNN attention did not run"
    compiled = build_dit(root, "cuda", "bfloat16", attention_backend="cudnn", compile=True).run(step_items(2))
    for w, g, c in zip(want, got, compiled):
        w = w.outputs["latents"].float()
        for out in (g.outputs["latents"].float(), c.outputs["latents"].float()):
            assert (out - w).norm() / w.norm() < 2e-2


def test_lora_is_folded_into_the_served_dit(reference, tmp_path):  # noqa: F811
    """The served DiT with a PEFT-format adapter equals diffusers' transformer whose weights
    were merged by hand (W + scale * alpha / r * B @ A)."""
    root, _, dit, _, _ = reference
    g = torch.Generator().manual_seed(11)
    tensors, merged = {}, {k: v.clone() for k, v in dit.state_dict().items()}
    for name, (out, inp) in LORA_TARGETS.items():
        a, b = torch.randn(4, inp, generator=g) * 0.3, torch.randn(out, 4, generator=g) * 0.3
        tensors[f"transformer.{name}.lora_A.weight"], tensors[f"transformer.{name}.lora_B.weight"] = a, b
        tensors[f"transformer.{name}.alpha"] = torch.tensor(8.0)
        merged[f"{name}.weight"] += 0.75 * 8.0 / 4 * (b @ a)
    save_file(tensors, tmp_path / "style.safetensors")
    engine = build_dit(root, lora=[{"path": str(tmp_path / "style.safetensors"), "scale": 0.75}])

    from diffusers import Flux2Transformer2DModel

    want_model = Flux2Transformer2DModel.from_config(dit.config).eval()
    want_model.load_state_dict(merged)
    [item] = step_items(1)
    t = torch.tensor([0.6])
    img, txt = image_ids(2, 3)[None], text_ids(20)[None]
    with torch.no_grad():
        want = want_model(hidden_states=item.inputs["latents"][None], encoder_hidden_states=item.inputs["text"][None],
                          timestep=t, img_ids=img, txt_ids=txt, guidance=None, return_dict=False)[0]
        ours = engine.velocity(item.inputs["latents"][None], item.inputs["text"][None], t, [item.params])
        plain = build_dit(root).velocity(item.inputs["latents"][None], item.inputs["text"][None], t, [item.params])
    assert (ours - want).norm() / want.norm() <= 1e-5
    assert (plain - want).norm() / want.norm() > 1e-3  # the adapter does change the output


def test_compile_switch_matches_eager(reference):  # noqa: F811
    """compile: true wraps the DiT in torch.compile (inductor by default; this CPU test traces
    with the aot_eager backend, since inductor's C++ build takes minutes on the shared CI CPU)."""
    eager = build_dit(reference[0])
    compiled = build_dit(reference[0], compile=True, compile_backend="aot_eager")
    want = eager.run(step_items(2))
    got = compiled.run(step_items(2))
    for w, g in zip(want, got):
        assert torch.allclose(g.outputs["latents"], w.outputs["latents"], rtol=1e-4, atol=1e-4)


def test_max_batch_size_caps_the_rows_of_a_forward(reference):  # noqa: F811
    engine = build_dit(reference[0], max_batch_size=2)
    outputs = engine.run(step_items(3))
    assert list(engine.forward_rows) == [2, 1]
    alone = build_dit(reference[0]).run(step_items(3))
    for a, b in zip(outputs, alone):
        assert torch.allclose(a.outputs["latents"], b.outputs["latents"], rtol=1e-5, atol=1e-6)


def test_vae_compile_switch_matches_eager(reference):  # noqa: F811
    """vae_compile: true compiles the VAE decode (aot_eager here, as above); same images."""
    def vae(**kwargs):
        spec = model_class("flux2_klein")(parse_config({"model": "flux2_klein", "model_path": str(reference[0]),
                                                        "model_kwargs": kwargs}))
        return spec.build_engines({"vae"}, torch.device("cpu"))["vae"]

    latents = torch.randn(6, 16, generator=torch.Generator().manual_seed(3))
    item = EngineItem("v", "decode", 0, {"latents": latents}, {"rows": 2, "cols": 3})
    [want] = vae().run([item])
    [got] = vae(vae_compile=True, compile_backend="aot_eager").run([item])
    want, got = want.outputs["image"], got.outputs["image"]  # uint8 [H, W, 3] pixels
    assert want.dtype == torch.uint8 and want.shape == (8, 12, 3) and want.float().std() > 1
    assert (got.int() - want.int()).abs().max() <= 1  # at most a rounding flip at a .5 boundary


@pytest.mark.parametrize("kwargs, key", [
    ({"max_batch_size": 0}, "model_kwargs.max_batch_size"),
    ({"max_image_area": "big"}, "model_kwargs.max_image_area"),
    ({"compile": "yes"}, "model_kwargs.compile"),
    ({"vae_compile": 1}, "model_kwargs.vae_compile"),
    ({"cuda_graphs": "on"}, "model_kwargs.cuda_graphs"),
    ({"fused_kernels": "on"}, "model_kwargs.fused_kernels"),
    ({"attention_backend": "flash"}, "model_kwargs.attention_backend"),
    ({"lora": [{"scale": 2}]}, "model_kwargs.lora[0]"),
])
def test_bad_knobs_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        Flux2Knobs.parse(kwargs)


def test_fused_kernels_need_cuda(reference):  # noqa: F811
    with pytest.raises(ValueError, match="model_kwargs.fused_kernels needs device: cuda"):
        build_dit(reference[0], fused_kernels=True)


def test_missing_adapter_fails_at_load(reference):  # noqa: F811
    with pytest.raises(ValueError, match=r"model_kwargs.lora\[0\]: .*neither a file nor a folder"):
        build_dit(reference[0], lora=[{"path": "/nonexistent/style.safetensors"}])


def test_klein_9b_is_the_same_class():
    cls = model_class("flux2_klein_9b")
    assert issubclass(cls, Flux2Klein) and cls.key == "flux2_klein_9b"
    assert cls.default_weights == "black-forest-labs/FLUX.2-klein-9B"
    assert model_class("flux2_klein").default_weights == "black-forest-labs/FLUX.2-klein-4B"
