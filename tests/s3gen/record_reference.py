"""Record ``tests/s3gen/fixtures/``: Chatterbox's own S3Gen modules on tiny random configs, for
the tests beside this script (a script, not collected by pytest).

The reference is ``chatterbox-tts==0.1.7`` (``chatterbox.models.s3gen``). It pins torch 2.6 and
numpy < 2, but its S3Gen modules run on torch 2.13 as they are; what it imports beyond the
project's packages is ``librosa`` (the mel filterbank), ``onnx`` and ``s3tokenizer`` (imported
by the tokenizer module), ``conformer`` and ``omegaconf``. torchaudio has no build for torch
2.13: this script registers an empty stand-in, which is enough because the paths recorded
here never resample or compute fbanks (the speaker encoder and tokenizer are bypassed: the
x-vector and the prompt's speech tokens are given). ``chatterbox/__init__.py`` imports the
whole TTS stack (perth, transformers models); the script imports the ``chatterbox`` package
without running it. Recorded with a private venv that sees the project's torch 2.13.0::

    python3 -m venv /tmp/cbxvenv
    echo /work/main/.venv/lib/python3.11/site-packages > /tmp/cbxvenv/lib/python3.11/site-packages/zz_project.pth
    /tmp/cbxvenv/bin/pip install --no-deps chatterbox-tts==0.1.7 conformer==0.3.2 s3tokenizer==0.3.0 omegaconf
    /tmp/cbxvenv/bin/pip install librosa onnx      # librosa 0.11.0, onnx 1.20
    /tmp/cbxvenv/bin/python tests/s3gen/record_reference.py

Files (float32, CPU):

- ``encoder.pt``: a tiny ``UpsampleConformerEncoder`` (its pre-look-ahead layer and 2x
  upsampler rebuilt at the tiny width: the reference hard-codes 512 channels for them), its
  state dict, two padded rows in and the encoded frames and mask out; also the frames of
  CosyVoice2's own copy of the class (``cosyvoice-minicpmo==0.1.0``, installed in the project
  venv ``--no-deps``; its package imports torchaudio, hence not tested live) on the same
  weights;
- ``mel.pt``: ``utils.mel.mel_spectrogram`` (the prompt clip's 80-bin log-mel at 24 kHz) of two
  random clips, and librosa's filterbank it multiplies by;
- ``token2wav.pt``: a tiny ``S3Token2Wav`` (the released class, its flow and vocoder swapped
  for tiny ones of the same classes) with its state dict in the released layout (weight-norm
  parametrizations included), the inputs (speech tokens, prompt tokens, prompt clip, x-vector,
  seed) and the outputs: ``flow_inference``'s mel and ``inference``'s
  waveform; the global generator is seeded with ``seed`` before each call, and the reference
  draws the flow's noise (``randn_like``) and then the vocoder source's phases and noise from it;
- ``turbo.pt``: the same for Chatterbox Turbo's S3Gen (``meanflow=True``: the estimator mixes
  the embeddings of both ends of each step; two plain Euler steps on a linear schedule, no
  guidance); the reference draws the new frames' noise first, then the whole field, and keeps
  the whole field's draws for the prompt's frames only;
- ``s3gen_keys.json``: the names and shapes of the released-size ``S3Token2Wav``'s ``flow.`` and
  ``mel2wav.`` tensors (the layout of ``s3gen.safetensors``), how many tensors sit under
  each other prefix, and the tensors Turbo's ``s3gen_meanflow.safetensors`` adds.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types
from collections import Counter
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures"
SEED = 1234
ENCODER = dict(input_size=16, output_size=16, attention_heads=2, linear_units=24, num_blocks=2, dropout_rate=0.0,
               positional_dropout_rate=0.0, attention_dropout_rate=0.0, normalize_before=True, input_layer="linear",
               pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", use_cnn_module=False,
               macaron_style=False)
ESTIMATOR = dict(in_channels=320, out_channels=80, causal=True, channels=[8], dropout=0.0, attention_head_dim=8,
                 n_blocks=1, num_mid_blocks=1, num_heads=2, act_fn="gelu")
HIFT = dict(sampling_rate=24000, in_channels=80, base_channels=16, upsample_rates=[8, 5, 3],
            upsample_kernel_sizes=[16, 11, 7], source_resblock_kernel_sizes=[7, 7, 11],
            source_resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5], [1, 3, 5]])
F0_CHANNELS = 16
VOCAB, SPEAKER = 50, 12


def reference():
    """``chatterbox.models.s3gen``'s modules, imported without the package's ``__init__``."""
    spec = importlib.util.find_spec("chatterbox")
    package = types.ModuleType("chatterbox")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["chatterbox"] = package
    torchaudio = types.ModuleType("torchaudio")
    torchaudio.__path__ = []
    torchaudio.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
    compliance = types.ModuleType("torchaudio.compliance")
    compliance.__path__ = []
    kaldi = types.ModuleType("torchaudio.compliance.kaldi")
    torchaudio.compliance, compliance.kaldi = compliance, kaldi
    sys.modules.update({"torchaudio": torchaudio, "torchaudio.compliance": compliance,
                        "torchaudio.compliance.kaldi": kaldi})
    from chatterbox.models.s3gen import (
        decoder,
        f0_predictor,
        flow,
        flow_matching,
        hifigan,
        s3gen,
    )
    from chatterbox.models.s3gen.transformer import upsample_encoder
    from chatterbox.models.s3gen.utils import mel
    return types.SimpleNamespace(decoder=decoder, f0_predictor=f0_predictor, flow=flow, flow_matching=flow_matching,
                                 hifigan=hifigan, s3gen=s3gen, upsample_encoder=upsample_encoder, mel=mel)


def perturb(module: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Every parameter off its initial value (LayerNorm affines, weight-norm magnitudes...)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def tiny_encoder(ref) -> torch.nn.Module:
    enc = ref.upsample_encoder.UpsampleConformerEncoder(**ENCODER)
    width = ENCODER["output_size"]
    enc.pre_lookahead_layer = ref.upsample_encoder.PreLookaheadLayer(channels=width, pre_lookahead_len=3)
    enc.up_layer = ref.upsample_encoder.Upsample1D(channels=width, out_channels=width, stride=2)
    perturb(enc, 0, scale=0.2)
    return enc.eval()


def record_encoder(ref) -> dict:
    torch.manual_seed(0)  # the modules' initial values
    enc = tiny_encoder(ref)
    torch.manual_seed(1)
    xs, lens = torch.randn(2, 9, ENCODER["input_size"]), torch.tensor([9, 6])
    xs[1, 6:] = 0  # padding is zero, as the flow's masked token embedding leaves it
    with torch.no_grad():
        out, masks = enc(xs, lens)
    return dict(config=ENCODER, state=enc.state_dict(), xs=xs, lens=lens, out=out, masks=masks,
                out_cosyvoice=cosyvoice_encoder(enc.state_dict(), xs, lens))


def cosyvoice_encoder(state: dict, xs: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """CosyVoice2's own ``UpsampleConformerEncoder`` (``cosyvoice-minicpmo==0.1.0``, of which
    Chatterbox's is a copy without the streaming context) on the same weights and rows."""
    from cosyvoice.transformer import upsample_encoder

    enc = upsample_encoder.UpsampleConformerEncoder(**ENCODER)
    width = ENCODER["output_size"]
    enc.pre_lookahead_layer = upsample_encoder.PreLookaheadLayer(channels=width, pre_lookahead_len=3)
    enc.up_layer = upsample_encoder.Upsample1D(channels=width, out_channels=width, stride=2)
    enc.load_state_dict(state)
    with torch.no_grad():
        out, _ = enc.eval()(xs, lens)
    return out


