"""BAGEL's image generation over our paged KV cache against bagel2 0.0.6's ``InterleaveInferencer``
(its contexts, ``gen_image`` and ``generate_image``), on a tiny random model in float32 on the
CPU: text to image with and without CFG, and an edit (the input image in the context as VAE
latents and as ViT tokens), each for a fixed seed; the generated latent tokens within 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch

from mstar.model.bagel.checkpoint import load_parts
from mstar.model.bagel.config import BagelConfig
from mstar.model.bagel.flow import (
    ImageContexts,
    KVContext,
    extend,
    generate_latents,
    image_segment,
    latent_segment,
    text_segment,
)
from mstar.model.bagel.generation import (
    CfgOptions,
    LatentProjections,
    latent_grid,
    latent_position_ids,
    patchify_latent,
)
from mstar.model.bagel.llm import BagelLanguageModel
from mstar.model.bagel.prompt import SpecialTokens
from mstar.model.bagel.vae import encode, flux1_vae_config, from_original_layout
from mstar.model.bagel.vision import BagelVision
from mstar.model.weights import load_weights
from mstar.model.z_image.vae import ZImageVAE
from tests.support import bagel_reference as br

TOL = 1e-5
PAGE = 16
TOKENS = SpecialTokens(br.TOKENS["bos_token_id"], br.TOKENS["eos_token_id"], br.TOKENS["start_of_image"],
                       br.TOKENS["end_of_image"])
PROMPT = [5, 17, 33, 2, 64, 8, 41]
AE = dict(resolution=32, in_channels=3, downsample=8, ch=32, out_ch=3, ch_mult=[1, 1, 1, 1], num_res_blocks=1,
          z_channels=br.VAE.z_channels, scale_factor=0.3611, shift_factor=0.1159)


def check(name: str, ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= TOL, f"{name}: relative error {err:.3e} > {TOL}"


class Ours:
    """Our modules with the reference's weights (``load_parts``: coverage both ways over the
    whole reference model), a paged KV cache and a page allocator."""

    def __init__(self, ref, ref_vae) -> None:
        vit = dict(br.VIT, num_hidden_layers=br.VIT["num_hidden_layers"] + 1)  # the file counts one more
        config = BagelConfig.from_dicts(br.LLM, vit, {"vit_max_num_patch_per_side": 8, "max_latent_size": 8})
        self.llm = BagelLanguageModel(config.llm).eval()
        self.vision = BagelVision(config).eval()
        self.proj = LatentProjections(config.llm.hidden_size, br.VAE.z_channels, config.latent_patch_size,
                                      config.max_latent_size).eval()
        load_parts({"llm": self.llm, "vision": self.vision, "generation": self.proj}, ref.state_dict().items())
        self.vae = ZImageVAE(flux1_vae_config(ch=AE["ch"], ch_mult=tuple(AE["ch_mult"]), num_res_blocks=1,
                                              z_channels=AE["z_channels"])).eval()
        load_weights(self.vae, from_original_layout(ref_vae.state_dict().items(), levels=len(AE["ch_mult"])))
        layers, heads, dim = self.llm.cache_shape()
        self.kv = [torch.zeros(2, 32, PAGE, heads, dim) for _ in range(layers)]
        self.free = list(range(31, -1, -1))

    def vit_embeds(self, image: torch.Tensor) -> torch.Tensor:
        """The image's ViT tokens as LLM inputs (tower, connector, position table)."""
        patches, positions = self.vision.image_tokens(image)
        with torch.no_grad():
            return self.vision(patches, positions, [len(positions)])

    def context(self, pages: int = 8) -> KVContext:
        return KVContext([self.free.pop() for _ in range(pages)])

    def extend(self, rows) -> None:
        extend(self.llm, self.kv, PAGE, rows)


@pytest.fixture(scope="module")
def models():
    ref = br.reference_bagel(seed=4)
    from bagel2.modeling.autoencoder import AutoEncoder, AutoEncoderParams

    torch.manual_seed(5)
    ref_vae = AutoEncoder(AutoEncoderParams(**AE)).eval()
    br.randomize(ref_vae, 5)
    return ref, ref_vae, Ours(ref, ref_vae)


def reference_inferencer(ref, ref_vae):
    from bagel2.inferencer import InterleaveInferencer

    inf = InterleaveInferencer(model=ref, vae_model=ref_vae, tokenizer=br.IdTokenizer(), vae_transform=lambda x: x,
                               vit_transform=lambda x: x, new_token_ids=br.TOKENS)
    inf.decode_image = lambda latent, shape: latent  # the latent tokens, not the decoded picture
    return inf


