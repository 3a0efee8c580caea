"""The CPU decode step of the embedded SmolLM2, engine alone: variants timed interleaved.

Builds the ``smollm2`` decode engine in this process (``configs/smollm2.yaml``: the packaged
Q4_1 GGUF kept quantised, float32 activations) once per variant (``--variants``, e.g.
``eager compile``: ``model_kwargs.compile`` off and on), prefills ``--streams`` prompts of
~``--context`` tokens, then times ``--steps`` greedy decode steps per round, the variants
taking turns round by round (``--rounds``), so that foreign load on a shared machine falls on
all of them alike. Reports each variant's median step over all rounds (and each round's median),
the first-step (compile) time, and the greedy tokens, which must agree across variants.

    python benchmarks/cpu_decode_step.py                          # eager vs compile, 1 and 8 streams
    python benchmarks/cpu_decode_step.py --streams 1 --rounds 9 --steps 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root must be importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import yaml

from mstar.config import parse_config
from mstar.engine.base import EngineItem
from mstar.model.registry import model_class

REPO_ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"eager": {}, "compile": {"compile": True}}


def build(variant: str):
    """The decode engine of ``configs/smollm2.yaml`` with the variant's knobs."""
    data = yaml.safe_load((REPO_ROOT / "configs" / "smollm2.yaml").read_text())
    data["model_kwargs"] = {**data.get("model_kwargs", {}), **VARIANTS[variant]}
    config = parse_config(data, "cpu_decode_step")
    return model_class("smollm2")(config).build_engines({"llm"}, torch.device("cpu"))["llm"]


def prefill(engine, streams: int, context: int, tag: str) -> dict[str, int]:
    """Prefill ``streams`` prompts of ``context`` tokens; each stream's last token."""
    params = {"sampling": {"temperature": 0.0}, "max_new_tokens": 100_000, "stop_token_ids": []}
    items = [EngineItem(f"{tag}{s}", "prefill", 0,
                        {"prompt_ids": torch.tensor([(7 * s + 13 * i) % 1000 + 100 for i in range(context)])}, params)
             for s in range(streams)]
    return {item.request_id: int(out.outputs["token"]) for item, out in zip(items, engine.run(items))}


def decode(engine, last: dict[str, int], steps: int) -> tuple[list[float], list[list[int]]]:
    """Run ``steps`` decode steps; each one's ms and the tokens each step chose."""
    chosen, times = [], []
    for _ in range(steps):
        began = time.perf_counter()
        items = [EngineItem(rid, "decode", 0, {"token": torch.tensor([tok])}, {}) for rid, tok in last.items()]
        outs = engine.run(items)
        last = {rid: int(out.outputs["token"]) for rid, out in zip(last, outs)}
        times.append((time.perf_counter() - began) * 1e3)
        chosen.append(list(last.values()))
    return times, chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["eager", "compile"], choices=sorted(VARIANTS))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"load_before": os.getloadavg(), "torch": torch.__version__, "threads": args.threads, "rows": {}}
    engines, build_s = {}, {}
    for variant in args.variants:
        began = time.perf_counter()
        engines[variant] = build(variant)
        build_s[variant] = time.perf_counter() - began
    results["build_s"] = build_s
    for streams in args.streams:
        state, first, times, tokens = {}, {}, {v: [] for v in args.variants}, {}
        for variant, engine in engines.items():
            state[variant] = prefill(engine, streams, args.context, f"{variant}-{streams}-")
            first[variant] = decode(engine, dict(state[variant]), 1)[0][0] / 1e3  # warm-up (and compile)
        for _ in range(args.rounds):
            for variant, engine in engines.items():
                for rid in state[variant]:
                    engine.release(rid)
                state[variant] = prefill(engine, streams, args.context, f"{variant}-{streams}-")
                steps, chosen = decode(engine, dict(state[variant]), args.steps)
                times[variant].append(steps)
                tokens[variant] = chosen
        for variant, engine in engines.items():
            for rid in state[variant]:
                engine.release(rid)
        # per variant: the median step over all rounds (robust to bursts of foreign load), and
        # each round's median
        row = {v: {"ms_per_step": statistics.median(x for r in t for x in r),
                   "runs": [round(statistics.median(r), 2) for r in t], "first_step_s": first[v]}
               for v, t in times.items()}
        row["tokens_equal"] = all(tokens[v] == tokens[args.variants[0]] for v in args.variants)
        results["rows"][streams] = row
        print(f"streams {streams}: " + ", ".join(
            f"{v} {row[v]['ms_per_step']:.2f} ms/step ({streams / row[v]['ms_per_step'] * 1e3:.0f} tok/s, "
            f"runs {row[v]['runs']}, first step {row[v]['first_step_s']:.1f} s)" for v in args.variants)
            + f"; greedy tokens equal: {row['tokens_equal']}", flush=True)
    results["load_after"] = os.getloadavg()
    print(f"build s: {build_s}; load {results['load_before']} -> {results['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