def record_mel(ref) -> dict:
    import librosa
    torch.manual_seed(2)
    clips = [0.9 * (2 * torch.rand(1, 9600) - 1), 0.5 * torch.sin(torch.arange(12345) * 0.05)[None]]
    mels = [ref.mel.mel_spectrogram(clip) for clip in clips]
    bank = librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80, fmin=0, fmax=8000)
    return dict(clips=clips, mels=mels, filterbank=torch.from_numpy(bank).float(), librosa=librosa.__version__)


def tiny_token2wav(ref, meanflow: bool = False) -> torch.nn.Module:
    """The released ``S3Token2Wav`` with its flow and vocoder rebuilt at a tiny size."""
    model = ref.s3gen.S3Token2Wav(meanflow=meanflow).eval()
    estimator = ref.decoder.ConditionalDecoder(**ESTIMATOR, meanflow=meanflow)
    cfm = ref.flow_matching.CausalConditionalCFM(spk_emb_dim=80, estimator=estimator)
    model.flow = ref.flow.CausalMaskedDiffWithXvec(input_size=ENCODER["output_size"], output_size=80,
                                                   spk_embed_dim=SPEAKER, vocab_size=VOCAB,
                                                   encoder=tiny_encoder(ref), decoder=cfm)
    f0 = ref.f0_predictor.ConvRNNF0Predictor(in_channels=80, cond_channels=F0_CHANNELS)
    model.mel2wav = ref.hifigan.HiFTGenerator(f0_predictor=f0, **HIFT)
    perturb(model.flow, 3)
    perturb(model.mel2wav, 4)
    with torch.no_grad():
        model.mel2wav.f0_predictor.classifier.bias.fill_(150.0)  # voiced: F0 around 150 Hz
    return model.eval()


