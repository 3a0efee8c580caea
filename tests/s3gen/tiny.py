"""The tiny S3Gen the fixtures of ``record_reference.py`` were recorded with, as our config."""

from __future__ import annotations

from pathlib import Path

import torch

from mstar.model.flow import EstimatorConfig, FlowFrontConfig
from mstar.model.s3gen import EncoderConfig, S3Gen, S3GenConfig, load_s3gen
from mstar.model.vocoder import HiFTConfig

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> dict:
    return torch.load(FIXTURES / f"{name}.pt")


def encoder_config(ref: dict) -> EncoderConfig:
    return EncoderConfig(width=ref["output_size"], heads=ref["attention_heads"], ffn_width=ref["linear_units"],
                         blocks=ref["num_blocks"])


def s3gen_config(ref: dict) -> S3GenConfig:
    """Our config for the reference's tiny ``S3Token2Wav`` (``token2wav.pt``'s ``config``)."""
    enc, est, hift = ref["encoder"], ref["estimator"], ref["hift"]
    width = enc["output_size"]
    return S3GenConfig(
        front=FlowFrontConfig(vocab_size=ref["vocab"], token_dim=width, encoder_dim=width, speaker_dim=ref["speaker"]),
        encoder=encoder_config(enc),
        estimator=EstimatorConfig(channels=tuple(est["channels"]), num_heads=est["num_heads"],
                                  head_dim=est["attention_head_dim"], blocks_per_level=est["n_blocks"],
                                  mid_levels=est["num_mid_blocks"], meanflow=ref.get("meanflow", False)),
        vocoder=HiFTConfig(base_channels=hift["base_channels"], f0_cond_channels=ref["f0_channels"],
                           upsample_rates=tuple(hift["upsample_rates"]),
                           upsample_kernel_sizes=tuple(hift["upsample_kernel_sizes"]), per_sample_source=True),
        n_cfm_timesteps=2 if ref.get("meanflow") else 10,
    )


def tiny_s3gen(record: dict) -> S3Gen:
    """Ours, loaded (strictly, both ways) from the reference's state dict in the released layout."""
    model = S3Gen(s3gen_config(record["config"] | {"meanflow": record["meanflow"]})).eval()
    load_s3gen(model, record["state"].items())
    return model