def reference_generate(ref, ref_vae, image, shape, seed, **options) -> torch.Tensor:
    """``interleave_inference``'s context building for ``[image?, PROMPT]`` and its ``gen_image``."""
    inf = reference_inferencer(ref, ref_vae)
    gen = inf.init_gen_context()
    cfg_img = inf.init_gen_context()
    with torch.no_grad():
        cfg_text = inf.init_gen_context()
        if image is not None:
            torch.manual_seed(seed + 1)  # the VAE encoder samples its posterior
            gen = inf.update_context_image(image, gen)
            cfg_text = copy.deepcopy(gen)
        gen = inf.update_context_text(PROMPT, gen)
        cfg_img = inf.update_context_text(PROMPT, cfg_img)
        torch.manual_seed(seed)
        return inf.gen_image(shape, gen, cfg_text_precontext=cfg_text, cfg_img_precontext=cfg_img, **options)


def ours_generate(ours: Ours, image, shape, seed, cfg: CfgOptions | None, steps: int, shift: float) -> torch.Tensor:
    full, no_text, no_image = ours.context(), ours.context(), ours.context()
    if image is not None:
        h, w = latent_grid(*image.shape[1:])
        torch.manual_seed(seed + 1)
        noise = torch.randn(1, br.VAE.z_channels, 2 * h, 2 * w)
        with torch.no_grad():
            latent = patchify_latent(encode(ours.vae, image[None], noise)[0], h, w)
        pos = latent_position_ids(h, w, ours.proj.latent_pos_embed.max_latent_size)
        vae_seg = latent_segment(ours.llm, ours.proj, latent, 0.0, pos, TOKENS)
        ours.extend([(full, vae_seg), (no_text, vae_seg)])
        vit_seg = image_segment(ours.llm, ours.vit_embeds(image), TOKENS, generation=False)
        ours.extend([(full, vit_seg), (no_text, vit_seg)])
    text = text_segment(ours.llm, PROMPT, TOKENS)
    ours.extend([(full, text)] + ([(no_image, text)] if image is not None else []))
    contexts = ImageContexts(full, no_text, no_image if image is not None else None)
    h, w = latent_grid(*shape)
    torch.manual_seed(seed)
    noise = torch.randn(h * w, 4 * br.VAE.z_channels)
    pos = latent_position_ids(h, w, ours.proj.latent_pos_embed.max_latent_size)
    out = generate_latents(ours.llm, ours.proj, ours.kv, PAGE, contexts, noise, pos, TOKENS, steps, shift, cfg)
    for ctx in (full, no_text, no_image):
        ours.free.extend(ctx.pages)
    return out


CFG = dict(cfg_text_scale=4.0, cfg_img_scale=1.5, cfg_interval=(0.4, 1.0), cfg_renorm_type="global",
           cfg_renorm_min=0.0)
NO_CFG = dict(CFG, cfg_text_scale=1.0, cfg_img_scale=1.0)


def as_cfg(options: dict) -> CfgOptions:
    return CfgOptions(text_scale=options["cfg_text_scale"], img_scale=options["cfg_img_scale"],
                      interval=tuple(options["cfg_interval"]), renorm_type=options["cfg_renorm_type"],
                      renorm_min=options["cfg_renorm_min"])


@pytest.mark.parametrize(("name", "options"), [
    ("no cfg", NO_CFG), ("cfg", CFG),
    ("cfg text only, channel", dict(CFG, cfg_img_scale=1.0, cfg_renorm_type="channel")),
])
def test_text_to_image(models, name, options):
    ref, ref_vae, ours = models
    shape = (48, 32)
    want = reference_generate(ref, ref_vae, None, shape, seed=11, num_timesteps=6, timestep_shift=3.0, **options)
    got = ours_generate(ours, None, shape, seed=11, cfg=as_cfg(options), steps=6, shift=3.0)
    check(f"t2i latents ({name})", got, want)


@pytest.mark.parametrize(("name", "options"), [
    ("cfg", dict(CFG, cfg_img_scale=2.0)),
    ("cfg text_channel", dict(CFG, cfg_img_scale=2.0, cfg_renorm_type="text_channel", cfg_renorm_min=0.2)),
    ("no cfg", NO_CFG),
])
def test_edit(models, name, options):
    ref, ref_vae, ours = models
    image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    want = reference_generate(ref, ref_vae, image, (32, 32), seed=21, num_timesteps=5, timestep_shift=3.0, **options)
    got = ours_generate(ours, image, (32, 32), seed=21, cfg=as_cfg(options), steps=5, shift=3.0)
    check(f"edit latents ({name})", got, want)