def record_token2wav(ref, meanflow: bool = False) -> dict:
    """``meanflow``: Chatterbox Turbo's S3Gen (``S3Gen(meanflow=True)`` in ``tts_turbo.py``),
    run as Turbo runs it: ``inference(..., n_cfm_timesteps=2)``."""
    torch.manual_seed(0)  # the modules' initial values
    model = tiny_token2wav(ref, meanflow)
    steps = 2 if meanflow else None
    g = torch.Generator().manual_seed(5)
    prompt_clip = 0.8 * (2 * torch.rand(1, 4800, generator=g) - 1)  # 0.2 s: 10 mel frames
    prompt_mel = ref.mel.mel_spectrogram(prompt_clip).transpose(1, 2)
    prompt_tokens = torch.randint(0, VOCAB, (1, prompt_mel.shape[1] // 2), generator=g)
    tokens = torch.randint(0, VOCAB, (1, 9), generator=g)
    xvector = torch.randn(1, SPEAKER, generator=g)

    def ref_dict() -> dict:
        return dict(prompt_token=prompt_tokens.clone(), prompt_token_len=torch.tensor([prompt_tokens.shape[1]]),
                    prompt_feat=prompt_mel.clone(), prompt_feat_len=None, embedding=xvector.clone())

    # finalize=False (drop the look-ahead tokens' frames) fails inside the reference: it cuts
    # the encoder output but not the mask made from the encoder's lengths.
    torch.manual_seed(SEED)
    mel = model.flow_inference(tokens, ref_dict=ref_dict(), finalize=True, n_cfm_timesteps=steps)
    torch.manual_seed(SEED)
    wave, source = model.inference(tokens, ref_dict=ref_dict(), n_cfm_timesteps=steps)
    state = {k: v for k, v in model.state_dict().items() if k.startswith(("flow.", "mel2wav."))}
    return dict(config=dict(encoder=ENCODER, estimator=ESTIMATOR, hift=HIFT, f0_channels=F0_CHANNELS, vocab=VOCAB,
                            speaker=SPEAKER),
                state=state, seed=SEED, prompt_clip=prompt_clip, prompt_mel=prompt_mel, prompt_tokens=prompt_tokens,
                tokens=tokens, xvector=xvector, mel=mel, wave=wave, source=source, n_cfm_timesteps=steps or 10,
                meanflow=meanflow)


def released_keys(ref) -> dict:
    state = ref.s3gen.S3Token2Wav().state_dict()
    ours = {k: list(v.shape) for k, v in state.items() if k.startswith(("flow.", "mel2wav."))}
    others = Counter(k.split(".")[0] for k in state if not k.startswith(("flow.", "mel2wav.")))
    turbo = {k: list(v.shape) for k, v in ref.s3gen.S3Token2Wav(meanflow=True).state_dict().items()}
    assert set(state) <= set(turbo)
    return dict(tensors=ours, other_prefixes=dict(others),
                meanflow_extra={k: shape for k, shape in turbo.items() if k not in state})


if __name__ == "__main__":
    ref = reference()
    FIXTURES.mkdir(exist_ok=True)
    records = (("encoder", record_encoder), ("mel", record_mel), ("token2wav", record_token2wav),
               ("turbo", lambda r: record_token2wav(r, meanflow=True)))
    for name, record in records:
        path = FIXTURES / f"{name}.pt"
        torch.save(record(ref), path)
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    keys = FIXTURES / "s3gen_keys.json"
    keys.write_text(json.dumps(released_keys(ref), indent=0) + "\n")
    print(f"wrote {keys} ({keys.stat().st_size} bytes)")
