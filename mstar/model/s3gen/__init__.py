"""Chatterbox's S3Gen: speech tokens and a voice prompt -> 24 kHz audio (``docs/s3gen.md``)."""

from mstar.model.s3gen.encoder import EncoderConfig, UpsampleConformerEncoder, relative_positions
from mstar.model.s3gen.meanflow import solve_meanflow
from mstar.model.s3gen.mel import MelConfig, log_mel, mel_filterbank
from mstar.model.s3gen.token2wav import S3Gen, S3GenConfig, S3GenPrompt, fade_in
from mstar.model.s3gen.weights import (
    FRONT_END_PREFIXES,
    S3GEN_FILES,
    load_s3gen,
    read_s3gen,
    s3gen_name_map,
    s3gen_tensors,
)

__all__ = [
    "FRONT_END_PREFIXES",
    "S3GEN_FILES",
    "EncoderConfig",
    "MelConfig",
    "S3Gen",
    "S3GenConfig",
    "S3GenPrompt",
    "UpsampleConformerEncoder",
    "fade_in",
    "load_s3gen",
    "log_mel",
    "read_s3gen",
    "mel_filterbank",
    "relative_positions",
    "s3gen_name_map",
    "s3gen_tensors",
    "solve_meanflow",
]
