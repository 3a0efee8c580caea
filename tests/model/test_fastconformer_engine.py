"""The transducer decoder engine: clips joining and leaving between iterations decode as
they do alone; a clip holds one state slot from its first iteration until its release; a
full pool refuses, and a failed batch leaves every state intact."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.engine.state_pool import OutOfSlots
from mstar.model.fastconformer.config import FastConformerConfig, TransducerConfig
from mstar.model.fastconformer.engine import EncoderGraphs, TransducerDecoder, encoder_fn
from mstar.model.fastconformer.transducer import TransducerModel, greedy_decode
from mstar.model.text_stream import TokenTextStream
from tests.support.markers import needs_cuda

VOCAB, BLANK = 20, 19


def tiny_model(seed: int = 0, *, tdt: bool = True) -> TransducerModel:
    encoder = FastConformerConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                  subsampling_conv_channels=4, num_mel_bins=16, conv_kernel_size=3)
    config = TransducerConfig(model_type="parakeet_tdt" if tdt else "parakeet_rnnt", encoder=encoder,
                              vocab_size=VOCAB, blank_token_id=BLANK, decoder_hidden_size=12,
                              durations=(0, 1, 2, 3, 4) if tdt else (), max_symbols_per_step=3)
    torch.manual_seed(seed)
    model = TransducerModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
        model.joint.head.bias[BLANK] += 1.0
        if tdt:
            model.joint.head.bias[VOCAB + 1] += 6.0
    return model


def clips(model: TransducerModel, frames=(9, 14, 5, 11), seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, model.config.decoder_hidden_size, generator=gen) for n in frames]


def item(request_id: str, features: torch.Tensor, iteration: int) -> EngineItem:
    return EngineItem(request_id, "decode", iteration, {"audio_features": features}, {})


def decoder(model: TransducerModel, max_slots: int = 5, steps: int = 4) -> TransducerDecoder:
    return TransducerDecoder(model, max_slots=max_slots, steps_per_iteration=steps, device=torch.device("cpu"),
                             dtype=torch.float32)


@pytest.mark.parametrize("tdt", [True, False])
def test_staggered_clips_decode_as_alone(tdt: bool) -> None:
    model = tiny_model(tdt=tdt)
    features = clips(model)
    alone = [greedy_decode(model, [f])[0] for f in features]
    assert len({tuple(a) for a in alone}) > 1 and any(alone)
    engine = decoder(model)
    got: dict[str, list[int]] = {}
    live: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for tick in range(200):
        if tick < len(features):  # one clip joins per iteration
            live[f"r{tick}"] = 0
        if not live:
            break
        names = list(live)
        outputs = engine.run([item(n, features[int(n[1:])], live[n]) for n in names])
        for name, out in zip(names, outputs):
            got.setdefault(name, []).extend(out.outputs["tokens"].tolist() if "tokens" in out.outputs else [])
            live[name] += 1
            if "stop" in out.flags:
                reasons[name] = out.finish_reason
                del live[name]
                engine.release(name)
        engine.slots.check_invariants()
    assert [got[f"r{i}"] for i in range(len(features))] == alone
    assert set(reasons.values()) == {"stop"}
    assert engine.slots.num_used == 0 and not engine.frames


def test_slots_are_held_until_release_and_refused_when_full() -> None:
    model = tiny_model()
    features = clips(model)
    engine = decoder(model, max_slots=3)  # two slots and the sink
    engine.run([item("a", features[0], 0), item("b", features[1], 0)])
    assert engine.slots.num_used == 2 and engine.stats()["transducer_slots_used"] == 2
    with pytest.raises(OutOfSlots):
        engine.run([item("c", features[2], 0)])
    assert engine.slots.num_used == 2 and "c" not in engine.frames
    engine.release("a")
    engine.run([item("c", features[2], 0)])
    assert engine.slots.has("c") and not engine.slots.has("a")
    engine.slots.check_invariants()


def test_failed_batch_leaves_states_intact(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    features = clips(model)
    alone = greedy_decode(model, [features[1]])[0]
    engine = decoder(model, steps=3)
    first = engine.run([item("a", features[1], 0)])[0]
    calls = {"n": 0}
    real = model.joint.forward

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:  # fail mid-iteration, after a step has run
            raise RuntimeError("boom")
        return real(*args)

    monkeypatch.setattr(model.joint, "forward", flaky)
    with pytest.raises(RuntimeError):
        engine.run([item("a", features[1], 1)])
    tokens = first.outputs["tokens"].tolist() if "tokens" in first.outputs else []
    for i in range(2, 100):
        out = engine.run([item("a", features[1], i)])[0]
        tokens += out.outputs["tokens"].tolist() if "tokens" in out.outputs else []
        if "stop" in out.flags:
            break
    assert tokens == alone


def test_encoder_node_batches_clips_of_different_lengths() -> None:
    model = tiny_model()
    gen = torch.Generator().manual_seed(3)
    mels = [torch.randn(n, 16, generator=gen) for n in (50, 23, 37)]
    run = encoder_fn(model, lookahead=None)
    together = run("forward", [EngineItem(f"r{i}", "forward", 0, {"mel": m}, {}) for i, m in enumerate(mels)])
    for m, out in zip(mels, together):
        with torch.no_grad():
            solo, _ = model.encode(m[None])
        assert out["audio_features"].shape == solo[0].shape
        torch.testing.assert_close(out["audio_features"], solo[0], rtol=1e-5, atol=1e-5)


def streaming_prompted_model() -> TransducerModel:
    """Nemotron ASR's layout in tiny: causal encoder, chunked attention, language prompts."""
    encoder = FastConformerConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                  subsampling_conv_channels=4, num_mel_bins=16, conv_kernel_size=3, causal=True,
                                  left_context=8, default_lookahead=2)
    config = TransducerConfig(model_type="nemotron_asr", encoder=encoder, vocab_size=VOCAB, blank_token_id=BLANK,
                              decoder_hidden_size=12, max_symbols_per_step=3, num_prompts=4,
                              prompt_intermediate_size=8, default_prompt_id=1)
    torch.manual_seed(2)
    model = TransducerModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    return model


