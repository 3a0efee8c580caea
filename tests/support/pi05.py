"""A tiny transformers ``PI05ForConditionalGeneration`` (5.25) with every weight random, and its
state dict renamed to the released lerobot key layout: what the Pi0.5 tests compare against."""

from __future__ import annotations

import torch

TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16}
EXPERT = {"hidden_size": 24, "num_hidden_layers": 2, "intermediate_size": 48, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 16}
VISION = {"hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 16, "patch_size": 4}
VOCAB = 96
IMAGE_TOKEN = 95
CHUNK, ACTION_DIM, STEPS = 5, 6, 3


def reference_model(seed: int = 0):
    from transformers import PI05Config, PI05ForConditionalGeneration

    config = PI05Config(
        vlm_config={"model_type": "paligemma", "image_token_id": IMAGE_TOKEN, "projection_dim": TEXT["hidden_size"],
                    "text_config": {"model_type": "gemma", "vocab_size": VOCAB, **TEXT},
                    "vision_config": {"model_type": "siglip_vision_model", "vision_use_head": False, **VISION}},
        dit_config={"model_type": "gemma", **EXPERT},
        chunk_size=CHUNK, max_action_dim=ACTION_DIM, num_inference_steps=STEPS)
    torch.manual_seed(seed)
    model = PI05ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the init zeroes the adaptive norms and Gemma's norm weights: randomise all
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=generator) * 0.1
            if "vision_tower" in name and "norm" in name and name.endswith("weight"):
                values += 1.0
            param.copy_(values)
    return model


def lerobot_name(name: str) -> str | None:
    """A transformers PI05 parameter name in the released lerobot layout."""
    renames = (
        ("model.vlm.vision_tower.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
        ("model.vlm.multi_modal_projector.", "paligemma_with_expert.paligemma.model.multi_modal_projector."),
        ("model.vlm.language_model.", "paligemma_with_expert.paligemma.model.language_model."),
        ("model.dit.", "paligemma_with_expert.gemma_expert.model."),
        ("embed_action_time.", ""),
        ("action_out_proj.", "action_out_proj."),
    )
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return None


def lerobot_state_dict(model) -> dict[str, torch.Tensor]:
    """The reference's weights as the released checkpoint stores them: the language model's
    embedding as ``paligemma.lm_head`` (tied), the expert's unused ``lm_head`` included."""
    out = {}
    for name, tensor in model.state_dict().items():
        new = lerobot_name(name)
        if new is None:
            continue
        if new.endswith("language_model.embed_tokens.weight"):
            new = "paligemma_with_expert.paligemma.lm_head.weight"
        out[new] = tensor.clone().contiguous()
    out["paligemma_with_expert.gemma_expert.lm_head.weight"] = torch.randn(VOCAB, EXPERT["hidden_size"])
    return out


def tiny_lerobot_config() -> dict:
    """A lerobot ``config.json`` for the tiny model (sizes spelt out under ``dims``)."""
    return {
        "type": "pi05", "chunk_size": CHUNK, "n_action_steps": CHUNK, "max_state_dim": ACTION_DIM,
        "max_action_dim": ACTION_DIM, "num_inference_steps": STEPS, "image_resolution": [16, 16],
        "tokenizer_max_length": 96,
        "input_features": {
            "observation.images.base_0_rgb": {"type": "VISUAL", "shape": [3, 16, 16]},
            "observation.images.left_wrist_0_rgb": {"type": "VISUAL", "shape": [3, 16, 16]},
            "observation.state": {"type": "STATE", "shape": [4]},
        },
        "output_features": {"action": {"type": "ACTION", "shape": [5]}},
        "dims": {"vocab_size": VOCAB, "vision": {**_vision_dims()}, "text": _gemma(TEXT), "expert": _gemma(EXPERT)},
    }


def _gemma(d: dict) -> dict:
    return {"hidden_size": d["hidden_size"], "intermediate_size": d["intermediate_size"],
            "num_layers": d["num_hidden_layers"], "num_heads": d["num_attention_heads"],
            "num_kv_heads": d["num_key_value_heads"], "head_dim": d["head_dim"]}


def _vision_dims() -> dict:
    return {"hidden_size": VISION["hidden_size"], "intermediate_size": VISION["intermediate_size"],
            "num_layers": VISION["num_hidden_layers"], "num_heads": VISION["num_attention_heads"],
            "patch_size": VISION["patch_size"]}


STATE_STATS = {"q01": [-1.0, -2.0, 0.0, 0.5], "q99": [1.0, 2.0, 4.0, 0.5], "mean": [0.0, 0.1, 2.0, 0.5],
               "std": [0.5, 1.0, 1.0, 0.1]}
ACTION_STATS = {"q01": [-1.0, 0.0, -3.0, 10.0, -0.5], "q99": [1.0, 2.0, 3.0, 20.0, 0.5],
                "mean": [0.0, 1.0, 0.0, 15.0, 0.0], "std": [1.0, 0.5, 2.0, 3.0, 0.25]}
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?-_\n'"


def write_tokenizer(directory) -> None:
    """A character-level tokenizer (ids below the image token) that prepends ``<bos>``, saved
    as ``tokenizer.json``: a stand-in for PaliGemma's, which is not on this machine."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(directory)


def write_checkpoint(directory, model=None, *, prefix: str = "") -> None:
    """A lerobot Pi0.5 policy directory for the tiny model: config, weights of ``model`` (a
    reference from ``reference_model``; none: no weights, for ``load_format: dummy``) in the
    released key layout (every key behind ``prefix``), the processor pipelines with their
    statistics, and the tokenizer."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_lerobot_config()))
    if model is not None:
        save_file({prefix + k: v for k, v in lerobot_state_dict(model).items()}, str(directory / "model.safetensors"))
    write_stats(directory, STATE_STATS, ACTION_STATS, "QUANTILES")
    write_tokenizer(directory)


def write_stats(directory, state_stats: dict, action_stats: dict, mode: str) -> None:
    """lerobot's processor pipelines with their normaliser steps' statistics files (an
    embodiment): the state and action statistics, both normalised by ``mode``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {f"observation.state.{k}": torch.tensor(v) for k, v in state_stats.items()}
    action = {f"action.{k}": torch.tensor(v) for k, v in action_stats.items()}
    save_file({**state, **action}, str(directory / "policy_preprocessor_step_2_normalizer_processor.safetensors"))
    save_file(action, str(directory / "policy_postprocessor_step_0_unnormalizer_processor.safetensors"))
    norm_map = {"VISUAL": "IDENTITY", "STATE": mode, "ACTION": mode}
    pre = {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "normalizer_processor", "config": {"eps": 1e-8, "norm_map": norm_map, "features": {}},
         "state_file": "policy_preprocessor_step_2_normalizer_processor.safetensors"}]}
    post = {"name": "policy_postprocessor", "steps": [
        {"registry_name": "unnormalizer_processor", "config": {"eps": 1e-8, "norm_map": norm_map, "features": {}},
         "state_file": "policy_postprocessor_step_0_unnormalizer_processor.safetensors"}]}
    (directory / "policy_preprocessor.json").write_text(json.dumps(pre))
    (directory / "policy_postprocessor.json").write_text(json.dumps(post))
