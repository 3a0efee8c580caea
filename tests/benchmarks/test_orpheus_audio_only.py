"""Orpheus's benchmarking knob ``model_kwargs.benchmark_audio_only``: with dummy weights every
token of the budget becomes an audio code (sampling restricted to the valid code range of its
position in the frame, END_OF_SPEECH ignored), so a benchmark gets a fixed amount of audio."""

import asyncio
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mstar.config import parse_config
from mstar.contract import SamplingParams, SpeechSpec
from mstar.engine.sampler import Sampler
from mstar.engine.sequence import Sequence
from mstar.model.orpheus import engine as talk
from mstar.model.orpheus.model import pcm_to_array
from mstar.runtime.launch import start

SNAC = {"encoder_dim": 8, "decoder_dim": 32, "codebook_size": 4096}
VOCAB = 156940


def audio_only_seq(codes: int, audio_only: bool = True) -> Sequence:
    return Sequence(tokens=[1, 2, 3], prompt_len=3, sampling=SamplingParams(temperature=0.0),
                    state=talk.TalkerState(audio_only=audio_only, codes=codes))


def test_restrict_keeps_only_the_next_code_range():
    logits = torch.randn(3, VOCAB)
    seqs = [audio_only_seq(0), audio_only_seq(9), audio_only_seq(4, audio_only=False)]
    out = talk.restrict_to_audio_codes(logits, seqs)
    for row, count in ((0, 0), (1, 9)):
        lo, hi = talk.audio_code_range(count)
        assert lo == talk.AUDIO_BASE + (count % 7) * talk.CODEBOOK and hi - lo == talk.CODEBOOK
        finite = torch.isfinite(out[row]).nonzero().flatten()
        assert finite.min().item() == lo and finite.max().item() == hi - 1 and finite.numel() == hi - lo
        assert torch.equal(out[row, lo:hi], logits[row, lo:hi])
    assert torch.equal(out[2], logits[2])  # a row without the knob is untouched


def test_a_step_launched_ahead_restricts_to_the_next_position():
    """With ``lead`` 1 (a step overlap scheduling launches before the host has seen the code
    in flight) an audio_only row is restricted to the range one position further."""
    logits = torch.randn(2, VOCAB)
    out = talk.restrict_to_audio_codes(logits, [audio_only_seq(6), audio_only_seq(3, audio_only=False)], lead=1)
    lo, hi = talk.audio_code_range(7)
    assert lo == talk.AUDIO_BASE  # position 7 is the next frame's first code
    finite = torch.isfinite(out[0]).nonzero().flatten()
    assert finite.min().item() == lo and finite.max().item() == hi - 1
    assert torch.equal(out[1], logits[1])


def test_greedy_choice_ignores_end_of_speech_only_with_the_knob():
    logits = torch.zeros(2, VOCAB)
    logits[:, talk.END_OF_SPEECH] = 100.0  # the weights want to stop
    logits[:, talk.AUDIO_BASE + 2 * talk.CODEBOOK + 17] = 5.0  # best valid code at position 2
    sampler = Sampler()

    def sample(logits, seqs):
        return sampler(logits, [s.sampling for s in seqs], [s.generator for s in seqs], None)

    picks = talk.TalkerRules().choose(logits, [audio_only_seq(2), audio_only_seq(2, audio_only=False)], sample)
    picks = picks.tolist()
    assert picks == [talk.AUDIO_BASE + 2 * talk.CODEBOOK + 17, talk.END_OF_SPEECH]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("orpheus-knob")
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 1024, "tie_word_embeddings": True,
              "bos_token_id": 128000, "eos_token_id": talk.END_OF_SPEECH}
    (path / "config.json").write_text(json.dumps(config))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    return path


def deploy(model_dir, audio_only: bool, **knobs):
    return start(parse_config({
        "model": "orpheus", "model_path": str(model_dir), "load_format": "dummy", "max_seq_len": 512,
        "model_kwargs": {"snac_config": SNAC, "benchmark_audio_only": audio_only, **knobs},
        "resources": {"kv_cache": {"max_num_pages": 128, "page_size": 16}}}), in_process=True)


def speak(d, rid, max_tokens, **sampling):
    async def go():
        return [e async for e in d.backend.speech(SpeechSpec(rid, "Hello there", "tara", 1.0,
                                                             {"max_tokens": max_tokens, "seed": 3, **sampling}))]
    return asyncio.run(go())


def recording_leads(choose, leads: list[int]):
    """``choose`` that also appends the ``lead`` of each call to ``leads``."""

    def wrapped(logits, seqs, sample, lead=0):
        leads.append(lead)
        return choose(logits, seqs, sample, lead)

    return wrapped


def test_overlap_scheduling_speaks_the_same_codes(model_dir):
    """The talker takes part in overlap scheduling: greedy, unpenalised audio_only requests
    run steps ahead (each one code further along) and speak exactly what eager speaks."""
    greedy = {"temperature": 0.0, "repetition_penalty": 1.0}
    audio = {}
    for overlap in (False, True):
        d = deploy(model_dir, audio_only=True, overlap_scheduling=overlap)
        engine = d.runtime.workers.workers[0].engines["llm"]
        leads = []
        engine.rules.choose = recording_leads(engine.rules.choose, leads)
        try:
            audio[overlap] = pcm_to_array(speak(d, "o", 5 * 7, **greedy))
        finally:
            d.close()
        assert (1 in leads) == overlap
    assert audio[True].shape == (5 * talk.SAMPLES_PER_FRAME,)
    assert audio[True].tobytes() == audio[False].tobytes()


def test_every_token_of_the_budget_becomes_audio(model_dir):
    d = deploy(model_dir, audio_only=True)
    try:
        request = d.spec.prepare_speech(SpeechSpec("p", "Hi", "tara", 1.0, {}))
        assert request.params["stop_token_ids"] == [] and request.params["audio_only"] is True
        for frames in (4, 6):
            audio = pcm_to_array(speak(d, f"k-{frames}", frames * 7))
            assert audio.shape == (frames * talk.SAMPLES_PER_FRAME,)  # every token was a code
        assert not d.runtime.workers.workers[0].engines["llm"].seqs  # released
    finally:
        d.close()


def test_without_the_knob_requests_stop_at_end_of_speech(model_dir):
    d = deploy(model_dir, audio_only=False)
    try:
        request = d.spec.prepare_speech(SpeechSpec("p", "Hi", "tara", 1.0, {}))
        assert request.params["stop_token_ids"] == [talk.END_OF_SPEECH]
        assert request.params["audio_only"] is False
    finally:
        d.close()
