"""AudioSeal port (mstar/model/audio_watermark.py) against the ``audioseal`` 0.2.0 reference on
tiny seeded configs: whole-clip and chunked-streaming marks within 1e-5, the detector's scores
and bits, and checkpoints in the released layout loaded by both with coverage both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from mstar.model import audio_watermark as aw
from mstar.model.weights import WeightLoadError
from tests.model.audio_watermark_reference import (
    detector_cfg,
    generator_cfg,
    reference,
    released_from_ours,
    released_state,
)

TRAINED = Path(__file__).resolve().parent / "fixtures" / "audioseal_tiny.safetensors"

TOL = 1e-5


def _ref_generator(seed: int = 0, **overrides):
    audioseal = reference()
    from audioseal.builder import AudioSealWMConfig, create_generator

    cfg = audioseal.AudioSeal.parse_config(generator_cfg(**overrides), AudioSealWMConfig)
    torch.manual_seed(seed)
    model = create_generator(cfg).eval()
    with torch.no_grad():  # spread the weights so the mark is not near zero
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _ref_detector(seed: int = 1):
    audioseal = reference()
    from audioseal.builder import AudioSealDetectorConfig, create_detector

    cfg = audioseal.AudioSeal.parse_config(detector_cfg(), AudioSealDetectorConfig)
    torch.manual_seed(seed)
    model = create_detector(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def _ours(cls, ref, cfg_dict):
    model = cls(aw.SEANetConfig.from_dict(cfg_dict))
    aw.load_weights(model, aw.fold_weight_norm(ref.state_dict()).items(),
                    name_map=lambda n: aw.released_name(n) or n)
    return model.eval()


def _bits(value: int) -> torch.Tensor:
    return aw.message_bits(value)


def test_message_bits_round_trip_and_validation():
    assert _bits(0xBEEF).tolist() == [int(c) for c in "1011111011101111"]
    assert torch.equal(aw.message_bits("1011111011101111"), _bits(0xBEEF))
    assert aw.bits_to_int(_bits(0xBEEF)) == 0xBEEF
    for bad in (-1, 65536, "101", "10111110111011x1"):
        with pytest.raises(ValueError):
            aw.message_bits(bad)


@pytest.mark.parametrize("causal", [True, False])
def test_whole_clip_mark_matches_reference(causal):
    ref = _ref_generator(causal=causal)
    ours = _ours(aw.AudioSealGenerator, ref, generator_cfg(causal=causal))
    torch.manual_seed(3)
    x = 0.3 * torch.randn(2, 1, 203)  # not a whole number of hops
    with torch.no_grad():
        want = ref(x, message=_bits(0xBEEF), alpha=0.7)
    got = ours(x, message=0xBEEF, alpha=0.7)
    assert (want - x).abs().max() > 1e-2  # the mark is not nothing
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_streamed_chunks_equal_the_whole_clip_marked_at_once():
    ref = _ref_generator()
    ours = _ours(aw.AudioSealGenerator, ref, generator_cfg())
    torch.manual_seed(4)
    x = 0.3 * torch.randn(1, 1, 8 * 40)
    with torch.no_grad():
        want = ref(x, message=aw.message_bits("0110100111000101"), alpha=1.5)[0, 0]
    for cuts in ([8, 24, 64, 8, 120, 96], [320], [8] * 40):  # whole hops of 8 samples
        stream, got, start = ours.new_stream(message="0110100111000101", alpha=1.5), [], 0
        for n in cuts:
            got.append(ours.mark_chunk(x[0, 0, start:start + n], stream))
            start += n
        torch.testing.assert_close(torch.cat(got), want, atol=TOL, rtol=0)


def test_reference_streaming_marks_each_chunk_alone():
    """audioseal 0.2.0's ``streaming()`` reaches only the encoder container, not its layers:
    each chunk is marked as its own clip, which ``forward`` on the chunk reproduces."""
    ref = _ref_generator()
    ours = _ours(aw.AudioSealGenerator, ref, generator_cfg())
    torch.manual_seed(6)
    x = 0.3 * torch.randn(1, 1, 200)
    bits, start = aw.message_bits(0xA5A5), 0
    with torch.no_grad(), ref.streaming(batch_size=1):
        for n in (8, 64, 128):
            chunk = x[..., start:start + n]
            torch.testing.assert_close(ours(chunk, message=0xA5A5, alpha=0.5),
                                       ref(chunk, message=bits, alpha=0.5), atol=TOL, rtol=0)
            start += n
    # ... so its chunked marks differ from the whole clip's, unlike ours
    whole = ours(x[..., :200], message=0xA5A5, alpha=0.5)
    alone = torch.cat([ours(x[..., s:s + n], message=0xA5A5, alpha=0.5) for s, n in ((0, 8), (8, 64), (72, 128))], -1)
    assert (whole - alone).abs().max() > 1e-3


def test_stream_rejects_partial_hop_and_noncausal():
    ours = _ours(aw.AudioSealGenerator, _ref_generator(), generator_cfg())
    with pytest.raises(ValueError, match="whole hops"):
        ours.mark_chunk(torch.randn(12), ours.new_stream())
    base = aw.AudioSealGenerator(aw.SEANetConfig.from_dict(generator_cfg(causal=False)))
    with pytest.raises(ValueError, match="causal"):
        base.new_stream()


def test_detector_matches_reference_on_our_mark():
    gen = _ref_generator()
    ours_gen = _ours(aw.AudioSealGenerator, gen, generator_cfg())
    ref = _ref_detector()
    ours = _ours(aw.AudioSealDetector, ref, detector_cfg())
    torch.manual_seed(5)
    marked = ours_gen(0.3 * torch.randn(1, 1, 400), message=0x1234)
    with torch.no_grad():
        want_scores, want_bits = ref(marked.clone())
        want_prob, want_msg = ref.detect_watermark(marked.clone())
    got_scores, got_bits = ours(marked)
    torch.testing.assert_close(got_scores, want_scores, atol=TOL, rtol=0)
    torch.testing.assert_close(got_bits, want_bits, atol=TOL, rtol=0)
    found = ours.detect(marked[0, 0])
    assert found.probability == pytest.approx(float(want_prob[0]), abs=1e-6)
    assert found.message == aw.bits_to_int(want_msg[0])


def _released_file(tmp_path, model, cfg, name):
    path = tmp_path / name
    torch.save({"xp.cfg": cfg, "model": released_state(model)}, path)
    return path


def test_released_checkpoints_load_as_the_reference_loads_them(tmp_path):
    audioseal = reference()
    gen, det = _ref_generator(seed=7), _ref_detector(seed=8)
    gen_path = _released_file(tmp_path, gen, generator_cfg(), "generator.pth")
    det_path = _released_file(tmp_path, det, detector_cfg(), "detector.pth")
    ref_gen = audioseal.AudioSeal.load_generator(str(gen_path)).eval()
    ref_det = audioseal.AudioSeal.load_detector(str(det_path)).eval()
    ours_gen, ours_det = aw.load_generator(gen_path), aw.load_detector(det_path)
    torch.manual_seed(9)
    x = 0.3 * torch.randn(1, 1, 160)
    with torch.no_grad():
        want = ref_gen(x, message=_bits(77), alpha=1.0)
        want_scores, _ = ref_det(want.clone())
    got = ours_gen(x, message=77)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    torch.testing.assert_close(ours_det(got)[0], want_scores, atol=TOL, rtol=0)


def test_checkpoint_coverage_both_ways(tmp_path):
    gen = _ref_generator()
    state = released_state(gen)
    missing = dict(state)
    missing.pop("decoder.model.9.conv.conv.bias")
    extra = {**state, "decoder.model.99.conv.conv.bias": torch.zeros(1)}
    for name, bad, needle in (("missing.pth", missing, "did not fill"), ("extra.pth", extra, "nothing loads")):
        path = tmp_path / name
        torch.save({"xp.cfg": generator_cfg(), "model": bad}, path)
        with pytest.raises(WeightLoadError, match=needle):
            aw.load_generator(path)
    with pytest.raises(FileNotFoundError, match="neither a card"):
        aw.load_generator(tmp_path / "nope.pth")


def test_reference_detector_finds_our_mark(tmp_path):
    """A tiny pair trained to find the mark (``record_audioseal_tiny.py``): the reference's
    detector and ours find our generator's mark, streamed or whole, and not clean audio."""
    audioseal = reference()
    with safe_open(TRAINED, framework="pt") as f:
        tiny = json.loads(f.metadata()["config"])
        alpha = float(f.metadata()["alpha"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    paths = {}
    for side, cls in (("generator", aw.AudioSealGenerator), ("detector", aw.AudioSealDetector)):
        model = cls(aw.SEANetConfig.from_dict(tiny))
        model.load_state_dict({k[len(side) + 1:]: v for k, v in tensors.items() if k.startswith(side + ".")})
        seanet = {**generator_cfg()["seanet"], **tiny["seanet"]}
        cfg = {**(generator_cfg() if side == "generator" else detector_cfg()), "seanet": seanet}
        paths[side] = tmp_path / f"{side}.pth"
        torch.save({"xp.cfg": cfg, "model": released_from_ours(model)}, paths[side])
    ours_gen, ours_det = aw.load_generator(paths["generator"]), aw.load_detector(paths["detector"])
    ref_gen = audioseal.AudioSeal.load_generator(str(paths["generator"])).eval()
    ref_det = audioseal.AudioSeal.load_detector(str(paths["detector"])).eval()
    torch.manual_seed(11)
    clean = 0.3 * F.avg_pool1d(F.pad(torch.randn(1, 1, 2400), (2, 2)), 5, 1)
    marked = ours_gen(clean, message=0xBEEF, alpha=alpha)
    stream = ours_gen.new_stream(0xBEEF, alpha)
    streamed = torch.cat([ours_gen.mark_chunk(clean[0, 0, s:s + 480], stream) for s in range(0, 2400, 480)])
    with torch.no_grad():
        torch.testing.assert_close(marked, ref_gen(clean, message=aw.message_bits(0xBEEF), alpha=alpha),
                                   atol=TOL, rtol=0)
        for audio in (marked[0, 0], streamed):
            prob, _ = ref_det.detect_watermark(audio.reshape(1, 1, -1).clone())
            assert float(prob[0]) > 0.9 and ours_det.detect(audio).probability > 0.9
        prob, _ = ref_det.detect_watermark(clean.clone())
        assert float(prob[0]) < 0.1 and ours_det.detect(clean[0, 0]).probability < 0.1
