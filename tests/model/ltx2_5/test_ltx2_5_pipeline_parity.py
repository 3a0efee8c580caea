"""The whole text-to-audio+video path against diffusers' ``LTX2Pipeline`` at a tiny size in
float32 on the CPU, given the same prompt hidden states and starting noise: the distilled
8-sigma recipe without guidance (connectors, DiT, Euler steps of both streams), then the video
VAE decode and the audio VAE + 48 kHz vocoder. Latents within 1e-5 relative, frames within one
uint8 level, audio within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

from mstar.model.ltx2_5.audio_vae import LtxAudioVae, LtxAudioVaeConfig
from mstar.model.ltx2_5.config import LtxTransformerConfig
from mstar.model.ltx2_5.connectors import LtxConnectorsConfig, LtxTextConnectors
from mstar.model.ltx2_5.denoise import (
    DISTILLED_SIGMAS,
    LtxSchedule,
    audio_frame_count,
    frame_count,
    normalize_audio,
    sample,
    unpack_video,
)
from mstar.model.ltx2_5.transformer import LtxTransformer
from mstar.model.ltx2_5.video_vae import LtxVideoVae, LtxVideoVaeConfig
from mstar.model.ltx2_5.vocoder import build_vocoder
from tests.support.diffusers_dirs import randomize
from tests.support.ltx2_5_tiny import AUDIO_VAE, SCHEDULER, VAE, VOCODER

DIT = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
           audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=4,
           audio_cross_attention_dim=8, num_layers=2, rope_type="split", gated_attn=True, audio_gated_attn=True,
           cross_attn_mod=True, audio_cross_attn_mod=True, use_prompt_embeddings=False, ff_bias=False,
           audio_ff_bias=False, use_prompt_adaln_single=False, base_height=256, base_width=256)
CONNECTORS = dict(caption_channels=12, text_proj_in_factor=3, video_connector_num_attention_heads=2,
                  video_connector_attention_head_dim=8, video_connector_num_layers=1,
                  video_connector_num_learnable_registers=4, audio_connector_num_attention_heads=2,
                  audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
                  audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=64, rope_type="split",
                  per_modality_projections=True, video_hidden_dim=16, audio_hidden_dim=8, video_gated_attn=True,
                  audio_gated_attn=True)
HEIGHT, WIDTH, FRAMES, FPS = 64, 96, 9, 24.0


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def parts():
    torch.manual_seed(0)
    ref = dict(transformer=LTX2VideoTransformer3DModel(**DIT), connectors=LTX2TextConnectors(**CONNECTORS),
               vae=AutoencoderKLLTX2Video(**VAE), audio_vae=AutoencoderKLLTX2Audio(**AUDIO_VAE),
               vocoder=LTX2VocoderWithBWE(**VOCODER))
    for seed, module in enumerate(ref.values()):
        randomize(module.eval(), seed, spread=0.3, weight_gain=1.2, offsets=("learnable_registers",))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for vae in (ref["vae"], ref["audio_vae"]):
            vae.latents_mean.normal_(generator=gen).mul_(0.3)
            vae.latents_std.uniform_(0.5, 1.5, generator=gen)
        ref["vocoder"].mel_stft.stft_fn.forward_basis.normal_(generator=gen)
        ref["vocoder"].mel_stft.mel_basis.uniform_(0.0, 1.0, generator=gen)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), text_encoder=None, tokenizer=None,
                        **ref)
    ours = dict(
        transformer=LtxTransformer(LtxTransformerConfig.from_dict(dict(ref["transformer"].config))),
        connectors=LtxTextConnectors(LtxConnectorsConfig.from_dict(dict(ref["connectors"].config))),
        vae=LtxVideoVae(LtxVideoVaeConfig.from_dict(dict(ref["vae"].config))),
        audio_vae=LtxAudioVae(LtxAudioVaeConfig.from_dict(dict(ref["audio_vae"].config))),
        vocoder=build_vocoder({"_class_name": "LTX2VocoderWithBWE", **dict(ref["vocoder"].config)}))
    for name, module in ours.items():
        state = {k: v for k, v in ref[name].state_dict().items() if not k.startswith("encoder.")}
        module.eval().load_state_dict(state, strict=True)
    return pipe, ours


def test_distilled_pipeline_parity(parts):
    pipe, ours = parts
    gen = torch.Generator().manual_seed(3)
    grid = (frame_count(FRAMES), HEIGHT // 32, WIDTH // 32)
    audio_frames = audio_frame_count(FRAMES, FPS)
    states = torch.randn(1, 8, 12 * 3, generator=gen)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    video_noise = torch.randn(1, grid[0] * grid[1] * grid[2], 8, generator=gen)
    audio_noise = torch.randn(1, 4, audio_frames, 2, generator=gen)

    def run(output_type: str):
        return pipe(prompt_embeds=states, prompt_attention_mask=mask, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                    frame_rate=FPS, num_inference_steps=len(DISTILLED_SIGMAS), sigmas=list(DISTILLED_SIGMAS),
                    guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=1.0,
                    audio_stg_scale=0.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                    latents=video_noise.clone(), audio_latents=audio_noise.transpose(1, 2).flatten(2).clone(),
                    generator=torch.Generator().manual_seed(0), output_type=output_type, return_dict=False)

    with torch.no_grad():
        want_video, want_audio = run("latent")
        want_frames, want_wave = run("np")
        text, audio_text, text_mask = ours["connectors"](states, mask)
        schedule = LtxSchedule.from_config(dict(pipe.scheduler.config))
        sigmas = schedule.sigmas(video_noise.shape[1])
        audio_start = normalize_audio(audio_noise, ours["audio_vae"].latents_mean, ours["audio_vae"].latents_std)
        video, audio = sample(ours["transformer"], video_noise, audio_start, text, audio_text, text_mask, grid, FPS,
                              sigmas)
        latents = ours["vae"].denormalize(unpack_video(video, grid))
        frames = ours["vae"].decoder(latents)
        wave = ours["vocoder"](ours["audio_vae"].decode(audio))

    err_video = rel(latents, want_video)
    err_audio = rel(ours["audio_vae"].unpack(audio), want_audio)
    ours_u8 = np.round(((frames / 2 + 0.5).clamp(0, 1) * 255).permute(0, 2, 3, 4, 1).numpy())
    want_u8 = np.round(np.asarray(want_frames) * 255)
    levels = np.abs(ours_u8 - want_u8).max()
    err_wave = (wave - want_wave).abs().max().item()
    print(f"[parity] pipeline: video latents {err_video:.2e}, audio latents {err_audio:.2e}, "
          f"frames {levels:.0f} uint8 levels, waveform max abs {err_wave:.2e} ({wave.shape[-1]} samples)")
    assert sigmas[-2] == pytest.approx(0.1)  # shift_terminal took effect
    assert err_video <= 1e-5 and err_audio <= 1e-5
    assert levels <= 1
    assert want_wave.shape == wave.shape and err_wave <= 1e-4


def test_recipe_constants_follow_diffusers():
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES, STAGE_2_DISTILLED_SIGMA_VALUES

    from mstar.model.ltx2_5.denoise import STAGE_2_SIGMAS

    assert list(DISTILLED_SIGMAS) == DISTILLED_SIGMA_VALUES
    assert list(STAGE_2_SIGMAS) == STAGE_2_DISTILLED_SIGMA_VALUES
    assert audio_frame_count(121, 24.0) == round(121 / 24.0 * 25) and frame_count(121) == 16
