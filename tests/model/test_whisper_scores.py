"""Whisper's segment scores (``avg_logprob``, ``no_speech_prob``) from the decoder engine,
against a hand computation with Hugging Face's model on the parity test's tiny random config.

OpenAI's ``whisper.decoding`` (openai-whisper 20250625) is the definition followed:
``no_speech_prob`` is ``softmax(logits at SOT)[<|nospeech|>]`` of the raw logits;
``sum_logprobs`` adds ``log_softmax(filtered logits)[token]`` of every sampled token up to
and including the end of text (the logits after the suppression filters, before the
temperature: ``GreedyDecoder.update`` divides by the temperature only to sample); and
``avg_logprob = sum_logprobs / (text tokens + 1)``. The engine runs eagerly and with overlap
scheduling (steps launched ahead, some discarded at the stop), greedy and seeded-sampled rows
in one batch, a detecting row beside rows whose language is forced.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_whisper_parity import SOT, TINY, make_audio, randomize_
from transformers import WhisperConfig as HFWhisperConfig
from transformers import WhisperForConditionalGeneration as HFWhisper

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import EngineItem
from mstar.model.whisper import WhisperConfig, WhisperForConditionalGeneration, log_mel_spectrogram
from mstar.model.whisper.engine import whisper_decoder_engine
from mstar.model.whisper.rules import DecoderTokens

LANGS, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS, NO_SPEECH = (91, 92), 93, 94, 95, 96
FORCED = [91, TRANSCRIBE, NO_TIMESTAMPS]
MAX_NEW = 20


def decoder_tokens(eot: int) -> DecoderTokens:
    return DecoderTokens(vocab_size=TINY["vocab_size"], eot=eot, sot=SOT, no_timestamps=NO_TIMESTAMPS,
                         transcribe=TRANSCRIBE, translate=TRANSLATE, language_ids=LANGS, suppress=(5, 6),
                         begin_suppress=(7, eot), no_speech=NO_SPEECH)


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    torch.manual_seed(0)
    hf = HFWhisper(HFWhisperConfig(**TINY)).eval()
    randomize_(hf, seed=0)
    with torch.no_grad():  # flatter distributions than the parity test's: texts that do not repeat one token
        hf.model.decoder.embed_tokens.weight.mul_(0.3)
    ours = WhisperForConditionalGeneration(WhisperConfig.from_hf_dict(hf.config.to_dict())).eval()
    ours.load_state_dict({k: v for k, v in hf.state_dict().items() if k != "proj_out.weight"}, strict=True)
    mels = {r: log_mel_spectrogram(make_audio(kind, 3.0, seed=i)) for i, (r, kind) in
            enumerate([("given", "chirp"), ("detect", "noise"), ("sampled", "sine")])}
    with torch.no_grad():
        features = {r: ours.encode(mel[None])[0] for r, mel in mels.items()}
    return {"hf": hf, "ours": ours, "mels": mels, "features": features}


def engine(model, eot: int, overlap: bool) -> AutoregressiveEngine:
    return whisper_decoder_engine(model, decoder_tokens(eot), KVLayout(*model.kv_layout()), max_requests=4,
                                  device=torch.device("cpu"), dtype=torch.float32, num_pages=64, page_size=4,
                                  max_seq_len=TINY["max_target_positions"], overlap_scheduling=overlap)


def requests(eot: int) -> dict[str, dict]:
    def params(temperature: float, **extra) -> dict:
        sampling = {"temperature": temperature} | ({"seed": 5} if temperature else {})
        return {"sampling": sampling, "max_new_tokens": MAX_NEW, "stop_token_ids": [eot], **extra}
    return {"given": params(0.0, forced_ids=FORCED), "detect": params(0.0, detect_language=True),
            "sampled": params(0.7, forced_ids=FORCED)}


def serve(eng: AutoregressiveEngine, features: dict, params: dict) -> tuple[dict, dict]:
    """Every request prefilled at once, then decoded together until each stops: their
    generated tokens and the ``scores`` their last step wrote."""
    tokens: dict[str, list[int]] = {}
    scores: dict[str, torch.Tensor] = {}
    live = list(params)
    while live:
        items = [EngineItem(r, "decode", len(tokens[r]), {"token": torch.tensor([tokens[r][-1]])}, {})
                 if r in tokens else
                 EngineItem(r, "prefill", 0, {"prompt_ids": torch.tensor([SOT]), "audio_features": features[r]},
                            params[r]) for r in live]
        for r, result in zip(list(live), eng.run(items)):
            tokens.setdefault(r, []).append(int(result.outputs["token"]))
            assert ("scores" in result.outputs) == ("stop" in result.flags)
            if "stop" in result.flags:
                scores[r] = result.outputs["scores"]
                live.remove(r)
                eng.release(r)
    assert eng.rules.scores.slots == {}
    return tokens, scores


def by_hand(hf: HFWhisper, mel: torch.Tensor, generated: list[int], eot: int) -> tuple[float, float]:
    """OpenAI's avg_logprob and no_speech_prob of the window ``mel`` decoded as ``generated``
    after ``[SOT]`` (its first three tokens language, task, no-timestamps), with HF's logits."""
    ids = torch.tensor([[SOT, *generated]])
    with torch.no_grad():
        logits = hf(input_features=mel[None], decoder_input_ids=ids).logits[0].double()
    no_speech = logits[0].softmax(-1)[NO_SPEECH].item()
    suppress = torch.zeros(TINY["vocab_size"], dtype=torch.bool)
    suppress[[5, 6]] = True
    suppress[SOT:] = True
    total, text = 0.0, generated[3:]
    for k, token in enumerate(text):
        mask = suppress.clone()
        if k == 0:
            mask[[7, eot]] = True
        total += logits[3 + k].masked_fill(mask, float("-inf")).log_softmax(-1)[token].item()
    count = len(text) - (1 if text and text[-1] == eot else 0)
    return total / (count + 1), no_speech


