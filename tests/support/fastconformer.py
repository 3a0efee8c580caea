"""Tiny FastConformer transducer checkpoints in transformers' layout, written into a directory
laid out like the Hugging Face hub cache (``models--org--name/snapshots/<sha>``), for the
checkpoint tests and the e2e servers (Hugging Face is unreachable from the tests)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    Nemotron3_5AsrConfig,
    Nemotron3_5AsrForRNNT,
    ParakeetFeatureExtractor,
    ParakeetForTDT,
    ParakeetTDTConfig,
)
from transformers.models.nemotron_asr_streaming import NemotronAsrStreamingFeatureExtractor

VOCAB, BLANK = 40, 39
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               subsampling_conv_channels=8, num_mel_bins=16, conv_kernel_size=5, dropout=0.0, layerdrop=0.0,
               activation_dropout=0.0, attention_dropout=0.0)
WORDS = [f"w{i}" for i in range(BLANK)]
REPOS = {"parakeet": "nvidia/parakeet-tdt-0.6b-v3", "nemotron_asr": "nvidia/nemotron-3.5-asr-streaming-0.6b"}


def noise_clip(seconds: float, seed: int) -> np.ndarray:
    """``seconds`` of 16 kHz white noise (a clip every model transcribes as something)."""
    rng = np.random.default_rng(seed)
    return (0.2 * rng.standard_normal(int(seconds * 16000))).astype(np.float32)


# The start of an M4A file (an MP4 'ftyp' box) and nothing decodable after it: an upload the
# server cannot decode without FFmpeg.
M4A = b"\x00\x00\x00\x20ftypM4A \x00\x00\x00\x00M4A mp42isom" + b"\x00" * 256


def wav(samples: np.ndarray, subtype: str = "PCM_16") -> bytes:
    """16 kHz mono ``samples`` as a WAV file's bytes."""
    buf = io.BytesIO()
    sf.write(buf, samples, 16000, format="WAV", subtype=subtype)
    return buf.getvalue()


def snapshot_dir(cache: Path, repo: str) -> Path:
    """An empty snapshot of ``repo`` in the hub cache at ``cache`` (refs/main names it)."""
    org, name = repo.split("/")
    root = cache / f"models--{org}--{name}"
    snapshot = root / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text("b" * 40)
    return snapshot


def tokenizer() -> Tokenizer:
    """A word-level tokenizer: ids 0..38 are ``w0``..``w38``, 39 is the blank (special)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)} | {"<blank>": BLANK}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<blank>"])
    return tok


def _randomise(model: torch.nn.Module, seed: int, joint_scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            scale = 0.5 if "decoder" in name or "joint" in name or "projector" in name else 0.2
            if name.startswith("encoder.") and tensor.dim() == 1:
                scale = 0.02
            values = torch.randn(tensor.shape, generator=gen) * scale
            if name.endswith("running_var") or ("norm" in name and name.endswith("weight")):
                values = 1.0 + values.abs()
            tensor.copy_(values)
        model.joint.head.weight.mul_(joint_scale)


def write_parakeet(snapshot: Path, seed: int = 0) -> ParakeetForTDT:
    """A random tiny ``ParakeetForTDT`` saved in ``snapshot`` with its processor files; the
    model (the reference) is returned."""
    torch.manual_seed(seed)
    config = ParakeetTDTConfig(encoder_config=ENCODER, vocab_size=VOCAB, blank_token_id=BLANK, pad_token_id=2,
                               decoder_hidden_size=24, num_decoder_layers=2, durations=[0, 1, 2, 3, 4])
    model = ParakeetForTDT(config).eval()
    _randomise(model, seed + 1, joint_scale=1.0)
    with torch.no_grad():
        model.joint.head.bias[BLANK] += 2.0  # blanks often, as in speech
        model.joint.head.bias[2] = -1e4  # never the pad token
        model.joint.head.bias[VOCAB:] += torch.tensor([0.0, 2.0, 1.5, 0.5, 0.0])
    model.save_pretrained(snapshot)
    GenerationConfig(decoder_start_token_id=BLANK, pad_token_id=2).save_pretrained(snapshot)
    ParakeetFeatureExtractor(feature_size=16).save_pretrained(snapshot)
    tokenizer().save(str(snapshot / "tokenizer.json"))
    return model


def write_nemotron(snapshot: Path, seed: int = 0) -> Nemotron3_5AsrForRNNT:
    """A random tiny ``Nemotron3_5AsrForRNNT`` saved in ``snapshot`` with its processor files."""
    torch.manual_seed(seed)
    config = Nemotron3_5AsrConfig(
        encoder_config=dict(ENCODER, sliding_window=71, default_num_lookahead_tokens=13), vocab_size=VOCAB,
        blank_token_id=BLANK, pad_token_id=2, decoder_hidden_size=24, num_decoder_layers=2, max_symbols_per_step=3,
        num_prompts=128, prompt_intermediate_size=40, default_prompt_id=101)
    model = Nemotron3_5AsrForRNNT(config).eval()
    _randomise(model, seed + 1, joint_scale=0.1)
    with torch.no_grad():
        model.joint.head.bias[BLANK] += 14.0  # blanks often, as in speech
        model.joint.head.bias[2] = -1e4  # never the pad token
    model.save_pretrained(snapshot)
    GenerationConfig(decoder_start_token_id=BLANK, pad_token_id=2).save_pretrained(snapshot)
    NemotronAsrStreamingFeatureExtractor(feature_size=16, mel_filters_dtype="bfloat16").save_pretrained(snapshot)
    tokenizer().save(str(snapshot / "tokenizer.json"))
    return model


def hub_cache(root: Path) -> dict[str, torch.nn.Module]:
    """Both keys' default repos written under the hub cache ``root``; the reference models."""
    return {"parakeet": write_parakeet(snapshot_dir(root, REPOS["parakeet"])),
            "nemotron_asr": write_nemotron(snapshot_dir(root, REPOS["nemotron_asr"]))}


