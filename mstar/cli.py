"""Command line: ``mstar serve <model> ...``, ``mstar models``, ``mstar watermark detect FILE``
and ``mstar-serve --config FILE ...``.

This module only parses arguments, sets up logging and reports errors; ``mstar.server.serve.serve``
(imported lazily, so ``--help`` stays fast) starts the workers and the HTTP server.

An expected error (a ``ConfigError``: a bad config or option, an unknown model, weights that
cannot be found, a device or transport that is not there, a port in use) is one line on
stderr naming the cause and the fix, and exit status 2, as argparse does for bad arguments.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from mstar import __version__
from mstar.server.options import (
    BACKENDS,
    DEVICES,
    LOG_LEVELS,
    TENSOR_COMM_PROTOCOLS,
    ServeOptions,
    VideoJobOptions,
)

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


def _gpu_list(value: str) -> list[int]:
    parts = [v.strip() for v in value.split(",") if v.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated GPU indices, got {value!r}")
    return [int(p) for p in parts]


def _port(value: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {port}")
    return port


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"timeout must be a positive number of seconds, got {value}")
    return seconds


def _count(value: str) -> int:
    if not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number, 0 or more, got {value!r}")
    return int(value)


def _existing_file(value: str) -> str:
    if not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"no such file: {value}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser, *, config_required: bool) -> None:
    """The options shared by ``mstar serve`` and ``mstar-serve``."""
    parser.add_argument(
        "--config", type=_existing_file, required=config_required, metavar="FILE",
        help="YAML deployment config; explicit options override its settings",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=_port, default=8000, help="port to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--device", choices=DEVICES, default=None,
        help="device to run the model on (default: the config file's, else cpu)",
    )
    parser.add_argument(
        "--gpus", type=_gpu_list, default=None, metavar="0,1",
        help="comma-separated GPU indices for the workers (default: all visible)",
    )
    parser.add_argument(
        "--cache-dir", default=None, metavar="DIR",
        help="where model weights are downloaded and cached (default: chosen by the runtime)",
    )
    parser.add_argument(
        "--tensor-comm-protocol", choices=TENSOR_COMM_PROTOCOLS, default="SHM", type=str.upper,
        help="how workers exchange tensors (default: %(default)s)",
    )
    parser.add_argument(
        "--backend", choices=BACKENDS, default=None, type=str.lower,
        help="who starts the workers: local processes, or actors on a Ray cluster (default: the "
             "config's backend, else local; see docs/multinode.md)",
    )
    parser.add_argument(
        "--served-model-name", action="append", default=None, metavar="NAME",
        help="a name the API accepts and lists for the model (repeatable; default: the model id)",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", type=str.lower,
        help="logging level (default: %(default)s)",
    )
    parser.add_argument(
        "--log-stats", action="store_true",
        help="log each request's time per graph node when it finishes",
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=None, metavar="SECONDS",
        help="fail requests that take longer, queueing included, with a 504 "
             "(default: the config's request_timeout_s, else none)",
    )
    parser.add_argument(
        "--max-worker-restarts", type=_count, default=3, metavar="N",
        help="restart a worker process that dies at most N times per rank, then shut the "
             "server down with exit status 1 (default: %(default)s)",
    )
    parser.add_argument(
        "--video-jobs-max", type=_count, default=64, metavar="N",
        help="keep at most N /v1/videos jobs, running or finished (default: %(default)s)",
    )
    parser.add_argument(
        "--video-jobs-ttl", type=_seconds, default=3600.0, metavar="SECONDS",
        help="forget a finished /v1/videos job and its mp4 this long after it finished "
             "(default: %(default)s)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("MSTAR_API_KEY"), metavar="KEY",
        help="require 'Authorization: Bearer KEY' on the API (default: $MSTAR_API_KEY, if set)",
    )
    parser.add_argument(
        "--in-process", action="store_true",
        help="run the model inside the server process instead of worker processes (debugging)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``mstar`` command and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="mstar",
        description="M*: serve composite multimodal models over an OpenAI-compatible API.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP",
        description="Serve a model over HTTP (OpenAI-compatible API).",
    )
    serve.add_argument("model", help="model registry name (`mstar models` lists them)")
    add_serve_arguments(serve, config_required=False)
    commands.add_parser(
        "models",
        help="list the models this build serves",
        description="List every model registry name with what it serves, its default weights and "
                    "whether it runs offline here (its weights installed or cached). Loads no model.",
    )
    watermark = commands.add_parser(
        "watermark", help="check audio for the AudioSeal watermark",
        description="The AudioSeal watermark a deployment adds (model_kwargs.audio_watermark).",
    ).add_subparsers(dest="watermark_command", metavar="ACTION", required=True)
    detect = watermark.add_parser(
        "detect", help="score a sound file and decode its 16-bit message",
        description="Print the share of the file's samples the AudioSeal detector scores as marked "
                    "(the detection probability) and the decoded 16-bit message.",
    )
    detect.add_argument("file", type=_existing_file, help="a sound file (WAV, FLAC, OGG)")
    detect.add_argument("--detector", default="audioseal_detector_streaming",
                        help="an AudioSeal detector card (weights from the Hugging Face cache) or a checkpoint "
                             "file (default: %(default)s)")
    detect.add_argument("--message", help="the deployment's payload (int, 0x hex or 16 0/1 characters): "
                                          "also report whether the decoded message matches it")
    detect.add_argument("--threshold", type=float, default=0.5, help="per-sample score threshold (default 0.5)")
    detect.add_argument("--rate", type=int, default=24000,
                        help="the rate the mark was added at; the file is resampled to it (default 24000)")
    detect.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def watermark_detect(args: argparse.Namespace) -> int:
    """``mstar watermark detect``: the verdict on one file, as text or JSON."""
    import json

    from mstar.model.audio_watermark import detect_file, load_detector

    expected = args.message
    try:
        if expected is not None and len(expected) != 16:
            expected = int(expected, 0)
        verdict = detect_file(args.file, load_detector(args.detector), rate=args.rate, threshold=args.threshold,
                              expected=expected)
    except (OSError, ValueError, RuntimeError) as err:
        print(f"mstar watermark detect: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(verdict))
    else:
        print(f"probability: {verdict['probability']:.4f}")
        print(f"message: {verdict['message']} (0x{verdict['message']:04X}, {verdict['message_bits']})")
        if "message_matches" in verdict:
            print(f"message matches: {'yes' if verdict['message_matches'] else 'no'}")
    return 0


def build_config_parser() -> argparse.ArgumentParser:
    """The ``mstar-serve`` command: the model comes from the config file."""
    parser = argparse.ArgumentParser(
        prog="mstar-serve", description="Serve the model that a deployment config names."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    add_serve_arguments(parser, config_required=True)
    return parser


def options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        model=getattr(args, "model", None),
        config=args.config,
        host=args.host,
        port=args.port,
        device=args.device,
        gpus=args.gpus,
        cache_dir=args.cache_dir,
        tensor_comm_protocol=args.tensor_comm_protocol,
        backend=args.backend,
        log_level=args.log_level,
        log_stats=args.log_stats,
        api_key=args.api_key,
        in_process=args.in_process,
        served_model_names=list(args.served_model_name or []),
        timeout=args.timeout,
        max_worker_restarts=args.max_worker_restarts,
        video_jobs=VideoJobOptions(max_jobs=args.video_jobs_max, ttl_s=args.video_jobs_ttl),
    )


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt="%H:%M:%S", force=True)


def _run(prog: str, options: ServeOptions) -> int:
    setup_logging(options.log_level)
    from mstar.config import ConfigError
    from mstar.server.serve import serve  # lazy: pulls in the HTTP server

    try:
        return serve(options)
    except ConfigError as err:  # expected: one line, as argparse reports a bad argument
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2


def list_models() -> int:
    """``mstar models``: one row per registry key (no model is loaded)."""
    from mstar.model.registry import describe, registered

    def listed(names: tuple[str, ...]) -> str:
        return ",".join(names) or "-"

    rows = [("MODEL", "TASKS", "INPUT -> OUTPUT", "DEFAULT WEIGHTS", "OFFLINE HERE")]
    for info in map(describe, registered()):
        rows.append((info.key, listed(info.tasks), f"{listed(info.inputs)} -> {listed(info.outputs)}",
                     info.default_weights or "-", f"{'yes' if info.offline else 'no'}: {info.why}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mstar``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "models":
        return list_models()
    if args.command == "watermark":
        return watermark_detect(args)
    return _run("mstar serve", options_from_args(args))


def serve_from_config(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mstar-serve``."""
    return _run("mstar-serve", options_from_args(build_config_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
