"""llama.cpp's side of ``cpu_defaults``: the SmolLM2 GGUF through ``llama-cpp-python``, in a
process of its own.

It must not share a process with torch: with torch imported first, llama.cpp's first decode
crashes (llama-cpp-python 0.3.36 built from source, torch 2.13 CPU; the two OpenMP runtimes'
thread pools). So ``cpu_defaults`` runs this file as a script and reads its JSON from stdout;
nothing here imports torch. The prompts, the greedy settings (EOS masked) and the two phases
(one stream; ``concurrency`` requests one after another, as llama.cpp serves one sequence at
a time) are those of ours.

    python benchmarks/llama_cpp_reference.py GGUF '{"runs": 2, "tokens": 128, ...}'
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from importlib import metadata

THREADS = 2
TOPICS = ["a lighthouse keeper", "a lost cat", "a bakery at dawn", "a train in the snow", "a robot gardener",
          "a pirate's map", "a mountain village", "a jazz musician"]
TEXT_PROMPTS = ["Name the capital of France.", "Write a haiku about the sea.",
                "Explain photosynthesis in one sentence.", "List three prime numbers.", "Who wrote Romeo and Juliet?"]


def story(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}."


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def run(gguf_path: str, runs: int, tokens: int, concurrency: int, text_tokens: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf_path, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=2048, verbose=False)
    no_eos = {llm.token_eos(): -1e9}

    def stream(prompt: str) -> tuple[float, list[float]]:
        sent, times = time.perf_counter(), []
        for chunk in llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=tokens,
                                                temperature=0.0, stream=True, logit_bias=no_eos):
            if chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
        return sent, times

    stream("Hello!")  # warm-up
    timed = []
    for _ in range(runs):
        sent, times = stream(story(0))
        itl = statistics.median(b - a for a, b in zip(times, times[1:]))
        start, count = time.perf_counter(), 0
        for i in range(concurrency):  # one sequence at a time: back to back
            count += len(stream(story(i))[1])
        timed.append({"itl_ms": 1e3 * itl, "ttft_ms": 1e3 * (times[0] - sent),
                      "tok_s_1": len(times) / (times[-1] - sent), "tok_s_n": count / (time.perf_counter() - start)})
        print(f"llama.cpp: { {k: round(v, 2) for k, v in timed[-1].items()} }", file=sys.stderr, flush=True)
    texts = {}
    for prompt in TEXT_PROMPTS:
        out = llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=text_tokens,
                                         temperature=0.0)
        texts[prompt] = out["choices"][0]["message"]["content"]
    return {"median": median_of(timed), "runs": timed, "texts": texts,
            "version": metadata.version("llama_cpp_python")}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], **json.loads(sys.argv[2]))))
