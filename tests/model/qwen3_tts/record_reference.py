"""Record the Qwen3-TTS parity fixtures from the reference package (``qwen-tts==0.1.1``).

The reference pins ``transformers==4.57.3``, which cannot run beside ours, so its outputs are
recorded once here and ``test_qwen3_tts_parity.py`` compares against them. Run it with the
reference's modules and the old transformers ahead of ours on the path::

    pip install --no-deps --target /tmp/qtts_tf457 transformers==4.57.3 huggingface_hub==0.36.0 \
        tokenizers==0.22.1
    unzip -o qwen_tts-0.1.1-py3-none-any.whl -d /tmp/qtts_x
    PYTHONPATH=/tmp/qtts_tf457:/tmp/qtts_x:. python tests/model/qwen3_tts/record_reference.py [NAME ...]

NAME: ``talker``, ``codec``, ``encoder``, ``generate``, ``icl`` (needs ``generate``'s file),
``speaker``; none: all. Only the model modules are imported
(``qwen_tts.core.models.modeling_qwen3_tts`` and the 12 Hz tokenizer's), bypassing the package
``__init__`` (it loads the 25 Hz tokenizer); librosa, used only by the speaker encoder's mel
front end, is stubbed. Each fixture is a safetensors file: the tiny model's weights under
their released names plus the recorded inputs and outputs
(``fx.`` keys), and the config as JSON in the file's metadata.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).parent / "fixtures"


def import_reference() -> tuple[types.ModuleType, types.ModuleType]:
    """The reference's talker and 12 Hz tokenizer modules, without the package ``__init__``."""
    root = Path(importlib.machinery.PathFinder.find_spec("qwen_tts").submodule_search_locations[0])
    for name, sub in (("qwen_tts", ""), ("qwen_tts.core", "core"), ("qwen_tts.core.models", "core/models"),
                      ("qwen_tts.inference", "inference"), ("qwen_tts.core.tokenizer_12hz", "core/tokenizer_12hz")):
        module = types.ModuleType(name)
        module.__path__ = [str(root / sub)]
        sys.modules[name] = module
    tokenizer = types.ModuleType("qwen_tts.inference.qwen3_tts_tokenizer")
    tokenizer.Qwen3TTSTokenizer = object  # only named by the loader we do not use
    sys.modules[tokenizer.__name__] = tokenizer
    librosa = types.ModuleType("librosa")
    librosa.__path__, librosa.__spec__ = [], importlib.machinery.ModuleSpec("librosa", None)
    filters = types.ModuleType("librosa.filters")
    filters.mel = None
    sys.modules.update({"librosa": librosa, "librosa.filters": filters})
    return (importlib.import_module("qwen_tts.core.models.modeling_qwen3_tts"),
            importlib.import_module("qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2"))


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    """Every parameter drawn afresh (the released inits put layer scales and snakes at
    constants, which would hide their maths); codebook usage counts kept positive."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
            if name.endswith("cluster_usage"):
                p.abs_().add_(0.5)


def talker_config(predictor_hidden: int) -> dict:
    predictor = dict(vocab_size=40, hidden_size=predictor_hidden, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4,
                     rope_theta=10000.0, rms_norm_eps=1e-6)
    return dict(code_predictor_config=predictor, vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=4,
                text_hidden_size=48, text_vocab_size=50, rope_theta=10000.0, rms_norm_eps=1e-6,
                rope_scaling={"mrope_section": [2, 1, 1], "interleaved": True, "rope_type": "default"},
                codec_eos_token_id=60, codec_pad_id=61, codec_bos_id=62, codec_think_id=55, codec_nothink_id=56,
                codec_think_bos_id=57, codec_think_eos_id=58, spk_id={"vivian": 50, "ryan": 51},
                spk_is_dialect={"vivian": False, "ryan": False}, codec_language_id={"english": 52, "chinese": 53})


@torch.no_grad()
def record_talker(ref: types.ModuleType, name: str, predictor_hidden: int, seed: int) -> None:
    """Two requests (prefills of 7 and 4 rows) each run 5 greedy talker steps through the
    reference's own decode path (code predictor ``generate`` inside the step); recorded: every
    step's codebook-0 logits, the frame's codes and the code predictor's logits per group."""
    from transformers.cache_utils import DynamicCache

    config = ref.Qwen3TTSTalkerConfig(**talker_config(predictor_hidden))
    config._attn_implementation = "eager"
    config.code_predictor_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    talker = ref.Qwen3TTSTalkerForConditionalGeneration(config).eval()
    randomize(talker, seed)
    tensors = {f"talker.{k}": v.contiguous() for k, v in talker.state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    pad = torch.randn(1, 1, 32, generator=gen)
    tensors["fx.tts_pad_embed"] = pad[0, 0]
    steps = 5
    for req, length in enumerate((7, 4)):
        prefill = torch.randn(1, length, 32, generator=gen)
        trailing = torch.randn(1, 2, 32, generator=gen)  # two text rows, then tts_pad
        cache = DynamicCache()
        out = talker(inputs_embeds=prefill, attention_mask=torch.ones(1, length, dtype=torch.long),
                     past_key_values=cache, use_cache=True, cache_position=torch.arange(length),
                     trailing_text_hidden=trailing, tts_pad_embed=pad)
        logits, codes, predictor_logits = [out.logits[0, -1]], [], []
        for step in range(steps):
            code0 = out.logits[:, -1].argmax(-1, keepdim=True)
            past_hidden = out.past_hidden
            frame_in = torch.cat((past_hidden, talker.get_input_embeddings()(code0)), dim=1)
            pred = talker.code_predictor.generate(inputs_embeds=frame_in, max_new_tokens=config.num_code_groups - 1,
                                                  do_sample=False, output_logits=True, return_dict_in_generate=True)
            predictor_logits.append(torch.cat(pred.logits, dim=0))
            position = length + step
            out = talker(input_ids=code0, attention_mask=torch.ones(1, position + 1, dtype=torch.long),
                         past_key_values=out.past_key_values, use_cache=True,
                         cache_position=torch.tensor([position]), past_hidden=past_hidden,
                         generation_step=out.generation_step, trailing_text_hidden=trailing, tts_pad_embed=pad,
                         subtalker_dosample=False)
            frame = out.hidden_states[1][0]
            assert torch.equal(frame[1:], pred.sequences[0]), "the step's frame is its code predictor's"
            codes.append(frame)
            logits.append(out.logits[0, -1])
        tensors.update({f"fx.{req}.prefill": prefill[0], f"fx.{req}.trailing": trailing[0],
                        f"fx.{req}.logits": torch.stack(logits), f"fx.{req}.codes": torch.stack(codes),
                        f"fx.{req}.predictor_logits": torch.stack(predictor_logits)})
    meta = {"config": json.dumps(talker_config(predictor_hidden)), "made_by": "qwen-tts 0.1.1, transformers 4.57.3"}
    save_file(tensors, HERE / f"{name}.safetensors", metadata=meta)


CODEC_CONFIG = dict(codebook_size=32, codebook_dim=24, hidden_size=32, latent_dim=40, max_position_embeddings=512,
                    rope_theta=10000.0, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
                    sliding_window=6, intermediate_size=48, hidden_act="silu", layer_scale_initial_scale=0.01,
                    rms_norm_eps=1e-5, num_hidden_layers=2, num_quantizers=4, upsample_rates=[4, 3],
                    upsampling_ratios=[2, 2], decoder_dim=32)


@torch.no_grad()
def record_codec(tok: types.ModuleType) -> None:
    """A tiny 12 Hz decoder: the whole decode of 40 frames (two clips) and the reference's
    ``chunked_decode`` with chunks of 7 frames behind 5 frames of context."""
    config = tok.Qwen3TTSTokenizerV2DecoderConfig(**CODEC_CONFIG)
    config._attn_implementation = "eager"
    decoder = tok.Qwen3TTSTokenizerV2Decoder(config).eval()
    randomize(decoder, 7, scale=0.1)  # wider weights saturate the clamp at +-1 and hide the maths
    codes = torch.randint(0, 32, (2, 4, 40), generator=torch.Generator().manual_seed(8))
    tensors = {f"decoder.{k}": v.contiguous() for k, v in decoder.state_dict().items()}
    tensors.update({"fx.codes": codes, "fx.wav": decoder(codes)[:, 0],
                    "fx.chunked": decoder.chunked_decode(codes, chunk_size=7, left_context_size=5)[:, 0]})
    meta = {"config": json.dumps(CODEC_CONFIG), "made_by": "qwen-tts 0.1.1, transformers 4.57.3"}
    save_file(tensors, HERE / "codec.safetensors", metadata=meta)


ENCODER_CONFIG = dict(sampling_rate=24000, frame_rate=1000.0, audio_channels=1, hidden_size=32, num_filters=8,
                      num_residual_layers=1, upsampling_ratios=[4, 3], kernel_size=7, last_kernel_size=3,
                      residual_kernel_size=3, dilation_growth_rate=2, use_causal_conv=True, pad_mode="constant",
                      compress=2, codebook_size=32, codebook_dim=16, num_quantizers=8, use_conv_shortcut=False,
                      vector_quantization_hidden_dimension=16, num_semantic_quantizers=1, upsample_groups=32,
                      num_hidden_layers=2, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, hidden_act="gelu", max_position_embeddings=512, norm_eps=1e-5, rope_theta=10000.0,
                      sliding_window=250, layer_scale_initial_scale=0.01, attention_bias=False)
# the tokenizer's own config: 4 of the encoder's 8 quantizers kept, 24 samples per frame (12 x the 2x downsample)
TOKENIZER_CONFIG = dict(encoder_config=ENCODER_CONFIG, decoder_config=CODEC_CONFIG, encoder_valid_num_quantizers=4,
                        input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=144,
                        encode_downsample_rate=24)


@torch.no_grad()
def record_encoder(tok: types.ModuleType) -> None:
    """A tiny 12 Hz tokenizer's ``encode`` (Mimi's SEANet conv stack, causal transformer,
    replicate-padded 2x downsample, split RVQ) of two clips, one at a time as the reference's
    clone prompt encodes them: the codes, and the quantizer's input (the downsampled latents)."""
    config = tok.Qwen3TTSTokenizerV2Config(**TOKENIZER_CONFIG)
    config.encoder_config._attn_implementation = "eager"
    config.decoder_config._attn_implementation = "eager"
    torch.manual_seed(41)
    model = tok.Qwen3TTSTokenizerV2Model(config).eval()
    encoder = model.encoder
    randomize(encoder, 41, scale=0.15)
    gen = torch.Generator().manual_seed(42)
    for name, buf in encoder.named_buffers():  # the codebooks are buffers in Mimi
        if name.endswith("embed_sum"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.6)
        elif name.endswith("cluster_usage"):
            buf.copy_(torch.rand(buf.shape, generator=gen) + 0.5)
    latents = []
    encoder.downsample.register_forward_hook(lambda module, args, out: latents.append(out))
    tensors = {f"encoder.{k}": v.contiguous() for k, v in encoder.state_dict().items()}
    t = torch.arange(24 * 40) / 24000
    for i, samples in enumerate((24 * 31 + 5, 24 * 17)):
        clip = 0.5 * torch.sin(2 * torch.pi * (300 + 200 * i) * t[:samples]) + 0.1 * torch.randn(samples, generator=gen)
        codes = model.encode(clip[None], torch.ones(1, samples, dtype=torch.long)).audio_codes[0].contiguous()
        tensors.update({f"fx.{i}.clip": clip, f"fx.{i}.codes": codes, f"fx.{i}.latents": latents[-1][0]})
        # the nearest codeword must win clearly, or a rounding difference could flip a code
        print("encoder clip", i, "codes", tuple(codes.shape), "distinct", [len(set(c.tolist())) for c in codes.T],
              "latent std", float(latents[-1].std()))
    meta = {"config": json.dumps(TOKENIZER_CONFIG), "made_by": "qwen-tts 0.1.1, transformers 4.57.3"}
    save_file(tensors, HERE / "encoder.safetensors", metadata=meta)


def generate_config() -> dict:
    """A whole tiny ``config.json``: a talker vocabulary of 64 codes and the 1024 special ids
    above them (the reference suppresses the top 1024 ids but EOS), text ids under 200."""
    talker = talker_config(24)
    talker.update(vocab_size=1088, text_vocab_size=200, codec_eos_token_id=1060, codec_pad_id=1061,
                  codec_bos_id=1062, codec_think_id=1055, codec_nothink_id=1056, codec_think_bos_id=1057,
                  codec_think_eos_id=1058, spk_id={"vivian": 1050, "dylan": 1051},
                  spk_is_dialect={"vivian": False, "dylan": "beijing_dialect"},
                  codec_language_id={"english": 1052, "chinese": 1053, "beijing_dialect": 1054})
    talker["code_predictor_config"]["vocab_size"] = 64
    return dict(talker_config=talker, tts_model_type="custom_voice", tokenizer_type="qwen3_tts_tokenizer_12hz",
                im_start_token_id=190, im_end_token_id=191, tts_pad_token_id=195, tts_bos_token_id=196,
                tts_eos_token_id=197)


def generate_model(ref: types.ModuleType) -> torch.nn.Module:
    """The whole tiny model of ``generate_config`` (seeded: the same weights on every call)."""
    config = ref.Qwen3TTSConfig(**generate_config())
    config.talker_config._attn_implementation = "eager"
    config.talker_config.code_predictor_config._attn_implementation = "eager"
    torch.manual_seed(21)
    model = ref.Qwen3TTSForConditionalGeneration(config).eval()
    randomize(model, 21, scale=0.3)
    for p in model.parameters():  # values fp16 holds exactly, so the weights are stored at half size
        p.data.copy_(p.data.half().float())
    return model


@torch.no_grad()
def record_icl(ref: types.ModuleType) -> None:
    """In-context cloning's talker input, caught at the reference talker's ``forward`` inside
    ``generate`` (the model of ``generate.safetensors``, whose weights this fixture reuses):
    the prefill rows, the trailing text rows and the first 3 steps' codebook-0 logits, for the
    streaming layout with fewer and with more text rows than codec rows, and non-streaming."""
    from safetensors.torch import load_file

    model = generate_model(ref)
    stored = load_file(HERE / "generate.safetensors")
    assert all(torch.equal(v.half(), stored[f"talker.{k}"]) for k, v in model.talker.state_dict().items()), \
        "generate.safetensors holds another model: record generate first"
    calls: list[tuple[dict, torch.Tensor]] = []
    forward = model.talker.forward

    @functools.wraps(forward)  # generate checks its kwargs against forward's signature
    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append((kwargs, out.logits[0, -1]))
        return out

    model.talker.forward = spy
    gen = torch.Generator().manual_seed(23)
    x_vector = torch.randn(32, generator=gen).half().float()
    ref_code = torch.randint(0, 64, (10, 4), generator=gen)
    ref_ids = torch.tensor([[190, 160, 161, 130, 131, 132, 191, 161]])
    tensors = {"fx.x_vector": x_vector, "fx.ref_code": ref_code, "fx.ref_ids": ref_ids[0]}
    cases = {"short_text": (False, 2), "long_text": (False, 12), "non_streaming": (True, 5)}
    for name, (non_streaming, text_len) in cases.items():
        text = torch.randint(0, 150, (text_len,), generator=gen).tolist()
        input_ids = torch.tensor([[190, 160, 161, *text, 191, 161, 190, 160, 161]])
        prompt = {"ref_code": [ref_code], "ref_spk_embedding": [x_vector], "x_vector_only_mode": [False],
                  "icl_mode": [True]}
        calls.clear()
        model.generate(input_ids=[input_ids], ref_ids=[ref_ids], voice_clone_prompt=prompt, languages=["english"],
                       speakers=[None], non_streaming_mode=non_streaming, max_new_tokens=4, do_sample=False,
                       subtalker_dosample=False, repetition_penalty=1.0)
        first = calls[0][0]
        tensors.update({f"fx.{name}.input_ids": input_ids[0], f"fx.{name}.prompt": first["inputs_embeds"][0],
                        f"fx.{name}.trailing": first["trailing_text_hidden"][0],
                        f"fx.{name}.logits": torch.stack([logits for _, logits in calls[:3]])})
    meta = {"cases": json.dumps({k: {"non_streaming": v[0]} for k, v in cases.items()}), "language": "english",
            "made_by": "qwen-tts 0.1.1, transformers 4.57.3"}
    save_file(tensors, HERE / "icl.safetensors", metadata=meta)


@torch.no_grad()
def record_generate(ref: types.ModuleType) -> None:
    """The reference's whole ``generate`` (greedy, no repetition penalty) for four requests:
    speaker + English, a dialect speaker with auto language, an instruction with no speaker
    (voice design), and the non-streaming text layout; the codes of every frame."""
    model = generate_model(ref)
    gen = torch.Generator().manual_seed(22)

    def ids(text_len: int) -> torch.Tensor:  # <|im_start|>assistant\n {text} <|im_end|>\n<|im_start|>assistant\n
        text = torch.randint(0, 150, (text_len,), generator=gen).tolist()
        return torch.tensor([[190, 160, 161, *text, 191, 161, 190, 160, 161]])

    cases = {"speaker": dict(languages=["english"], speakers=["vivian"]),
             "dialect": dict(languages=["auto"], speakers=["dylan"]),
             "design": dict(languages=["auto"], speakers=[None], instruct_ids=[torch.tensor([[190, 170, 161, 171,
                                                                                             172, 191, 161]])]),
             "non_streaming": dict(languages=["chinese"], speakers=["vivian"], non_streaming_mode=True)}
    tensors = {f"talker.{k}": v.half().contiguous() for k, v in model.talker.state_dict().items()}
    for name, kwargs in cases.items():
        input_ids = ids(6)
        codes, _ = model.generate(input_ids=[input_ids], max_new_tokens=8, do_sample=False,
                                  subtalker_dosample=False, repetition_penalty=1.0, **kwargs)
        tensors[f"fx.{name}.input_ids"] = input_ids[0]
        tensors[f"fx.{name}.codes"] = codes[0]
        if "instruct_ids" in kwargs:
            tensors[f"fx.{name}.instruct_ids"] = kwargs["instruct_ids"][0][0]
    # cloning: a clip's x-vector alone, and in context (its transcript and codes in the prompt)
    x_vector = torch.randn(32, generator=gen).half().float()
    ref_code = torch.randint(0, 64, (12, 4), generator=gen)  # 13 codec rows with bos
    ref_ids = torch.tensor([[190, 160, 161, 120, 121, 122, 123, 191, 161]])
    # text rows: 4 of the transcript, the text, tts_eos: 8 (fewer than the codec rows) or 14 (more)
    clones = {"x_vector": (True, False, False, 6), "icl": (False, True, False, 3),
              "icl_long_text": (False, True, False, 9), "icl_non_streaming": (False, True, True, 6)}
    for name, (x_only, icl, non_streaming, text_len) in clones.items():
        input_ids = ids(text_len)
        prompt = {"ref_code": [ref_code], "ref_spk_embedding": [x_vector], "x_vector_only_mode": [x_only],
                  "icl_mode": [icl]}
        codes, _ = model.generate(input_ids=[input_ids], ref_ids=[ref_ids], voice_clone_prompt=prompt,
                                  languages=["auto"], speakers=[None], non_streaming_mode=non_streaming,
                                  max_new_tokens=8, do_sample=False, subtalker_dosample=False, repetition_penalty=1.0)
        tensors[f"fx.{name}.input_ids"] = input_ids[0]
        tensors[f"fx.{name}.codes"] = codes[0]
        cases[name] = dict(languages=["auto"], speakers=[None], non_streaming_mode=non_streaming, icl=icl)
    tensors.update({"fx.x_vector": x_vector, "fx.ref_code": ref_code, "fx.ref_ids": ref_ids[0]})
    meta = {"config": json.dumps(generate_config()), "cases": json.dumps({k: {a: b for a, b in v.items()
                                                                          if a != "instruct_ids"}
                                                                      for k, v in cases.items()}),
            "made_by": "qwen-tts 0.1.1, transformers 4.57.3"}
    save_file(tensors, HERE / "generate.safetensors", metadata=meta)


SPEAKER_CONFIG = dict(mel_dim=128, enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_kernel_sizes=[5, 3, 3, 3, 1],
                      enc_dilations=[1, 2, 3, 4, 1], enc_attention_channels=8, enc_res2net_scale=4, enc_se_channels=8,
                      sample_rate=24000)


@torch.no_grad()
def record_speaker(ref: types.ModuleType) -> None:
    """The speaker encoder (``extract_speaker_embedding``: mel front end and ECAPA-TDNN) on a
    0.6 s clip. librosa is not installed here: its ``filters.mel`` is M*'s Slaney filterbank
    (``mstar.model.s3gen.mel.mel_filterbank``, itself checked against librosa's table)."""
    from mstar.model.s3gen.mel import MelConfig, mel_filterbank

    def librosa_mel(sr, n_fft, n_mels, fmin, fmax):
        return mel_filterbank(MelConfig(sr, n_fft, n_fft // 4, n_mels, float(fmin), float(fmax))).numpy()

    ref.librosa_mel_fn = librosa_mel
    config = ref.Qwen3TTSSpeakerEncoderConfig(**SPEAKER_CONFIG)
    encoder = ref.Qwen3TTSSpeakerEncoder(config).eval()
    randomize(encoder, 31, scale=0.3)
    gen = torch.Generator().manual_seed(32)
    t = torch.arange(14400) / 24000
    clip = (0.4 * torch.sin(2 * torch.pi * 220 * t) + 0.05 * torch.randn(t.shape, generator=gen)).numpy()
    model = types.SimpleNamespace(speaker_encoder=encoder, device=torch.device("cpu"), dtype=torch.float32)
    embedding = ref.Qwen3TTSForConditionalGeneration.extract_speaker_embedding(model, clip, 24000)
    tensors = {f"speaker_encoder.{k}": v.contiguous() for k, v in encoder.state_dict().items()}
    tensors.update({"fx.clip": torch.from_numpy(clip), "fx.embedding": embedding})
    meta = {"config": json.dumps(SPEAKER_CONFIG), "made_by": "qwen-tts 0.1.1, transformers 4.57.3"}
    save_file(tensors, HERE / "speaker.safetensors", metadata=meta)


def main() -> None:
    ref, tok = import_reference()
    HERE.mkdir(exist_ok=True)
    only = set(sys.argv[1:])  # fixture names to record (default: all)
    if not only or "talker" in only:
        record_talker(ref, "talker_same_width", predictor_hidden=32, seed=11)
        record_talker(ref, "talker_projected", predictor_hidden=24, seed=12)
    if not only or "codec" in only:
        record_codec(tok)
    if not only or "encoder" in only:
        record_encoder(tok)
    if not only or "generate" in only:
        record_generate(ref)
    if not only or "icl" in only:
        record_icl(ref)
    if not only or "speaker" in only:
        record_speaker(ref)
    for path in sorted(HERE.glob("*.safetensors")):
        print(path.name, path.stat().st_size)


if __name__ == "__main__":
    main()