CANARY_SPECIALS = ["<unk>", "<|nospeech|>", "<pad>", "<|endoftext|>", "<|startoftranscript|>", "<|pnc|>",
                   "<|nopnc|>", "<|startofcontext|>", "<|noitn|>", "<|notimestamp|>", "<|nodiarize|>",
                   "<|emo:undefined|>"]
CANARY_LANGUAGES = "bg hr cs da nl en et fi fr de el hu it lv lt mt pl pt ro sk sl es sv ru uk".split()
CANARY_VOCAB = 64
CANARY_REPO = "nvidia/canary-1b-v2"


def canary_tokenizer() -> Tokenizer:
    """Canary's special tokens at their ids (pad 2, end 3, start of context 7), the 25
    language tokens, then words."""
    specials = CANARY_SPECIALS + [f"<|{code}|>" for code in CANARY_LANGUAGES]
    words = [f"w{i}" for i in range(CANARY_VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok


def write_canary(snapshot: Path, seed: int = 0, eos_bias: float = 2.0):
    """A random tiny ``CanaryForConditionalGeneration`` saved in ``snapshot`` with its processor
    files and tokenizer; the model (the reference) is returned."""
    from transformers import CanaryConfig, CanaryForConditionalGeneration

    torch.manual_seed(seed)
    encoder = dict(ENCODER, scale_input=False)
    decoder = dict(vocab_size=CANARY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128)
    model = CanaryForConditionalGeneration(CanaryConfig(encoder_config=encoder, decoder_config=decoder,
                                                        vocab_size=CANARY_VOCAB)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and "positional_embedding" not in name:
                # wide decoder matrices: the blocks, not the tied embedding, pick the next token
                wide = name.startswith("model.decoder.layers.") and tensor.dim() == 2
                values = torch.randn(tensor.shape, generator=gen) * (0.6 if wide else 0.2)
                if name.endswith("running_var") or ("norm" in name and name.endswith("weight")):
                    values = 1.0 + values.abs()
                tensor.copy_(values)
        model.proj_out.bias[3] += eos_bias  # <|endoftext|> now and then
    model.save_pretrained(snapshot)
    ParakeetFeatureExtractor(feature_size=16).save_pretrained(snapshot)
    canary_tokenizer().save(str(snapshot / "tokenizer.json"))
    return model


# ------------------------------------------------------------------------------ canary_qwen

CANARY_QWEN_REPO, QWEN_REPO = "nvidia/canary-qwen-2.5b", "Qwen/Qwen3-1.7B"
LOCATOR = "<|audioplaceholder|>"
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_WORDS = ["user", "assistant", "Transcribe", "the", "following", ":", "Say", "what", "you", "hear", "."]
QWEN_VOCAB = 96  # the LLM's embedding rows (more than the tokenizer's 70 entries and the locator)
LORA_R, LORA_ALPHA = 4, 8.0
_NEMO_CONFORMER = [("subsampling.layers.", "pre_encode.conv."), ("subsampling.linear.", "pre_encode.out."),
                   (".conv.norm.", ".conv.batch_norm."), (".q_proj.", ".linear_q."), (".k_proj.", ".linear_k."),
                   (".v_proj.", ".linear_v."), (".o_proj.", ".linear_out."), (".relative_k_proj.", ".linear_pos."),
                   (".bias_u", ".pos_bias_u"), (".bias_v", ".pos_bias_v")]


def nemo_conformer(section: dict, **over) -> dict:
    """A NeMo ``ConformerEncoder`` config section of the tiny sizes."""
    return {"_target_": "nemo.collections.asr.modules.ConformerEncoder", "feat_in": 16, "feat_out": -1,
            "n_layers": 2, "d_model": 32, "subsampling": "dw_striding", "subsampling_factor": 8,
            "subsampling_conv_channels": 8, "causal_downsampling": False, "ff_expansion_factor": 2,
            "self_attention_model": "rel_pos", "n_heads": 4, "att_context_size": [-1, -1],
            "att_context_style": "regular", "xscaling": False, "untie_biases": True, "pos_emb_max_len": 5000,
            "conv_kernel_size": 5, "conv_norm_type": "batch_norm", "conv_context_size": None, "dropout": 0.0,
            "dropout_pre_encoder": 0.0, "dropout_emb": 0.0, "dropout_att": 0.0, **section, **over}


def canary_qwen_nemo_config() -> dict:
    """The SALM ``config.json`` of the tiny checkpoint (the released one's sections and keys)."""
    return {"pretrained_llm": QWEN_REPO, "pretrained_asr": "nvidia/canary-1b-flash", "pretrained_weights": True,
            "freeze_params": ["^llm\\..+$"], "prevent_freeze_params": [], "prompt_format": "qwen",
            "audio_locator_tag": LOCATOR,
            "lora": {"task_type": "CAUSAL_LM", "r": LORA_R, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.01,
                     "target_modules": ["q_proj", "v_proj"]},
            "perception": {
                "target": "nemo.collections.speechlm2.modules.perception.AudioPerceptionModule", "output_dim": 48,
                "preprocessor": {"_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
                                 "sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
                                 "window_stride": 0.01, "window": "hann", "features": 16, "n_fft": 512, "log": True,
                                 "frame_splicing": 1, "dither": 1e-05, "pad_to": 0, "pad_value": 0.0},
                "encoder": nemo_conformer({}),
                "modality_adapter": nemo_conformer({}, feat_in=32, subsampling_factor=1, xscaling=True)}}


def qwen_config(**over):
    from transformers import Qwen3Config

    return Qwen3Config(**{"vocab_size": QWEN_VOCAB, "hidden_size": 48, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                          "max_position_embeddings": 512, "tie_word_embeddings": True, "rope_theta": 10000.0,
                          "eos_token_id": 2, **over})


def qwen_tokenizer() -> Tokenizer:
    """Qwen's chat tokens at ids 0-2, the prompt's words, then ``w*`` words (70 entries)."""
    words = QWEN_WORDS + [f"w{i}" for i in range(70 - len(QWEN_SPECIALS) - len(QWEN_WORDS))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(QWEN_SPECIALS + words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(QWEN_SPECIALS)
    return tok


class FrameLinear(torch.nn.Module):
    """The modality adapter's linear ``pre_encode`` in place of ``ParakeetEncoder``'s
    convolutional subsampling (a reference built from transformers' modules)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, features, attention_mask=None):
        return self.linear(features)


def canary_qwen_reference(seed: int = 0):
    """Random reference modules: the encoder and the adapter as transformers ``ParakeetEncoder``s,
    the projection, the Qwen3 LLM's base weights and LoRA pairs for q_proj and v_proj."""
    from transformers import ParakeetEncoder, ParakeetEncoderConfig, Qwen3ForCausalLM

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    encoder = ParakeetEncoder(ParakeetEncoderConfig(**ENCODER, scale_input=False)).eval()
    adapter = ParakeetEncoder(ParakeetEncoderConfig(**dict(ENCODER, num_mel_bins=32), scale_input=True,
                                                    subsampling_factor=1)).eval()
    adapter.subsampling = FrameLinear(32)
    proj = torch.nn.Linear(32, 48)
    with torch.no_grad():
        for module in (encoder, adapter, proj):
            for name, tensor in module.state_dict().items():
                if tensor.is_floating_point():
                    values = torch.randn(tensor.shape, generator=gen) * (0.02 if tensor.dim() == 1 else 0.2)
                    if name.endswith("running_var") or ("norm" in name and name.endswith("weight")):
                        values = 1.0 + values.abs()
                    tensor.copy_(values)
    llm = Qwen3ForCausalLM(qwen_config()).eval()
    with torch.no_grad():
        for name, tensor in llm.state_dict().items():
            scale = 0.5 if ("layers." in name and tensor.dim() == 2) else 0.2
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    lora = {}
    for layer in range(llm.config.num_hidden_layers):
        for proj_name in ("q_proj", "v_proj"):
            weight = llm.model.layers[layer].self_attn.get_submodule(proj_name).weight
            lora[f"model.layers.{layer}.self_attn.{proj_name}"] = (
                torch.randn(LORA_R, weight.shape[1], generator=gen) * 0.3,
                torch.randn(weight.shape[0], LORA_R, generator=gen) * 0.3)
    return encoder, adapter, proj, llm, lora


def merged_llm(llm, lora):
    """The reference LLM with the LoRA pairs merged by hand: ``W + alpha / r * B @ A``."""
    import copy

    merged = copy.deepcopy(llm)
    with torch.no_grad():
        for module, (a, b) in lora.items():
            merged.get_submodule(module).weight += (LORA_ALPHA / LORA_R) * (b @ a)
    return merged


def nemo_tensors(encoder, adapter, proj, llm, lora) -> dict[str, torch.Tensor]:
    """The modules' tensors under the released checkpoint's names (NeMo's ``SALM`` state dict:
    ``perception.*``, ``embed_tokens.weight`` moved out of the LLM, PEFT's wrapped LLM with
    ``base_layer`` / ``lora_A`` / ``lora_B`` for the ``lora`` modules; the tied ``lm_head`` left
    out, as safetensors keeps one name of a shared tensor)."""
    tensors = {}

    def conformer(prefix: str, module: torch.nn.Module, linear_pre_encode: bool) -> None:
        for name, tensor in module.state_dict().items():
            if linear_pre_encode and name.startswith("subsampling.linear."):
                name = name.replace("subsampling.linear.", "pre_encode.")
            for ours, theirs in _NEMO_CONFORMER:
                name = name.replace(ours, theirs)
            tensors[prefix + name] = tensor.clone()

    conformer("perception.encoder.", encoder, False)
    conformer("perception.modality_adapter.", adapter, True)
    for name, tensor in proj.state_dict().items():
        tensors[f"perception.proj.{name}"] = tensor.clone()
    for name, tensor in llm.state_dict().items():
        if name == "model.embed_tokens.weight":
            tensors["embed_tokens.weight"] = tensor.clone()
            continue
        if name == "lm_head.weight" and llm.config.tie_word_embeddings:
            continue
        module = name.rsplit(".", 1)[0]
        if module in lora:
            a, b = lora[module]
            tensors[f"llm.base_model.model.{module}.base_layer.weight"] = tensor.clone()
            tensors[f"llm.base_model.model.{module}.lora_A.default.weight"] = a
            tensors[f"llm.base_model.model.{module}.lora_B.default.weight"] = b
        else:
            tensors[f"llm.base_model.model.{name}"] = tensor.clone()
    return tensors


def write_canary_qwen(root: Path, seed: int = 0):
    """The tiny checkpoint in the released layout under the hub cache ``root``: the SALM
    snapshot (``config.json``, ``model.safetensors`` with NeMo's names and PEFT's LoRA keys) and
    the LLM's snapshot (``config.json``, ``tokenizer.json``, ``tokenizer_config.json``).
    Returns ``(encoder, adapter, proj, merged_llm)``, the reference modules."""
    import json

    from safetensors.torch import save_file

    encoder, adapter, proj, llm, lora = canary_qwen_reference(seed)
    tensors = nemo_tensors(encoder, adapter, proj, llm, lora)
    tensors["perception.preprocessor.featurizer.window"] = torch.hann_window(400)
    tensors["perception.preprocessor.featurizer.fb"] = torch.zeros(1, 16, 257)
    snapshot = snapshot_dir(root, CANARY_QWEN_REPO)
    save_file(tensors, snapshot / "model.safetensors")
    (snapshot / "config.json").write_text(json.dumps(canary_qwen_nemo_config()))
    qwen = snapshot_dir(root, QWEN_REPO)
    (qwen / "config.json").write_text(qwen_config().to_json_string())
    qwen_tokenizer().save(str(qwen / "tokenizer.json"))
    (qwen / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return encoder, adapter, proj, merged_llm(llm, lora)