@pytest.mark.parametrize("streaming", [False, True])
def test_encoder_graph_buckets_give_each_clip_its_eager_frames(streaming: bool) -> None:
    """Batches padded to a batch bucket (rows with no frames) and a length bucket (masked
    frames), replayed through ``EncoderGraphs`` (eager on the CPU): each clip gets the frames
    of the eager forward; batches past the buckets run eagerly."""
    model = streaming_prompted_model() if streaming else tiny_model()
    gen = torch.Generator().manual_seed(3)
    mels = [torch.randn(n, 16, generator=gen) for n in (50, 23, 37)]
    items = [EngineItem(f"r{i}", "forward", 0, {"mel": m} | ({"prompt": torch.tensor([i])} if streaming else {}), {})
             for i, m in enumerate(mels)]
    graphs = EncoderGraphs(model, None, (1, 4), frame_step=16, max_frames=64)
    assert graphs.shape(3, 50) == (4, 64) and graphs.shape(1, 65) is None and graphs.shape(5, 10) is None
    eager, replayed = encoder_fn(model, None)("forward", items), encoder_fn(model, None, graphs)("forward", items)
    assert graphs.graphs.runner.keys == ((4, 64, 16),)
    for want, got in zip(eager, replayed):
        assert got["audio_features"].shape == want["audio_features"].shape
        torch.testing.assert_close(got["audio_features"], want["audio_features"], rtol=1e-5, atol=1e-5)
    long = [EngineItem("long", "forward", 0, {"mel": torch.randn(70, 16, generator=gen)}, {})]
    assert encoder_fn(model, None, graphs)("forward", long)[0]["audio_features"].shape[0] == \
        model.config.encoder.frames(70)
    assert len(graphs.graphs.runner.keys) == 1


@needs_cuda
@pytest.mark.parametrize("streaming", [False, True])
def test_cuda_encoder_graphs_replay_the_eager_forward(streaming: bool) -> None:
    """Captured on CUDA (fp32), the encoder's replays give the eager frames, call after call.
    (TF32 off: cuDNN's convolutions would otherwise round differently at the padded shape.)"""
    model = (streaming_prompted_model() if streaming else tiny_model()).cuda()
    gen = torch.Generator().manual_seed(4)
    graphs = EncoderGraphs(model, None, (1, 2, 4), frame_step=16, max_frames=64)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        for lengths in ((50, 23, 37), (12,), (64, 9)):
            items = [EngineItem(f"r{i}", "forward", 0, {"mel": torch.randn(n, 16, generator=gen)}, {})
                     for i, n in enumerate(lengths)]
            eager = encoder_fn(model, None)("forward", items)
            replayed = encoder_fn(model, None, graphs)("forward", items)
            for want, got in zip(eager, replayed):
                torch.testing.assert_close(got["audio_features"], want["audio_features"], rtol=1e-4, atol=1e-4)
    assert graphs.graphs.runner.capture and len(graphs.graphs.runner.keys) == 3


class _Bytes:
    """A byte-level tokenizer: id ``b`` is the byte ``b``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_a_partial_character() -> None:
    stream = TokenTextStream(_Bytes())
    first = stream.feed("text", torch.tensor(list(b"na") + [0xC3]))  # "na" + half of "ï"
    assert first.text == "" and first.token_ids == [110, 97, 0xC3]  # nothing sent until "ï" is whole
    rest = stream.feed("text", torch.tensor([0xAF, ord("v")]))
    assert rest.text == "naïv" and stream.generated == 5
    assert stream.feed("text", torch.tensor([ord("e")])).text == "e"
