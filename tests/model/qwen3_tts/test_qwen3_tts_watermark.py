"""The opt-in AudioSeal watermark on Qwen3-TTS's codec node: the typed knobs (off by default,
unknown keys and bad values refused), and two requests' windows, decoded and marked in shared
batches, each coming out as its whole utterance marked at once (so a streamed response equals
a whole one), their streams freed at the last window or on cancel."""

from __future__ import annotations

import pytest
import torch

from mstar.config import ConfigError, parse_config
from mstar.engine.base import EngineItem
from mstar.model import audio_watermark as aw
from mstar.model.qwen3_tts.checkpoint import Qwen3TTSCheckpoint
from mstar.model.qwen3_tts.codec import stream_windows
from mstar.model.qwen3_tts.engine import CodecEngine
from mstar.model.qwen3_tts.knobs import Qwen3TTSKnobs
from mstar.model.registry import model_class
from mstar.runtime.protocol import ChunkRef
from tests.support.qwen3_tts_dir import SAMPLES_PER_FRAME, write_checkpoint

TINY = {"nbits": 16, "seanet": {"causal": True, "dimension": 8, "n_filters": 4, "ratios": [4, 2], "lstm": 1}}


def test_knobs_off_by_default_and_strict() -> None:
    assert Qwen3TTSKnobs.parse({}).audio_watermark.enabled is False
    marks = Qwen3TTSKnobs.parse({"audio_watermark": {"enabled": True, "message": 0xBEEF, "alpha": 4.0,
                                                     "generator": "/x/generator.pth"}}).audio_watermark
    assert (marks.enabled, marks.message, marks.alpha, marks.generator) == (True, 0xBEEF, 4.0, "/x/generator.pth")
    assert Qwen3TTSKnobs.parse({"audio_watermark": {"message": "1011111011101111"}}).audio_watermark.message
    for bad, needle in (({"strength": 1}, "audio_watermark.strength: unknown key"),
                        ({"alpha": 0.0}, "audio_watermark.alpha"), ({"alpha": 4.5}, "audio_watermark.alpha"),
                        ({"message": 65536}, "audio_watermark.message"),
                        ({"message": "10"}, "audio_watermark.message"),
                        ({"enabled": "yes"}, "audio_watermark.enabled")):
        with pytest.raises(ConfigError, match=needle):
            Qwen3TTSKnobs.parse({"audio_watermark": bad})


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("wm")
    codec = Qwen3TTSCheckpoint.locate(str(write_checkpoint(root / "ckpt")), dummy=True).codec(
        "cpu", torch.float32, dummy=True, seed=1)
    torch.manual_seed(0)
    generator = aw.AudioSealGenerator(aw.SEANetConfig.from_dict(TINY))
    with torch.no_grad():
        for p in generator.parameters():
            p.normal_(0, 0.2)
    path = root / "generator.pth"
    torch.save({"xp.cfg": TINY, "model": generator.state_dict()}, path)
    return codec, generator, path


def _windows(request_id: str, codes: torch.Tensor, ramp=(1, 3, 8, 6), left=4) -> list[EngineItem]:
    spans = stream_windows(codes.shape[-1], ramp, left)
    return [EngineItem(request_id, "decode", i, {"codes": codes[:, start - ctx:start + new].T.contiguous()}, {},
                       chunk=ChunkRef("codes", "codes", [], i, ctx, ctx + new, last=i == len(spans) - 1))
            for i, (start, ctx, new) in enumerate(spans)]


