"""Argument parsing of ``mstar serve`` / ``mstar-serve`` (no runtime is started)."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from mstar import __version__, cli
from mstar.server.options import ServeOptions, VideoJobOptions

ROOT = Path(__file__).resolve().parents[2]


def _serve_options(*argv: str) -> ServeOptions:
    return cli.options_from_args(cli.build_parser().parse_args(["serve", *argv]))


def test_serve_defaults() -> None:
    options = _serve_options("smollm2-135m")
    assert options == ServeOptions(model="smollm2-135m", api_key=options.api_key)
    assert (options.host, options.port, options.tensor_comm_protocol) == ("127.0.0.1", 8000, "SHM")
    assert options.device is None and options.gpus is None and not options.in_process


def test_serve_all_options(tmp_path: Path) -> None:
    config = tmp_path / "deploy.yaml"
    config.write_text("model: x\n")
    options = _serve_options(
        "llama", "--config", str(config), "--port", "9001", "--host", "0.0.0.0", "--device", "cuda",
        "--gpus", "0,1", "--cache-dir", "/tmp/c", "--tensor-comm-protocol", "tcp",
        "--log-level", "DEBUG", "--log-stats", "--api-key", "k", "--in-process",
        "--served-model-name", "a", "--served-model-name", "b",
    )
    assert options == ServeOptions(
        model="llama", config=str(config), host="0.0.0.0", port=9001, device="cuda", gpus=[0, 1],
        cache_dir="/tmp/c", tensor_comm_protocol="TCP", log_level="debug", log_stats=True,
        api_key="k", in_process=True, served_model_names=["a", "b"],
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],  # no model
        ["m", "--port", "0"],
        ["m", "--port", "http"],
        ["m", "--gpus", "a,b"],
        ["m", "--device", "tpu"],
        ["m", "--tensor-comm-protocol", "UDP"],
        ["m", "--config", "/no/such/file.yaml"],
    ],
)
def test_serve_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--config", "--port", "--gpus", "--tensor-comm-protocol", "--api-key", "--in-process"):
        assert flag in help_text
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["--version"])
    assert info.value.code == 0 and __version__ in capsys.readouterr().out


def test_config_parser_requires_config(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        cli.build_config_parser().parse_args([])
    config = tmp_path / "c.yaml"
    config.write_text("")
    args = cli.build_config_parser().parse_args(["--config", str(config), "--port", "8100"])
    options = cli.options_from_args(args)
    assert options.model is None and options.config == str(config) and options.port == 8100


def test_entry_points_call_the_runtime(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[ServeOptions] = []
    levels: list[str] = []
    launch = types.ModuleType("mstar.server.serve")
    launch.serve = lambda options: calls.append(options) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mstar.server.serve", launch)
    monkeypatch.setattr(cli, "setup_logging", levels.append)

    assert cli.main(["serve", "m", "--log-level", "warning"]) == 0
    assert calls[-1].model == "m" and levels == ["warning"]
    config = tmp_path / "c.yaml"
    config.write_text("")
    assert cli.serve_from_config(["--config", str(config), "--in-process"]) == 0
    assert calls[-1].config == str(config) and calls[-1].in_process
    assert cli.main([]) == 2  # no command: help, usage error


def test_module_runs_as_script() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mstar.cli", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and __version__ in result.stdout


def test_options_validate() -> None:
    with pytest.raises(ValueError):
        ServeOptions()
    with pytest.raises(ValueError):
        ServeOptions(model="m", tensor_comm_protocol="UDP")  # type: ignore[arg-type]


def test_timeout_option_becomes_the_request_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mstar.server.serve import config_from_options

    options = cli.options_from_args(cli.build_parser().parse_args(["serve", "smollm2", "--timeout", "2.5"]))
    assert options.timeout == 2.5
    assert config_from_options(options).request_timeout_s == 2.5
    assert config_from_options(ServeOptions(model="smollm2")).request_timeout_s is None
    config = tmp_path / "c.yaml"
    config.write_text("model: smollm2\nrequest_timeout_s: 30\nmax_queue_size: 7\n")
    from_file = config_from_options(ServeOptions(config=str(config)))
    assert (from_file.request_timeout_s, from_file.queue_limit) == (30, 7)
    assert config_from_options(ServeOptions(config=str(config), timeout=4)).request_timeout_s == 4
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "smollm2", "--timeout", bad])
        assert "--timeout" in capsys.readouterr().err
    with pytest.raises(ValueError, match="timeout"):
        ServeOptions(model="m", timeout=0)


def test_max_worker_restarts_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert _serve_options("m").max_worker_restarts == 3
    assert _serve_options("m", "--max-worker-restarts", "0").max_worker_restarts == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(SystemExit) as info:
            cli.build_parser().parse_args(["serve", "m", "--max-worker-restarts", bad])
        assert info.value.code == 2
        assert "--max-worker-restarts" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_worker_restarts"):
        ServeOptions(model="m", max_worker_restarts=-1)


def test_video_jobs_options() -> None:
    assert _serve_options("m").video_jobs == VideoJobOptions(max_jobs=64, ttl_s=3600.0)
    chosen = _serve_options("m", "--video-jobs-max", "8", "--video-jobs-ttl", "60").video_jobs
    assert chosen == VideoJobOptions(max_jobs=8, ttl_s=60.0)
    with pytest.raises(ValueError, match="max_jobs"):
        VideoJobOptions(max_jobs=0)
    with pytest.raises(TypeError):
        VideoJobOptions(max_job=3)  # type: ignore[call-arg]  # an unknown key is refused