# ---------------------------------------------------------------------------- the engine


def engine_item(rid: str, op: str, iteration: int, inputs: dict, params: dict):
    from mstar.engine.base import EngineItem

    return EngineItem(rid, op, iteration, inputs, params)


def image_params(shape, steps, options) -> dict:
    return {"height": shape[0], "width": shape[1], "num_timesteps": steps, "timestep_shift": 3.0, **options}


def test_engine_batches_requests_as_solo(models):
    """A text-to-image and an edit request in one engine, their contexts built in one run and
    their steps batched (the edit one step behind): each equals the reference's own loop."""
    from mstar.model.bagel.image_engine import BagelImageEngine

    ref, ref_vae, ours = models
    engine = BagelImageEngine(ours.llm, ours.proj, ours.vae, TOKENS, num_pages=40, page_size=PAGE,
                              device=torch.device("cpu"), dtype=torch.float32)
    image = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    t2i_opts, edit_opts = CFG, dict(CFG, cfg_img_scale=2.0, cfg_renorm_type="channel")
    want_t2i = reference_generate(ref, ref_vae, None, (48, 32), seed=11, num_timesteps=6, timestep_shift=3.0,
                                  **t2i_opts)
    want_edit = reference_generate(ref, ref_vae, image, (32, 32), seed=21, num_timesteps=6, timestep_shift=3.0,
                                   **edit_opts)

    torch.manual_seed(11)
    a = {"prompt_ids": torch.tensor(PROMPT), "latents": torch.randn(6, 4 * br.VAE.z_channels)}
    torch.manual_seed(22)
    image_noise = torch.randn(br.VAE.z_channels, 4, 4)
    torch.manual_seed(21)
    b = {"prompt_ids": torch.tensor(PROMPT), "latents": torch.randn(4, 4 * br.VAE.z_channels), "image": image,
         "image_noise": image_noise, "vision_embeds": ours.vit_embeds(image)}
    pa, pb = image_params((48, 32), 6, t2i_opts), image_params((32, 32), 6, edit_opts)
    out = engine.run([engine_item("a", "context", 0, a, pa), engine_item("b", "context", 0, b, pb)])
    xa, xb = (o.outputs["latents"] for o in out)  # both contexts built together: text and image rows mixed
    xa = engine.run([engine_item("a", "step", 0, {"latents": xa}, pa)])[0].outputs["latents"]
    for i in range(5):
        items = [engine_item("b", "step", i, {"latents": xb}, pb)]
        if i + 1 < 5:
            items.insert(0, engine_item("a", "step", i + 1, {"latents": xa}, pa))
        outs = engine.run(items)
        xb = outs[-1].outputs["latents"]
        if i + 1 < 5:
            xa = outs[0].outputs["latents"]
    check("engine t2i", xa, want_t2i)
    check("engine edit", xb, want_edit)  # its posterior noise drawn as the reference's VAE draws it
    used = engine.pool.num_used_pages
    engine.release("a")
    engine.release("b")
    assert used > 0 and engine.pool.num_used_pages == 0


def test_engine_preempts_a_context_the_pool_cannot_hold_yet(models):
    from mstar.model.bagel.image_engine import BagelImageEngine

    _, _, ours = models
    engine = BagelImageEngine(ours.llm, ours.proj, ours.vae, TOKENS, num_pages=3, page_size=PAGE,
                              device=torch.device("cpu"), dtype=torch.float32)
    params = image_params((48, 32), 4, CFG)
    inputs = {"prompt_ids": torch.tensor(PROMPT), "latents": torch.zeros(6, 4 * br.VAE.z_channels)}
    assert not engine.run([engine_item("a", "context", 0, inputs, params)])[0].preempted
    assert engine.run([engine_item("b", "context", 0, inputs, params)])[0].preempted
    engine.release("a")
    assert not engine.run([engine_item("b", "context", 0, inputs, params)])[0].preempted
    with pytest.raises(ValueError, match="need 5 KV pages, the generator has 3"):
        engine.run([engine_item("c", "context", 0, {**inputs, "prompt_ids": torch.arange(40)}, params)])