def eot_met_midway(setup: dict) -> int:
    """A token the greedy decode of the ``given`` window meets after a few text tokens: taken
    as the end of text, so that the engine really stops at it."""
    tokens, _ = serve(engine(setup["ours"], eot=89, overlap=False), setup["features"],
                      {"given": requests(89)["given"] | {"stop_token_ids": []}})
    text = tokens["given"][3:]
    return next(t for t in text[3:] if t not in text[:3])


@pytest.mark.parametrize("overlap", [False, True], ids=["eager", "overlap"])
def test_scores_match_openai_definition_by_hand(setup: dict, overlap: bool) -> None:
    eot = eot_met_midway(setup)
    tokens, scores = serve(engine(setup["ours"], eot, overlap), setup["features"], requests(eot))
    assert tokens["given"][-1] == eot and len(tokens["given"]) < MAX_NEW  # stopped at the end of text
    assert tokens["given"][:3] == FORCED and tokens["sampled"][:3] == FORCED
    assert tokens["detect"][0] in LANGS and tokens["detect"][1:3] == [TRANSCRIBE, NO_TIMESTAMPS]
    for r in tokens:
        avg, no_speech = by_hand(setup["hf"], setup["mels"][r], tokens[r], eot)
        got = scores[r].tolist()
        print(f"[scores] {r}: avg_logprob {got[0]:.6f} (hand {avg:.6f}), "
              f"no_speech_prob {got[1]:.3e} (hand {no_speech:.3e}), {len(tokens[r])} tokens")
        assert got[0] == pytest.approx(avg, rel=1e-5, abs=1e-6)
        assert got[1] == pytest.approx(no_speech, rel=1e-5, abs=1e-9)
        assert got[0] < 0 and 0 < got[1] < 1


def test_sampled_scores_use_logits_before_the_temperature(setup: dict) -> None:
    """The sampled row's average differs from one taken after the temperature, and seeded
    sampling gives the same tokens and scores on a second engine."""
    eot = eot_met_midway(setup)
    first_tokens, first = serve(engine(setup["ours"], eot, False), setup["features"], requests(eot))
    again_tokens, again = serve(engine(setup["ours"], eot, True), setup["features"], requests(eot))
    assert first_tokens["sampled"] == again_tokens["sampled"]
    assert torch.equal(first["sampled"], again["sampled"])
    greedy_tokens, _ = serve(engine(setup["ours"], eot, False), setup["features"],
                             {"sampled": requests(eot)["given"]})
    assert first_tokens["sampled"] != greedy_tokens["sampled"]  # the temperature really sampled
    generated = first_tokens["sampled"]
    ids = torch.tensor([[SOT, *generated]])
    with torch.no_grad():
        logits = setup["hf"](input_features=setup["mels"]["sampled"][None], decoder_input_ids=ids).logits[0]
    tempered = sum((logits[3 + k] / 0.7).log_softmax(-1)[t].item() for k, t in enumerate(generated[3:]))
    assert abs(first["sampled"][0].item() - tempered / len(generated[3:])) > 1e-3


def test_token_scores_overwrite_grow_and_free() -> None:
    """A column written twice (a step launched ahead, discarded, run again) keeps the second
    value; more sequences than the table's first rows grow it; dropped slots are reused."""
    from types import SimpleNamespace

    from mstar.model.whisper.rules import TokenScores

    scores = TokenScores(max_len=6, device=torch.device("cpu"))
    seqs = [SimpleNamespace(request_id=f"r{i}", generated=0) for i in range(10)]
    with torch.inference_mode():
        scores.write(seqs, 0, torch.full((10,), -1.0), (list(range(10)), torch.arange(10) / 10))
        for seq in seqs:
            seq.generated = 1
        scores.write(seqs, 1, torch.full((10,), -9.0), ([], torch.zeros(0)))  # ahead, then discarded
        scores.write(seqs, 0, torch.full((10,), -2.0), ([], torch.zeros(0)))
        scores.write(seqs, 1, torch.full((10,), -3.0), ([], torch.zeros(0)))
    assert scores.table.shape[0] == 16 and len(set(scores.slots.values())) == 10
    for seq in seqs:
        seq.generated = 3
    avg, no_speech = scores.summary(seqs[4], text_start=0, tokens=2).tolist()  # ended at an EOT
    assert avg == pytest.approx((-1 - 2 - 3) / 3) and no_speech == pytest.approx(0.4)
    scores.drop("r4")
    seqs[4] = SimpleNamespace(request_id="new", generated=0)
    with torch.inference_mode():
        scores.write(seqs[4:5], 0, torch.tensor([-0.5]), ([], torch.zeros(0)))
    assert scores.slots["new"] not in {scores.slots[s.request_id] for s in seqs if s.request_id != "new"}
    assert scores.table[scores.slots["new"], 0] == 0.0  # a reused slot starts without the last one's value
