"""FLUX.2 [klein] through the in-process runtime (text encoder node, denoise Loop, VAE node)
on a tiny random checkpoint laid out like the diffusers repository, against diffusers'
Flux2KleinPipeline with the same weights, prompt, seed and steps."""

import asyncio
import io
import json
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from test_qwen3_encoder import make_qwen_tokenizer

from mstar.config import parse_config
from mstar.contract import ImageSpec, RequestError
from mstar.runtime.launch import start

VAE = {"block_out_channels": (8, 16), "down_block_types": ("DownEncoderBlock2D",) * 2,
       "up_block_types": ("UpDecoderBlock2D",) * 2, "layers_per_block": 1, "latent_channels": 4,
       "norm_num_groups": 4}
DIT = {"in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
       "num_attention_heads": 2, "joint_attention_dim": 48, "timestep_guidance_channels": 32,
       "axes_dims_rope": (4, 4, 4, 4), "guidance_embeds": False}
QWEN = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 28, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}


def randomize(module, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.2 if p.dim() > 1 else 0.05
            gain = 1.0 if "norm" in name and p.dim() == 1 else 0.0
            p.copy_(torch.randn(p.shape, generator=generator) * scale + gain)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny diffusers-layout checkpoint written from diffusers/transformers modules."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("klein")
    tok = make_qwen_tokenizer()
    tok.save_pretrained(root / "tokenizer")
    vae = AutoencoderKLFlux2(**VAE).eval()
    dit = Flux2Transformer2DModel(**DIT).eval()
    text = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), **QWEN)).eval()
    for i, module in enumerate((vae, dit, text)):
        randomize(module, i)
    with torch.no_grad():
        vae.bn.running_var.uniform_(0.5, 2.0)
    for folder, module in (("vae", vae), ("transformer", dit)):
        (root / folder).mkdir()
        (root / folder / "config.json").write_text(json.dumps(dict(module.config), default=list))
        save_file({k: v.contiguous() for k, v in module.state_dict().items()},
                  root / folder / "diffusion_pytorch_model.safetensors")
    text.save_pretrained(root / "text_encoder")
    return root, vae, dit, text, tok


@pytest.fixture(scope="module")
def deployment(reference):
    root = reference[0]
    d = start(parse_config({"model": "flux2_klein", "model_path": str(root), "max_concurrent_requests": 4,
                            "model_kwargs": {"max_image_area": 128 * 128}}), in_process=True)
    yield d
    d.close()


def generate(d, spec):
    return asyncio.run(d.backend.generate_images(spec))


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


def test_runtime_matches_diffusers_pipeline(reference, deployment):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline

    root, vae, dit, text, tok = reference
    prompt, seed, steps, height, width = "a cat", 7, 3, 32, 48
    [png] = generate(deployment, ImageSpec("k-1", prompt, width, height, 1, seed, steps))
    ours = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)

    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    pipe = Flux2KleinPipeline(scheduler, vae, text, tok, dit, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=1.0,
                generator=torch.Generator().manual_seed(seed), output_type="np").images[0]
    want = np.round(want * 255).astype(np.int16)
    assert ours.shape == want.shape == (height, width, 3)
    assert np.abs(ours - want).max() <= 1  # uint8 rounding of the same image


def test_concurrent_sizes_and_seeds(deployment):
    async def go():
        specs = [ImageSpec(f"c-{i}", "a dog", 32 + 16 * (i % 2), 32, 1, i, 2) for i in range(4)]
        return await asyncio.gather(*[deployment.backend.generate_images(s) for s in specs])

    results = asyncio.run(go())
    [alone] = generate(deployment, ImageSpec("c-alone", "a dog", 48, 32, 1, 1, 2))
    # batching does not change a request's image: the same maths, though a batched fp32 GEMM
    # may round a pixel one level the other way (so the PNG bytes may differ)
    assert np.abs(pixels(results[1][0]) - pixels(alone)).max() <= 1
    sizes = [Image.open(io.BytesIO(r[0])).size for r in results]
    assert sizes == [(32, 32), (48, 32), (32, 32), (48, 32)]
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    assert not dit.schedules  # per-request state released


