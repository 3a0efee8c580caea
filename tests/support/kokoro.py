"""A tiny Kokoro for tests: the reference ``kokoro.KModel`` (kokoro==0.9.4) built from a config
dict with random weights, and the same weights written in the released layout
(``kokoro-v1_0.pth``: ``{module: state dict}`` with ``module.``-prefixed keys, weight norm as
``weight_g``/``weight_v``; ``config.json``; ``voices/*.pt``), optionally in a hub-cache-like
directory. The reference's fixed widths (a 512-wide hidden dim, 128-wide styles, the 1024-
channel decoder trunk) stay; everything else is small.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = {p: i + 1 for i, p in enumerate(" .,!?abdefhiklmnoprstuvwzæðŋɑɔəɛɪʃʊʌʒˈˌː")}
TINY_CONFIG = {
    "vocab": VOCAB,
    "n_token": len(VOCAB) + 2,
    "hidden_dim": 512,
    "style_dim": 128,
    "n_layer": 1,
    "max_dur": 8,
    "dropout": 0.2,
    "text_encoder_kernel_size": 3,
    "n_mels": 80,
    "dim_in": 64,  # present in the released config.json, read by nothing
    "multispeaker": True,
    "plbert": {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64,
               "max_position_embeddings": 64, "num_hidden_layers": 2, "dropout": 0.1},
    "istftnet": {"upsample_kernel_sizes": [4, 4], "upsample_rates": [2, 2], "gen_istft_hop_size": 2,
                 "gen_istft_n_fft": 8, "resblock_dilation_sizes": [[1, 3, 5]], "resblock_kernel_sizes": [3],
                 "upsample_initial_channel": 512},
}
MODULES = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
VOICE_LEN = 40  # rows of a test voice table (the released ones have 510)


def reference_model(tmp: Path, config: dict | None = None, seed: int = 0):
    """``kokoro.KModel`` of ``config`` with seeded random weights, every parameter moved off its
    init (instance-norm affines, Snake alphas), in eval mode."""
    from kokoro import KModel

    empty = tmp / "empty.pth"
    torch.save({}, empty)  # KModel loads nothing from it: the random init stays
    torch.manual_seed(seed)
    model = KModel(repo_id="hexgrad/Kokoro-82M", config=dict(config or TINY_CONFIG), model=str(empty))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.02 if name.startswith("bert.") else 0.05
            if "duration_proj" in name:
                scale = 0.5  # spread the durations over 1..max_dur instead of all max_dur / 2
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def released_state(model, prefix: str = "module.") -> dict[str, dict[str, torch.Tensor]]:
    """``model``'s weights as the released ``.pth`` holds them."""
    return {key: {prefix + k: v.clone() for k, v in getattr(model, key).state_dict().items()} for key in MODULES}


def voice_table(seed: int, length: int = VOICE_LEN, width: int = 256) -> torch.Tensor:
    return torch.randn(length, 1, width, generator=torch.Generator().manual_seed(seed)) * 0.5


def write_checkpoint(directory: Path, model, config: dict | None = None, voices: tuple[str, ...] = ()) -> Path:
    """The released layout under ``directory``: config.json, kokoro-v1_0.pth, voices/<name>.pt."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or TINY_CONFIG, ensure_ascii=False))
    torch.save(released_state(model), directory / "kokoro-v1_0.pth")
    (directory / "voices").mkdir(exist_ok=True)
    for i, name in enumerate(voices):
        torch.save(voice_table(100 + i), directory / "voices" / f"{name}.pt")
    return directory


def hub_snapshot(cache: Path, repo: str = "hexgrad/Kokoro-82M") -> Path:
    """An empty snapshot of ``repo`` in a hub cache rooted at ``cache`` (refs/main names it)."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snapshot = root / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text("c" * 40)
    return snapshot