def test_each_request_marked_as_its_whole_utterance(parts) -> None:
    codec, generator, path = parts
    marks = aw.AudioWatermarkKnobs(enabled=True, message=0xBEEF, alpha=0.5, generator=str(path))
    engine = CodecEngine(codec, marks.build(), marks)
    q = codec.config.num_quantizers
    torch.manual_seed(2)
    codes = {"a": torch.randint(0, 32, (q, 15)), "b": torch.randint(0, 32, (q, 9))}
    items = {rid: _windows(rid, c) for rid, c in codes.items()}
    out: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for step in range(max(map(len, items.values()))):  # both requests' windows in one call
        batch = [seq[step] for seq in items.values() if step < len(seq)]
        for item, result in zip(batch, engine.run(batch)):
            out[item.request_id].append(result.outputs["audio"])
        if step == 0:
            assert set(engine.streams) == {"a", "b"}
    assert engine.streams == {}  # freed at each request's last window
    for rid, c in codes.items():
        with torch.no_grad():  # the unmarked stream (past its context a window differs from a whole decode)
            plain = torch.cat(list(codec.decode_stream(c[None].long(), (1, 3, 8, 6), 4)), -1)[0]
        want = generator(plain[None, None], message=0xBEEF, alpha=0.5)[0, 0]
        got = torch.cat(out[rid])
        assert got.shape == (c.shape[-1] * SAMPLES_PER_FRAME,)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert (got - plain).abs().max() > 1e-3  # marked


def test_cancel_frees_the_stream_and_off_leaves_audio_alone(parts) -> None:
    codec, _, path = parts
    marks = aw.AudioWatermarkKnobs(enabled=True, generator=str(path))
    engine = CodecEngine(codec, marks.build(), marks)
    codes = torch.randint(0, 32, (codec.config.num_quantizers, 6))
    engine.run(_windows("c", codes)[:1])
    assert set(engine.streams) == {"c"}
    engine.release("c")
    assert engine.streams == {}
    odd = aw.AudioSealGenerator(aw.SEANetConfig.from_dict({**TINY, "seanet": {**TINY["seanet"], "ratios": [5]}}))
    with pytest.raises(ValueError, match="hop of 5 samples"):
        CodecEngine(codec, odd, marks)
    plain = CodecEngine(codec)
    wave = torch.cat([r.outputs["audio"] for w in _windows("d", codes) for r in plain.run([w])])
    torch.testing.assert_close(wave, torch.cat(list(codec.decode_stream(codes[None].long(), (1, 3, 8, 6), 4)), -1)[0],
                               atol=1e-6, rtol=0)


def test_deployment_builds_the_marking_codec(tmp_path, parts) -> None:
    root = write_checkpoint(tmp_path / "ckpt")
    base = {"model": "qwen3_tts", "model_path": str(root), "load_format": "dummy", "device": "cpu",
            "max_seq_len": 256, "node_groups": [{"node_names": ["talker", "codec"], "ranks": [0]}]}
    _, _, path = parts
    marks = {"audio_watermark": {"enabled": True, "generator": str(path)}}
    engine = model_class("qwen3_tts")(parse_config({**base, "model_kwargs": marks})).build_engines(
        {"codec"}, torch.device("cpu"))["codec"]
    assert isinstance(engine, CodecEngine) and engine.streams == {}
    card = aw.AudioWatermarkKnobs(enabled=True).build(dummy=True)  # the released shapes, random weights
    assert card.cfg.hop == 320 and card.cfg.causal
    with pytest.raises(ValueError, match="hop of 320 samples"):  # the tiny codec's frame is 48 samples
        model_class("qwen3_tts")(parse_config({**base, "model_kwargs": {"audio_watermark": {"enabled": True}}})
                                 ).build_engines({"codec"}, torch.device("cpu"))
    off = model_class("qwen3_tts")(parse_config(base)).build_engines({"codec"}, torch.device("cpu"))["codec"]
    assert isinstance(off, CodecEngine)
    missing = {**base, "model_kwargs": {"audio_watermark": {"enabled": True, "generator": str(tmp_path / "no.pth")}}}
    with pytest.raises(FileNotFoundError, match="neither a card"):
        model_class("qwen3_tts")(parse_config(missing)).build_engines({"codec"}, torch.device("cpu"))