def test_four_requests_of_one_size_share_denoise_forwards(deployment):
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    specs = [ImageSpec(f"s-{i}", f"a dog number {i}", 32, 32, 1, 10 + i, 3) for i in range(4)]

    async def go():
        return await asyncio.gather(*[deployment.backend.generate_images(s) for s in specs])

    dit.forward_rows.clear()
    together = asyncio.run(go())
    shared = list(dit.forward_rows)
    assert sum(shared) == 4 * 3 and max(shared) > 1, shared  # 12 rows in fewer than 12 forwards

    for spec, [png] in zip(specs, together):
        [alone] = generate(deployment, ImageSpec(spec.request_id + "-alone", spec.prompt, 32, 32, 1, spec.seed, 3))
        # the same maths; a batched fp32 GEMM may round one pixel one level the other way
        assert np.abs(pixels(png) - pixels(alone)).max() <= 1


@pytest.mark.parametrize("spec, field", [
    (ImageSpec("e-1", " "), "prompt"),
    (ImageSpec("e-2", "x", 42, 32), "size"),  # not a multiple of 2 x the VAE scale (4 here)
    (ImageSpec("e-3", "x", 256, 256), "size"),
    (ImageSpec("e-4", "x", 32, 32, num_inference_steps=0), "num_inference_steps"),
    (ImageSpec("e-5", "x", 32, 32, guidance_scale=4.0), "guidance_scale"),
])
def test_bad_requests_name_the_field(deployment, spec, field):
    with pytest.raises(RequestError) as err:
        generate(deployment, spec)
    assert err.value.field == field


def _with_latents(deployment, monkeypatch, replace):
    """Requests of ``deployment`` whose latents Future is ``replace(future)`` instead."""
    prepare = deployment.spec.prepare_image

    def patched(spec, index=0):
        request = prepare(spec, index)
        request.inputs["latents"] = replace(request.inputs["latents"])
        return request

    monkeypatch.setattr(deployment.spec, "prepare_image", patched)


def test_latents_that_arrive_late_give_the_same_image(deployment, monkeypatch):
    """The noise is drawn on a background thread; a request whose latents come long after
    its text features waits for them on the DiT's worker and makes the same image."""
    from concurrent.futures import Future

    [prompt_first] = generate(deployment, ImageSpec("late-0", "a dog", 32, 32, 1, 5, 2))

    def late(drawn):
        future = Future()
        threading.Timer(0.3, lambda: future.set_result(drawn.result())).start()
        return future

    _with_latents(deployment, monkeypatch, late)
    [delayed] = generate(deployment, ImageSpec("late-1", "a dog", 32, 32, 1, 5, 2))
    assert np.array_equal(pixels(delayed), pixels(prompt_first))


def test_latents_that_fail_end_the_request_with_an_error(deployment, monkeypatch):
    from concurrent.futures import Future

    from mstar.contract import ServiceError

    def failing(drawn):
        drawn.result()
        future = Future()
        threading.Timer(0.1, lambda: future.set_exception(RuntimeError("no entropy today"))).start()
        return future

    _with_latents(deployment, monkeypatch, failing)
    with pytest.raises(ServiceError) as err:
        generate(deployment, ImageSpec("fail-1", "a dog", 32, 32, 1, 5, 2))
    assert "latents" in str(err.value) and "no entropy today" in str(err.value), str(err.value)
    monkeypatch.undo()
    [png] = generate(deployment, ImageSpec("fail-2", "a dog", 32, 32, 1, 5, 2))  # the worker is not stuck
    assert png.startswith(b"\x89PNG")
    dit = deployment.runtime.workers.workers[0].engines["dit"]
    assert not dit.schedules


def test_requests_that_end_in_the_queue_leave_nothing_on_the_workers(reference):
    """A request cancelled (or timed out) before admission had its inputs sent to the workers
    at submit: they are released there too."""
    root = reference[0]
    d = start(parse_config({"model": "flux2_klein", "model_path": str(root), "max_concurrent_requests": 1,
                            "model_kwargs": {"max_image_area": 128 * 128}}), in_process=True)
    try:
        async def go():
            tasks = [asyncio.ensure_future(d.backend.generate_images(ImageSpec(f"q-{i}", "a dog", 32, 32, 1, i, 4)))
                     for i in range(5)]  # one running, four queued (the most the gate lets wait)
            while len(d.runtime.conductor.waiting) < 3:  # submitted, queued behind the one admitted
                await asyncio.sleep(0.001)
            for task in tasks[-2:]:
                task.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(go())
        assert all(isinstance(r, list) for r in results[:3]), results
        assert all(isinstance(r, asyncio.CancelledError) for r in results[3:])
        worker = d.runtime.workers.workers[0]
        deadline = time.monotonic() + 10
        while len(worker.store) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(worker.store) == 0, sorted(worker.store._values)
    finally:
        d.close()
