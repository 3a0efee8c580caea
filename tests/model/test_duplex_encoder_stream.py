"""The duplex encoder streamed: the front end and the causal FastConformer run append by
append equal the offline pass over the whole call (the same lookahead-0, left-context
attention), fp32 on the CPU, for several chunkings."""

from __future__ import annotations

import pytest
import torch

from mstar.model.fastconformer.config import FastConformerConfig
from mstar.model.fastconformer.encoder import FastConformerEncoder
from mstar.model.fastconformer.features import MelSettings, log_mel
from mstar.model.fastconformer.stream import EncoderStream
from mstar.model.nemotron_duplex.features import MelStream, duplex_log_mel, duplex_settings

N_MELS = 16


def tiny_encoder(left_context: int) -> FastConformerEncoder:
    torch.manual_seed(0)
    config = FastConformerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 conv_kernel_size=9, subsampling_conv_channels=8, num_mel_bins=N_MELS,
                                 causal=True, left_context=left_context, default_lookahead=0)
    encoder = FastConformerEncoder(config).eval()
    with torch.no_grad():  # no zero biases: every term of the block counts
        for p in encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return encoder


def clip(seconds: float, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(int(16000 * seconds), generator=g)


def chunks(samples: torch.Tensor, sizes) -> list[torch.Tensor]:
    out, at, i = [], 0, 0
    while at < samples.shape[0]:
        size = sizes[i % len(sizes)]
        out.append(samples[at:at + size])
        at, i = at + size, i + 1
    return out


def test_offline_front_end_is_the_reflected_centred_stft():
    """``N // 160 + 1`` frames, reflected edges; the interior equals the shared front end's."""
    settings = duplex_settings(N_MELS)
    wave = clip(0.5)
    mel = duplex_log_mel(wave, settings)
    assert mel.shape == (wave.shape[0] // 160 + 1, N_MELS)
    shared = log_mel(wave, MelSettings(n_mels=N_MELS, normalize=False))  # zero-padded edges, N // 160 frames
    torch.testing.assert_close(mel[2:-2], shared[2:mel.shape[0] - 2], rtol=0, atol=1e-5)
    assert not torch.allclose(mel[0], shared[0], atol=1e-3)  # the edge differs: reflected, not zeros


@pytest.mark.parametrize("sizes", [[1280], [160], [7, 999, 3000, 1], [20000], [400, 1280, 2561]])
def test_streamed_mel_frames_equal_the_offline_pass(sizes):
    settings = duplex_settings(N_MELS)
    wave = clip(1.3)
    stream = MelStream(settings)
    parts = [stream.push(part) for part in chunks(wave, sizes)] + [stream.end()]
    torch.testing.assert_close(torch.cat(parts), duplex_log_mel(wave, settings), rtol=0, atol=2e-6)
    assert stream.y.shape[0] <= 2 * 512  # it keeps only what later frames read


def test_front_ends_pushed_together_equal_each_alone():
    """``push_many``: calls of different chunkings, one ending mid-way, with their STFTs batched
    where their signals are equally long, give each call's own frames."""
    from mstar.model.nemotron_duplex.features import push_many

    settings = duplex_settings(N_MELS)
    waves = [clip(0.9, seed=s) for s in (1, 2, 3)]
    cuts = [chunks(w, sizes) for w, sizes in zip(waves, [[1280], [1280], [700, 1280, 3000]])]
    together, alone = [MelStream(settings) for _ in waves], [MelStream(settings) for _ in waves]
    got: list[list[torch.Tensor]] = [[] for _ in waves]
    want: list[list[torch.Tensor]] = [[] for _ in waves]
    for step in range(max(len(c) for c in cuts)):
        calls = [i for i, c in enumerate(cuts) if step < len(c)]
        ends = [step == len(cuts[i]) - 1 for i in calls]
        outs = push_many([together[i] for i in calls], [cuts[i][step] for i in calls], ends)
        for i, end, out in zip(calls, ends, outs):
            got[i].append(out)
            want[i].append(alone[i].push(cuts[i][step]))
            if end:
                want[i].append(alone[i].end())
    for g, w, wave in zip(got, want, waves):
        torch.testing.assert_close(torch.cat(g), torch.cat(w), rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.cat(g), duplex_log_mel(wave, settings), rtol=0, atol=2e-6)


def test_a_clip_too_short_to_featurize_is_refused():
    stream = MelStream(duplex_settings(N_MELS))
    stream.push(torch.zeros(256))
    with pytest.raises(ValueError, match="too short"):
        stream.end()


CUTS = [[1280], [1280 * 3 + 17, 640], [50, 4000, 333], [16000 * 6]]


@pytest.mark.parametrize(("left_context", "sizes"), [(70, CUTS[0]), (70, CUTS[1]), (70, CUTS[3])]
                         + [(6, sizes) for sizes in CUTS])
def test_streamed_encoder_frames_equal_the_offline_pass(left_context, sizes):
    """Each push gives only frames no later audio changes; all of them, with the end's, equal
    the offline pass within 2e-6 (fp32), however the call was cut."""
    encoder = tiny_encoder(left_context)
    settings = duplex_settings(N_MELS)
    wave = clip(6.0 if left_context > 6 else 2.0)  # 76 frames: past the 70-frame context
    with torch.no_grad():
        offline, _ = encoder(duplex_log_mel(wave, settings)[None], lookahead=0)
        mels, frames = MelStream(settings), EncoderStream(encoder)
        parts = []
        for part in chunks(wave, sizes):
            parts.append(frames.push(mels.push(part)))
            got = sum(p.shape[0] for p in parts)
            # everything given out so far is final: it matches the offline frames already
            torch.testing.assert_close(torch.cat(parts), offline[0, :got], rtol=0, atol=2e-6)
        parts.append(frames.push(mels.end(), last=True))
    streamed = torch.cat(parts)
    assert streamed.shape == offline[0].shape
    torch.testing.assert_close(streamed, offline[0], rtol=0, atol=2e-6)
    assert frames.streams.keys.shape[2] == left_context  # bounded per-call state
    assert frames.call.filled == min(left_context, streamed.shape[0])
    assert frames.call.mel.shape[0] <= 8 * 3 + 1


def test_80ms_appends_give_one_frame_each_after_the_first():
    """On the 1280-sample grid every append finalises exactly one encoder frame (the first
    waits for its STFT look-ahead), and the end gives the last one."""
    encoder = tiny_encoder(70)
    mels, frames = MelStream(duplex_settings(N_MELS)), EncoderStream(encoder)
    counts = []
    with torch.no_grad():
        for part in chunks(clip(12 * 1280 / 16000), [1280]):
            counts.append(frames.push(mels.push(part)).shape[0])
        counts.append(frames.push(mels.end(), last=True).shape[0])
    assert sum(counts) == 12 + 1  # 12 * 8 + 1 mel frames, 8x subsampled
    assert set(counts[1:-1]) == {1}


def test_calls_pushed_together_equal_each_alone():
    """Three calls of different lengths and chunkings in slots of one pool, stepped together
    (the blocks once over every call's padded frames, caches of different lengths), give
    each call's offline frames; a call with nothing new in a step rides along unchanged."""
    from mstar.model.fastconformer.stream import EncoderStreams

    encoder = tiny_encoder(6)
    settings = duplex_settings(N_MELS)
    waves = [clip(1.0, seed=3), clip(0.6, seed=4), clip(1.2, seed=5)]
    cuts = [chunks(w, sizes) for w, sizes in zip(waves, [[1280], [300, 2600], [5000, 100, 1280]])]
    with torch.no_grad():
        offline = [encoder(duplex_log_mel(w, settings)[None], lookahead=0)[0][0] for w in waves]
        mels = [MelStream(settings) for _ in waves]
        streams, slots = EncoderStreams(encoder, 5), [3, 0, 1]  # not in the calls' order
        for slot in slots:
            streams.open(slot)
        outs: list[list[torch.Tensor]] = [[] for _ in waves]
        for step in range(max(len(c) for c in cuts) + 1):
            inputs, lasts = [], []
            for call, parts in enumerate(cuts):
                if step < len(parts):
                    inputs.append(mels[call].push(parts[step]))
                    lasts.append(False)
                elif step == len(parts):
                    inputs.append(mels[call].end())
                    lasts.append(True)
                else:
                    inputs.append(torch.zeros(0, N_MELS))
                    lasts.append(False)
            for call, frames in enumerate(streams.push(slots, inputs, lasts)):
                outs[call].append(frames)
    for got, want in zip(outs, offline):
        torch.testing.assert_close(torch.cat(got), want, rtol=0, atol=2e-6)
