"""Large families built in their dtype (``weights.building``), not in float32 then cast.

For each converted family, with its tests' tiny config written as a checkpoint folder
(``config.json`` only: dummy weights), the family's real build path in bf16 on the CPU is
compared with the old construction written here (float32 on the device, then
``.to(torch.bfloat16)``, or the family's own cast such as GLM-5.2's ``to_dtype``, then the
same seeded dummy weights): every parameter, buffer and plain tensor attribute must be
bitwise the same (dtype and values), and the new path must never register a float32
parameter or buffer except those the old build also kept float32 (GLM-5.2's routers).

A table a constructor computes in the default dtype (a linspace, an arange over floats) comes
out different in a bf16 build; a float32 table a module registers as a buffer stays float32
where the old cast made it bf16. Both fail here (checked: ``rope_inv_freq`` computed in the
default dtype fails Command A+ and Llama; BAGEL's, Qwen3-Omni's, Qwen3-ASR's, Canary's and
Waypoint's tables failed before their constructors cast them).

The diffusers-layout families (Wan2.2, Cosmos3, FLUX.2, Z-Image, LTX-2.5, LingBot-World) build
each component through ``DiffusersCheckpoint.load`` from a factory; their old path is that
loader's former body (float32 on the CPU, ``.to(device, dtype)``, the ``fp32`` names cast back,
then drawn), a float32 VAE built in float32. Wan's float32 rotary buffers (kept float32 where
the cast made them bf16) and LTX's vocoder filters (computed in bf16) failed here first.

OmniVoice (its backbone; the codec stays float32), Kokoro (``dummy_model``) and Chatterbox's
T3 (``load_t3``: the English, multilingual and Turbo variants) used to fill their float32
build and cast after it (OmniVoice: cast the backbone, then fill); their old path here casts
before the draw, as for the others, since ``init_dummy_weights`` draws in the parameter's
dtype (a float32 draw then cast differs where a tensor's size is not a multiple of 16).
Kokoro's iSTFT window (a Hann window computed in bf16) failed here first.

Qwen3-Omni's ``load_*_dir`` helpers (``qwen3_omni_dirs``) load a released-layout checkpoint
with real tensors, cast as they are copied in; their old path casts the float32 build, then
loads. CosyVoice3 (``build_parts``: the LM, and the flow with its DiT in bf16 and the rest
float32) used to draw its float32 build and then cast in the worker (the LM's ``.to``, the
flow's ``set_estimator_dtype``, which kept the DiT's rotary frequencies float32); its old
path here casts before the draw. With the old build code put back, ``qwen3_omni_dirs`` failed
here on the float32 parameters it made (its values were equal); CosyVoice3's old body failed
on the LM's stop rows (scaled by 0.1 in float32, then cast) and, with its casts moved before
the draw, on the float32 parameters it made."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from mstar.model.diffusers_checkpoint import DiffusersCheckpoint
from mstar.model.weights import init_dummy_weights
from tests.support.registrations import Registrations

CPU, BF16, SEED = torch.device("cpu"), torch.bfloat16, 5


def _old(make: Callable[[], nn.Module], cast: Callable[[nn.Module], nn.Module] | None = None,
         seed: int = SEED) -> nn.Module:
    """The construction every family used before: float32 on the device, then cast, then drawn."""
    with torch.device(CPU):
        model = make()
    model = cast(model) if cast is not None else model.to(BF16)
    init_dummy_weights(model, seed=seed)
    return model.eval()


def _write(folder: Path, config: dict) -> str:
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# ----------------------------------------------------------------------------- the families
# each: folder -> (new build through the family's path, old build written here)


def command_a_plus(folder: Path):
    from mstar.model.command_a_plus.checkpoint import CommandAPlusCheckpoint
    from mstar.model.command_a_plus.modeling import CommandAPlusForCausalLM
    from tests.model.test_command_a_plus_vision import _vl_config

    ckpt = CommandAPlusCheckpoint.locate(_write(folder, _vl_config().to_dict()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: CommandAPlusForCausalLM(ckpt.config(), ckpt.vision_config()))

    return new, old


def glm52(folder: Path):
    from transformers import GlmMoeDsaConfig

    from mstar.model.glm52.checkpoint import Glm52Checkpoint
    from mstar.model.glm52.modeling import Glm52ForCausalLM
    from tests.support.glm52 import TINY

    ckpt = Glm52Checkpoint.locate(_write(folder, GlmMoeDsaConfig(**TINY).to_dict()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: Glm52ForCausalLM(ckpt.config()), cast=lambda m: m.to_dtype(BF16))

    return new, old


def qwen3_5(folder: Path):
    from transformers import Qwen3_5Config

    from mstar.model.qwen3_5 import Qwen3_5ForCausalLM
    from mstar.model.qwen3_5.checkpoint import Qwen3_5Checkpoint
    from mstar.model.qwen3_5.vision import Qwen3_5VisionModel
    from tests.model.test_qwen3_5_vl_parity import TEXT, VISION

    ckpt = Qwen3_5Checkpoint.locate(_write(folder, Qwen3_5Config(text_config=TEXT, vision_config=VISION).to_dict()))

    def new():
        return nn.ModuleList(ckpt.load_models(CPU, BF16, text=True, vision=True, dummy=True, seed=SEED))

    def old():
        return nn.ModuleList([_old(lambda: Qwen3_5ForCausalLM(ckpt.config())),
                              _old(lambda: Qwen3_5VisionModel(ckpt.vision_config()), seed=SEED + 1)])

    return new, old


def nemotron_h(folder: Path):
    from transformers import NemotronHConfig

    from mstar.model.nemotron_h import NemotronHForCausalLM
    from mstar.model.nemotron_h.checkpoint import NemotronHCheckpoint
    from tests.model.test_nemotron_h_parity import PATTERN, TINY

    config = NemotronHConfig(hybrid_override_pattern=PATTERN, **TINY).to_dict()
    ckpt = NemotronHCheckpoint.locate(_write(folder, config))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: NemotronHForCausalLM(ckpt.config()))

    return new, old


def llama(folder: Path):
    from transformers import LlamaConfig

    from mstar.model.llama import LlamaForCausalLM
    from mstar.model.llama.checkpoint import LlamaCheckpoint

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=rope,
                         max_position_embeddings=512).to_dict()
    ckpt = LlamaCheckpoint.locate(_write(folder, config))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: LlamaForCausalLM(ckpt.config()))

    return new, old


def bagel(folder: Path):
    from types import SimpleNamespace

    from mstar.model.bagel import vae as bagel_vae
    from mstar.model.bagel.checkpoint import BagelCheckpoint
    from mstar.model.bagel.generation import LatentProjections
    from mstar.model.bagel.image_engine import load_generation_side
    from mstar.model.bagel.llm import BagelLanguageModel
    from mstar.model.bagel.vision import BagelVision
    from mstar.model.z_image.vae import ZImageVAE
    from tests.support.bagel_reference import BAGEL, LLM, VIT

    write = {"llm_config.json": dict(LLM, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
             "vit_config.json": dict(VIT, num_hidden_layers=VIT["num_hidden_layers"] + 1,
                                     model_type="siglip_vision_model"),  # one more, as released
             "config.json": {k: BAGEL[k] for k in ("vit_max_num_patch_per_side", "latent_patch_size",
                                                  "max_latent_size")}}
    for name, config in write.items():
        (folder / name).write_text(json.dumps(config))
    ckpt = BagelCheckpoint.locate(str(folder))
    config = ckpt.config()
    # no ae.safetensors: a dummy build takes FLUX.1's VAE; a small one of its shape family here
    vae_config = bagel_vae.flux1_vae_config(ch=32, ch_mult=(1, 2), num_res_blocks=1, z_channels=4)

    def new():
        llm, tower = ckpt.load_models(CPU, BF16, llm=True, vision=True, dummy=True, seed=SEED)
        small = pytest.MonkeyPatch()
        small.setattr(bagel_vae, "flux1_vae_config", lambda: vae_config)
        try:
            proj, vae = load_generation_side(SimpleNamespace(path=folder), config, CPU, BF16, dummy=True,
                                             seed=SEED + 2)
        finally:
            small.undo()
        return nn.ModuleList([llm, tower, proj, vae])

    def proj():
        return LatentProjections(config.llm.hidden_size, vae_config.net.latent_channels, config.latent_patch_size,
                                 config.max_latent_size)

    def old():
        return nn.ModuleList([_old(lambda: BagelLanguageModel(config.llm)),
                              _old(lambda: BagelVision(config), seed=SEED + 1),
                              _old(proj, seed=SEED + 2), _old(lambda: ZImageVAE(vae_config), seed=SEED + 3)])

    return new, old


def qwen3_omni(folder: Path):
    from mstar.model.qwen3_omni.checkpoint import (
        Qwen3OmniCheckpoint,
        Qwen3OmniCode2Wav,
        Qwen3OmniCode2WavConfig,
        Qwen3OmniTalker,
        Qwen3OmniThinker,
    )
    from tests.support.qwen3_omni import reference_omni

    ckpt = Qwen3OmniCheckpoint.locate(_write(folder, reference_omni().config.to_dict()))
    hf = ckpt.hf_config()

    def new():
        return nn.ModuleList([ckpt.thinker(CPU, BF16, dummy=True, seed=SEED),
                              ckpt.talker(CPU, BF16, dummy=True, seed=SEED + 1),
                              ckpt.code2wav(CPU, BF16, dummy=True, seed=SEED + 2)])

    def old():
        return nn.ModuleList([_old(lambda: Qwen3OmniThinker.from_hf_dict(hf)),
                              _old(lambda: Qwen3OmniTalker.from_hf_dict(hf), seed=SEED + 1),
                              _old(lambda: Qwen3OmniCode2Wav(Qwen3OmniCode2WavConfig.from_hf_dict(hf)),
                                   seed=SEED + 2)])

    return new, old


def qwen3_omni_dirs(folder: Path):
    from mstar.model.qwen3_omni.checkpoint import (
        Qwen3OmniCode2Wav,
        Qwen3OmniCode2WavConfig,
        Qwen3OmniTalker,
        Qwen3OmniThinker,
        load_code2wav,
        load_code2wav_dir,
        load_talker,
        load_talker_dir,
        load_thinker,
        load_thinker_dir,
    )
    from mstar.model.weights import iter_safetensors
    from tests.support.qwen3_omni_dir import write_checkpoint

    write_checkpoint(folder)  # the released layout, real tensors: they are cast as they load
    hf = json.loads((folder / "config.json").read_text())

    def new():
        return nn.ModuleList([load_thinker_dir(folder, BF16), load_talker_dir(folder, BF16),
                              load_code2wav_dir(folder, BF16)])

    @torch.no_grad()
    def old():  # the helpers' former body: float32, cast, then filled with the tensors cast
        parts = [(Qwen3OmniThinker.from_hf_dict(hf), load_thinker), (Qwen3OmniTalker.from_hf_dict(hf), load_talker),
                 (Qwen3OmniCode2Wav(Qwen3OmniCode2WavConfig.from_hf_dict(hf)), load_code2wav)]
        for model, load in parts:
            load(model.to(BF16), iter_safetensors(folder), dtype=BF16)
        return nn.ModuleList([model.eval() for model, _ in parts])

    return new, old


def qwen3_asr(folder: Path):
    from mstar.model.qwen3_asr.checkpoint import Qwen3ASRCheckpoint
    from mstar.model.qwen3_asr.modeling import Qwen3ASRModel
    from tests.support.qwen3_asr import AUDIO, AUDIO_TOKEN, TEXT

    config = {"architectures": ["Qwen3ASRForConditionalGeneration"], "model_type": "qwen3_asr",
              "thinker_config": {"audio_config": dict(AUDIO), "text_config": dict(TEXT),
                                 "audio_token_id": AUDIO_TOKEN}}
    ckpt = Qwen3ASRCheckpoint.locate(_write(folder, config))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: Qwen3ASRModel(ckpt.config()))

    return new, old


def pi05(folder: Path):
    from mstar.model.pi05.checkpoint import Pi05Checkpoint
    from mstar.model.pi05.modeling import Pi05Policy
    from tests.support.pi05 import tiny_lerobot_config

    ckpt = Pi05Checkpoint.locate(_write(folder, tiny_lerobot_config()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: Pi05Policy(ckpt.config()))

    return new, old


def whisper(folder: Path):
    from transformers import WhisperConfig

    from mstar.model.whisper.checkpoint import WhisperCheckpoint
    from mstar.model.whisper.modeling import WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=448)
    ckpt = WhisperCheckpoint.locate(_write(folder, config.to_dict()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: WhisperForConditionalGeneration(ckpt.config()))

    return new, old


def qwen3_tts(folder: Path):
    from mstar.model.qwen3_tts.checkpoint import (
        DUMMY_CODEC_STD,
        Qwen3TTSCheckpoint,
        Qwen3TTSCodec,
        Qwen3TTSCodecEncoder,
        Qwen3TTSSpeakerEncoder,
        Qwen3TTSTalker,
    )
    from tests.support.qwen3_tts_dir import write_checkpoint

    ckpt = Qwen3TTSCheckpoint.locate(str(write_checkpoint(folder, variant="base")), dummy=True)

    def new():
        return nn.ModuleList([ckpt.talker(CPU, BF16, dummy=True, seed=SEED),
                              ckpt.speaker_encoder(CPU, BF16, dummy=True, seed=SEED + 1),
                              ckpt.codec(CPU, BF16, dummy=True, seed=SEED + 2),
                              ckpt.codec_encoder(CPU, BF16, dummy=True, seed=SEED + 3)])

    @torch.no_grad()
    def old():  # the codec's and its encoder's dummy draws, as the checkpoint makes them
        codec = _old(lambda: Qwen3TTSCodec(ckpt.codec_config()), seed=SEED + 2)
        init_dummy_weights(codec, seed=SEED + 2, std=DUMMY_CODEC_STD)
        for name, p in codec.named_parameters():
            if name.endswith("cluster_usage"):
                p.fill_(1.0)
        encoder = _old(lambda: Qwen3TTSCodecEncoder(ckpt.codec_encoder_config()), seed=SEED + 3)
        init_dummy_weights(encoder, seed=SEED + 3, std=DUMMY_CODEC_STD)
        gen = torch.Generator().manual_seed(SEED + 3)
        for name, buf in encoder.named_buffers():
            if name.endswith("embed_sum"):
                buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
        return nn.ModuleList([_old(lambda: Qwen3TTSTalker(ckpt.config().talker)),
                              _old(lambda: Qwen3TTSSpeakerEncoder(ckpt.config().speaker_encoder), seed=SEED + 1),
                              codec, encoder])

    return new, old


def higgs_audio(folder: Path):
    from mstar.model.higgs_audio.checkpoint import HiggsAudioCheckpoint, HiggsAudioModel
    from tests.support.higgs_audio import release_config

    ckpt = HiggsAudioCheckpoint.locate(_write(folder, release_config()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: HiggsAudioModel(ckpt.config()))

    return new, old


def canary_qwen(folder: Path):
    from mstar.model.canary_qwen.checkpoint import CanaryQwenCheckpoint, CanaryQwenModel
    from tests.support.fastconformer import canary_qwen_nemo_config, qwen_config

    (folder / "llm").mkdir()
    (folder / "llm" / "config.json").write_text(qwen_config().to_json_string())  # the LLM's files beside it
    ckpt = CanaryQwenCheckpoint.locate(_write(folder, canary_qwen_nemo_config()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: CanaryQwenModel(ckpt.config()))

    return new, old


def fish_s2_pro(folder: Path):
    from mstar.model.fish_s2_pro.checkpoint import DualAR, FishS2ProCheckpoint
    from tests.support.fish_s2_pro import write_release

    ckpt = FishS2ProCheckpoint.locate(str(write_release(folder)))

    def new():
        return ckpt.dual_ar(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: DualAR(ckpt.config()))

    return new, old


def fastconformer(folder: Path):
    from transformers import ParakeetTDTConfig

    from mstar.model.fastconformer.checkpoint import TransducerCheckpoint, TransducerModel
    from tests.support.fastconformer import BLANK, ENCODER, VOCAB

    config = ParakeetTDTConfig(encoder_config=ENCODER, vocab_size=VOCAB, blank_token_id=BLANK, pad_token_id=2,
                               decoder_hidden_size=24, num_decoder_layers=2, durations=[0, 1, 2, 3, 4])
    ckpt = TransducerCheckpoint.locate(_write(folder, config.to_dict()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: TransducerModel(ckpt.config()))

    return new, old


def canary(folder: Path):
    from transformers import CanaryConfig

    from mstar.model.canary.checkpoint import CanaryCheckpoint, CanaryForConditionalGeneration
    from tests.support.fastconformer import CANARY_VOCAB, ENCODER

    decoder = dict(vocab_size=CANARY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=128)
    config = CanaryConfig(encoder_config=dict(ENCODER, scale_input=False), decoder_config=decoder,
                          vocab_size=CANARY_VOCAB)
    ckpt = CanaryCheckpoint.locate(_write(folder, config.to_dict()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        return _old(lambda: CanaryForConditionalGeneration(ckpt.config()))

    return new, old


def omniasr(folder: Path):
    from mstar.model.omniasr.checkpoint import OmniAsrCheckpoint, OmniAsrCtc
    from tests.model.omniasr.test_omniasr_checkpoint import TINY

    ckpt = OmniAsrCheckpoint.locate("300m", None)

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED, config=TINY)

    def old():
        return _old(lambda: OmniAsrCtc(TINY))

    return new, old


def vjepa2(folder: Path):
    from transformers import VJEPA2Config

    from mstar.model.vjepa2.checkpoint import VJEPA2Checkpoint, VJEPA2Model
    from tests.model.test_vjepa2_parity import HF_TINY

    ckpt = VJEPA2Checkpoint.locate(_write(folder, VJEPA2Config(**HF_TINY).to_dict()))

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():
        config = ckpt.config()
        return _old(lambda: VJEPA2Model(config.encoder, config.predictor))

    return new, old


def waypoint(folder: Path):
    import yaml

    from mstar.model.waypoint.checkpoint import TAEHV, WaypointCheckpoint, WorldDiT
    from tests.support.waypoint import TINY_DIT, TINY_TAEHV

    (folder / "config.yaml").write_text(yaml.safe_dump({**TINY_DIT, "ae_uri": "ae"}))
    (folder / "ae").mkdir()
    _write(folder / "ae", TINY_TAEHV)
    ckpt = WaypointCheckpoint.locate(str(folder))

    def new():
        return nn.ModuleList([ckpt.load_dit(CPU, BF16, dummy=True, seed=SEED),
                              ckpt.load_taehv(CPU, BF16, dummy=True, seed=SEED + 1)])

    def old():
        dit = _old(lambda: WorldDiT(ckpt.config()))
        dit.denoise_step_emb.float()  # float32 in any deployment: cast back after the fill
        return nn.ModuleList([dit, _old(lambda: TAEHV(ckpt.ae_config()), seed=SEED + 1)])

    return new, old


def omnivoice(folder: Path):
    from mstar.model.omnivoice.backbone import OmniVoiceBackbone
    from mstar.model.omnivoice.checkpoint import OmniVoiceCheckpoint, unit_gain_weights
    from mstar.model.omnivoice.modeling import Codec, OmniVoiceModel
    from tests.support.omnivoice import write_tiny_release

    ckpt = OmniVoiceCheckpoint.locate(str(write_tiny_release(folder)))
    config = ckpt.config()

    def new():
        return ckpt.load_model(CPU, BF16, dummy=True, seed=SEED)

    def old():  # the backbone cast, then drawn; the codec float32 in any deployment
        with torch.device(CPU):
            codec = Codec(config.codec)
        unit_gain_weights(codec, SEED + 1)
        return OmniVoiceModel(config, _old(lambda: OmniVoiceBackbone(config)), codec.eval())

    return new, old


def kokoro(folder: Path):
    from mstar.model.kokoro import KokoroConfig, KokoroModel
    from mstar.model.kokoro.checkpoint import dummy_model
    from tests.support.kokoro import TINY_CONFIG

    config = KokoroConfig.from_dict(TINY_CONFIG)

    def new():
        return dummy_model(config, CPU, seed=SEED, dtype=BF16)

    def old():
        return _old(lambda: KokoroModel(config))

    return new, old


def chatterbox_t3(folder: Path):
    from mstar.model.chatterbox.t3 import T3
    from mstar.model.chatterbox.t3_checkpoint import load_t3
    from tests.chatterbox.tiny import tiny_config

    configs = [tiny_config(variant) for variant in ("english", "multilingual", "turbo")]  # Llama, GPT-2

    def new():
        return nn.ModuleList([load_t3(None, config, device=CPU, dtype=BF16, dummy=True, seed=SEED + i)
                              for i, config in enumerate(configs)])

    @torch.no_grad()
    def old():
        models = nn.ModuleList([_old(lambda c=config: T3(c), seed=SEED + i) for i, config in enumerate(configs)])
        for module in models.modules():  # as load_t3 sets GPT-2's layer-norm scales after the draw
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
        return models

    return new, old


def cosyvoice3(folder: Path):
    from mstar.model.cosyvoice3 import CosyVoice3Flow, SpeechLM
    from mstar.model.cosyvoice3.serving import build_parts, tiny_configs

    lm_config, flow_config, _ = tiny_configs()

    def new():  # the LM and the flow's DiT in bf16, the rest of the flow float32 (HiFT float32, not here)
        parts = build_parts(None, dummy=True, scale="tiny", seed=SEED, device=CPU, lm_dtype=BF16,
                            estimator_dtype=BF16)
        return nn.ModuleList([parts.lm, parts.flow])

    def set_estimator_dtype(flow: nn.Module) -> nn.Module:  # the flow's former cast of its DiT
        inv_freq = flow.estimator.rotary_inv_freq.float()
        flow.estimator.to(BF16)
        flow.estimator.rotary_inv_freq = inv_freq
        return flow

    @torch.no_grad()
    def old():
        lm = _old(lambda: SpeechLM(lm_config))
        lm.llm_decoder.weight[lm_config.speech_token_size:] *= 0.1
        return nn.ModuleList([lm, _old(lambda: CosyVoice3Flow(flow_config), cast=set_estimator_dtype, seed=SEED + 1)])

    return new, old


# the diffusers-layout families: each component built by DiffusersCheckpoint.load from a factory


def _components(folder: Path, configs: dict[str, dict]) -> Path:
    """A diffusers-layout folder: one ``<component>/config.json`` each (dummy weights)."""
    for name, config in configs.items():
        (folder / name).mkdir(parents=True)
        _write(folder / name, config)
    return folder


def _old_diffusers(make: Callable[[], nn.Module], seed: int, fp32: tuple[str, ...] = (),
                   dtype: torch.dtype = BF16) -> nn.Module:
    """The old ``DiffusersCheckpoint.load``: float32 on the CPU, ``.to(device, dtype)``, the
    ``fp32`` names cast back, then the seeded draw."""
    with torch.device(CPU):
        model = make()
    model = model.to(device=CPU, dtype=dtype)
    for name, param in model.named_parameters():
        if set(fp32) & set(name.split(".")):
            param.data = param.data.float()
    init_dummy_weights(model, seed=seed)
    return model.eval()


def _load(ckpt, make, folder: str, offset: int, *, dtype: torch.dtype = BF16, **options) -> nn.Module:
    return ckpt.load(make, folder, device=CPU, dtype=dtype, dummy=True, seed=SEED + offset, **options)


def wan22(folder: Path):
    from mstar.model.wan22.checkpoint import WanCheckpoint
    from mstar.model.wan22.engine import FP32_PARAMETERS
    from mstar.model.wan22.text import WanText
    from mstar.model.wan22.transformer import WanTransformer
    from mstar.model.wan22.umt5 import UMT5Encoder
    from mstar.model.wan22.vae import WanVAE
    from tests.model.wan22.conftest import DIT, UMT5, VAE

    ckpt = WanCheckpoint(_components(folder, {"transformer": DIT, "vae": VAE,
                                              "text_encoder": dict(UMT5, vocab_size=64)}))

    def new():  # the VAE at its default vae_dtype, float32
        return nn.ModuleList([
            _load(ckpt, lambda: WanTransformer(ckpt.transformer_config()), "transformer", 2, fp32=FP32_PARAMETERS),
            _load(ckpt, lambda: WanVAE(ckpt.vae_config()), "vae", 3, dtype=torch.float32),
            _load(ckpt, WanText(None, ckpt.text_config()).build_encoder, "text_encoder", 1)])

    def old():
        return nn.ModuleList([
            _old_diffusers(lambda: WanTransformer(ckpt.transformer_config()), SEED + 2, FP32_PARAMETERS),
            _old_diffusers(lambda: WanVAE(ckpt.vae_config()), SEED + 3, dtype=torch.float32),
            _old_diffusers(lambda: UMT5Encoder(ckpt.text_config()), SEED + 1)])

    return new, old


def cosmos3(folder: Path):
    from transformers import Cosmos3EdgeConfig

    from mstar.model.cosmos3.checkpoint import Cosmos3Checkpoint
    from mstar.model.cosmos3.engine import FP32_PARAMETERS
    from mstar.model.cosmos3.reasoner import Cosmos3Vision
    from mstar.model.cosmos3.sound_tokenizer import Cosmos3SoundTokenizer
    from mstar.model.cosmos3.transformer import Cosmos3Transformer
    from mstar.model.wan22.vae import WanVAE
    from tests.model.cosmos3.conftest import TOWER, VAE
    from tests.model.cosmos3.test_cosmos3_reasoner import REASONER, TEXT, VISION
    from tests.support.cosmos3_sound import SOUND

    reasoner = Cosmos3EdgeConfig(text_config=TEXT, vision_config=VISION, **REASONER).to_dict()
    ckpt = Cosmos3Checkpoint(_components(folder, {"transformer": TOWER, "vae": VAE, "reasoner": reasoner,
                                                  "sound_tokenizer": SOUND}))
    hidden = TOWER["hidden_size"]

    def new():  # the VAE at its default vae_dtype and the sound tokenizer float32, as served
        return nn.ModuleList([
            _load(ckpt, lambda: Cosmos3Transformer(ckpt.transformer_config()), "transformer", 0,
                  fp32=FP32_PARAMETERS),
            _load(ckpt, lambda: WanVAE(ckpt.vae_config()), "vae", 1, dtype=torch.float32),
            Cosmos3Vision.load(folder, hidden, device=CPU, dtype=BF16, dummy=True, seed=SEED + 2),
            ckpt.load_sound_tokenizer(device=CPU, dtype=torch.float32, dummy=True, seed=SEED + 3)])

    def old():
        return nn.ModuleList([
            _old_diffusers(lambda: Cosmos3Transformer(ckpt.transformer_config()), SEED, FP32_PARAMETERS),
            _old_diffusers(lambda: WanVAE(ckpt.vae_config()), SEED + 1, dtype=torch.float32),
            _old_diffusers(lambda: Cosmos3Vision(Cosmos3Vision.read_config(folder, hidden)), SEED + 2),
            _old_diffusers(lambda: Cosmos3SoundTokenizer(ckpt.sound_tokenizer_config(), encoder=False), SEED + 3,
                           dtype=torch.float32)])

    return new, old


def flux2(folder: Path):
    from mstar.model.flux2.checkpoint import Flux2Checkpoint
    from mstar.model.flux2.text import KleinText
    from mstar.model.flux2.transformer import Flux2Transformer
    from mstar.model.flux2.vae import Flux2VAE
    from mstar.model.qwen3 import Qwen3Config
    from mstar.model.qwen3.encoder import Qwen3TextEncoder
    from tests.model.test_flux2_parity import TINY as DIT
    from tests.model.test_flux2_vae_parity import TINY as VAE
    from tests.model.z_image.conftest import QWEN

    ckpt = Flux2Checkpoint(_components(folder, {"transformer": DIT, "vae": VAE}))
    text = KleinText(None, Qwen3Config.from_hf_dict(dict(QWEN, vocab_size=64)), tap_layers=(1, 2, 3))

    def new():
        return nn.ModuleList([_load(ckpt, lambda: Flux2Transformer(ckpt.transformer_config()), "transformer", 2),
                              _load(ckpt, lambda: Flux2VAE(ckpt.vae_config()), "vae", 3),
                              _load(ckpt, text.build_encoder, "text_encoder", 1)])

    def old():
        return nn.ModuleList([
            _old_diffusers(lambda: Flux2Transformer(ckpt.transformer_config()), SEED + 2),
            _old_diffusers(lambda: Flux2VAE(ckpt.vae_config()), SEED + 3),
            _old_diffusers(lambda: Qwen3TextEncoder(text.config, tap_layers=(1, 2, 3)), SEED + 1)])

    return new, old


def z_image(folder: Path):
    from mstar.model.z_image.checkpoint import ZImageCheckpoint
    from mstar.model.z_image.transformer import ZImageTransformer
    from mstar.model.z_image.vae import ZImageVAE
    from tests.model.z_image.conftest import DIT, VAE

    ckpt = ZImageCheckpoint(_components(folder, {"transformer": DIT, "vae": VAE}))

    def new():
        return nn.ModuleList([_load(ckpt, lambda: ZImageTransformer(ckpt.transformer_config()), "transformer", 2),
                              _load(ckpt, lambda: ZImageVAE(ckpt.vae_config()), "vae", 3)])

    def old():
        return nn.ModuleList([_old_diffusers(lambda: ZImageTransformer(ckpt.transformer_config()), SEED + 2),
                              _old_diffusers(lambda: ZImageVAE(ckpt.vae_config()), SEED + 3)])

    return new, old


def lingbot(folder: Path):
    from mstar.model.lingbot.checkpoint import LingbotCheckpoint, LingbotTransformer
    from mstar.model.wan22.vae import WanVAE
    from tests.model.lingbot.test_lingbot_dit import tiny
    from tests.model.lingbot.test_lingbot_engine import VAE

    vae = dict(VAE, z_dim=16, latents_mean=[0.1] * 16, latents_std=[1.5] * 16)  # the Wan2.1 VAE's z_dim
    ckpt = LingbotCheckpoint(folder, DiffusersCheckpoint(_components(folder / "assets", {"vae": vae})))
    config = tiny()

    def new():  # the VAE float32 in any deployment
        return nn.ModuleList([ckpt.load_dit(config, device=CPU, dtype=BF16, dummy=True, seed=SEED),
                              _load(ckpt.assets, lambda: WanVAE(ckpt.vae_config()), "vae", 1, dtype=torch.float32)])

    def old():
        return nn.ModuleList([
            _old_diffusers(lambda: LingbotTransformer(config), SEED, ("time_embedder", "scale_shift_table")),
            _old_diffusers(lambda: WanVAE(ckpt.vae_config()), SEED + 1, dtype=torch.float32)])

    return new, old


def ltx2_5(folder: Path):
    from transformers import Gemma4UnifiedTextConfig

    from mstar.model.ltx2_5.checkpoint import LtxCheckpoint
    from mstar.model.ltx2_5.engine import SEEDS, build_component
    from tests.model.ltx2_5.conftest import CONNECTORS, DIT, GEMMA
    from tests.support.ltx2_5_tiny import AUDIO_VAE, VAE, VOCODER

    text = {"model_type": "gemma4_unified", "text_config": Gemma4UnifiedTextConfig(**GEMMA).to_dict()}
    ckpt = LtxCheckpoint(_components(folder, {
        "text_encoder": text, "connectors": CONNECTORS, "transformer": DIT, "vae": VAE, "audio_vae": AUDIO_VAE,
        "vocoder": {"_class_name": "LTX2VocoderWithBWE", **VOCODER}}))

    def new():
        return nn.ModuleList([build_component(ckpt, name, lambda make, folder, offset, **options:
                                              _load(ckpt, make, folder, offset,
                                                    **options))
                              for name in sorted(SEEDS)])

    def old():
        return nn.ModuleList([build_component(ckpt, name, lambda make, folder, offset, **options:
                                              _old_diffusers(make, SEED + offset))
                              for name in sorted(SEEDS)])

    return new, old


FAMILIES = {f.__name__: f for f in (command_a_plus, glm52, qwen3_5, nemotron_h, llama, bagel, qwen3_omni,
                                    qwen3_omni_dirs, qwen3_asr, pi05, whisper, qwen3_tts, higgs_audio, canary_qwen,
                                    fish_s2_pro, fastconformer, canary, omniasr, vjepa2, waypoint, omnivoice, kokoro,
                                    chatterbox_t3, cosyvoice3, wan22, cosmos3, flux2, z_image, lingbot, ltx2_5)}


# ----------------------------------------------------------------------------- the check


def tensors_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer (persistent or not) and plain tensor attribute, by qualified name."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        head = prefix + "." if prefix else ""
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not name.startswith("__"):
                out[head + name] = value
        for name, value in module._parameters.items():
            if value is not None:
                out[head + name] = value
        for name, value in module._buffers.items():
            if value is not None:
                out[head + name] = value
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_build_is_bitwise_the_old_one_and_never_float32(family: str, tmp_path: Path) -> None:
    new, old = FAMILIES[family](tmp_path)
    before = torch.get_default_dtype()
    with Registrations() as seen:
        built = new()
    assert torch.get_default_dtype() == before == torch.float32
    want = old()
    got, ref = tensors_of(built), tensors_of(want)
    assert sorted(got) == sorted(ref)
    assert any(p.dtype == BF16 for p in built.parameters())
    for name, value in ref.items():
        assert got[name].dtype == value.dtype, (name, got[name].dtype, value.dtype)
        assert got[name].shape == value.shape, name
        assert got[name].device == value.device, name
        assert torch.equal(got[name], value), name
    # the hooks saw every parameter made; a float32 one only where the old build kept float32
    names = {id(m): prefix for prefix, m in built.named_modules(remove_duplicate=False)}

    def made(kind: list[tuple[nn.Module, str, torch.dtype]]) -> set[str]:
        return {".".join(filter(None, (names[id(m)], n))) for m, n, d in kind
                if d == torch.float32 and id(m) in names}

    assert len(seen.params) >= len(list(built.parameters())) > 0
    kept = {name for name, p in want.named_parameters() if p.dtype == torch.float32}
    assert made(seen.params) <= kept, sorted(made(seen.params) - kept)
    kept = {name for name, b in want.named_buffers() if b.dtype == torch.float32}
    assert made(seen.buffers) <= kept, sorted(made(seen.buffers) - kept)
