"""Orpheus over HTTP: a real `mstar serve` (worker processes, codes streamed between the
talker and the codec) on a tiny dummy-weight deployment, driven by the official client."""

import io
import json

import httpx
import pytest
import soundfile as sf
from live_server import launch_server
from openai import OpenAI
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mstar import MStarClient


def write_tiny_orpheus(path):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 156940, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "max_position_embeddings": 2048, "tie_word_embeddings": True,
              "bos_token_id": 128000, "eos_token_id": 128258}
    (path / "config.json").write_text(json.dumps(config))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


@pytest.fixture(scope="module", params=["disaggregated"])
def server(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"orpheus-{request.param}")
    write_tiny_orpheus(work)
    ranks = [0, 1] if request.param == "disaggregated" else [0, 0]
    (work / "orpheus.yaml").write_text(
        f"model: orpheus\nmodel_path: {work}\nload_format: dummy\nmax_seq_len: 2048\n"
        "max_concurrent_requests: 8\n"
        f"node_groups:\n  - {{node_names: [llm], ranks: [{ranks[0]}]}}\n"
        f"  - {{node_names: [snac_decoder], ranks: [{ranks[1]}]}}\n"
        "resources:\n  kv_cache: {max_num_pages: 1024, page_size: 16}\n"
        "model_kwargs:\n  max_new_tokens: 400\n"
        "  snac_config: {encoder_dim: 8, decoder_dim: 32, codebook_size: 4096}\n")
    with launch_server("orpheus", work, ["--config", str(work / "orpheus.yaml")]) as live:
        yield live


def test_openai_speech_returns_a_wav(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    audio = client.audio.speech.create(model="orpheus", voice="tara", input="Hello from M star.",
                                       response_format="wav", extra_body={"seed": 5})
    samples, rate = sf.read(io.BytesIO(audio.content))
    assert rate == 24000 and samples.ndim == 1
    assert len(samples) % 2048 == 0  # whole SNAC frames

    with client.audio.speech.with_streaming_response.create(
            model="orpheus", voice="tara", input="Hello from M star.", response_format="pcm",
            extra_body={"seed": 5, "stream": True}) as response:
        pcm = b"".join(response.iter_bytes())
    assert len(pcm) == 2 * len(samples)  # same seed, same audio length, streamed


def test_voices_and_bad_requests(server):
    voices = httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]
    assert {v["voice_id"] for v in voices} == {"tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"}
    for body, field in [({"input": ""}, "input"), ({"input": "hi", "voice": "nobody"}, "voice"),
                        ({"input": "hi", "response_format": "ogg"}, "response_format"),
                        ({"input": "x" * 5000}, "input"), ({"input": "hi", "speed": 1.5}, "speed")]:
        r = httpx.post(f"{server.url}/v1/audio/speech", json={"model": "orpheus", "voice": "tara", **body})
        assert 400 <= r.status_code < 500, (body, r.text)
        assert r.json()["error"]["param"] == field


def test_sdk_tts(server, tmp_path):
    result = MStarClient(server.url).tts("Hi there", voice="leo", seed=3)
    path = tmp_path / "out.wav"
    result.to_wav(path)
    samples, rate = sf.read(path)
    assert rate == 24000


def test_sentence_pieces_are_the_pieces_spoken_alone(server):
    """``sentence_chunking: true`` speaks each piece as its own walk, in order: the audio is the
    pieces' solo audio (same seed), joined. And Orpheus does not clone: a clip is refused."""
    from mstar.model.orpheus.model import PIECES

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
    text = "A short start. " + "Then a much longer sentence follows it, with many words in it. " * 3

    def pcm(words: str, **extra) -> bytes:
        return client.audio.speech.create(model="orpheus", voice="tara", input=words, response_format="pcm",
                                          extra_body={"seed": 5, "max_tokens": 70, **extra}).content

    pieces = PIECES.split(text)
    assert len(pieces) == 2
    assert pcm(text, sentence_chunking=True) == b"".join(pcm(p) for p in pieces)
    r = httpx.post(f"{server.url}/v1/audio/speech", json={"input": "hi", "voice": "tara", "ref_audio": "UklGRg=="})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ref_audio"
    assert "does not support voice cloning" in r.json()["error"]["message"]
    voices = httpx.get(f"{server.url}/v1/audio/voices").json()["voices"]
    assert {(v["model"], v["language"], v["source"]) for v in voices} == {("orpheus", "en", "bundled")}
