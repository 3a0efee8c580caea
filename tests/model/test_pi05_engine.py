"""Pi0.5's engine against the eager policy: requests that arrive while others are denoising
(a prefill in the same ``run`` as another request's steps), each at its own iteration and step
count, end with the chunks ``sample_actions`` makes alone; pages come back when they finish.
With ``cuda_graphs`` (replayed eagerly off CUDA, over the same static buffers, batch and
key-length buckets) the steps and the prefills run padded to a bucket, the padded rows and
prompt tokens on the scratch page."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.base import EngineItem
from mstar.model.pi05.checkpoint import IDENTITY, Embodiment
from mstar.model.pi05.config import Pi05Config
from mstar.model.pi05.engine import Pi05Engine
from mstar.model.pi05.modeling import Pi05Policy
from mstar.model.weights import init_dummy_weights
from tests.support.markers import needs_cuda
from tests.support.pi05 import tiny_lerobot_config


@pytest.mark.parametrize(("cuda_graphs", "device"),
                         [(False, "cpu"), (True, "cpu"), pytest.param(True, "cuda", marks=needs_cuda)])
def test_interleaved_requests_equal_eager(cuda_graphs: bool, device: str) -> None:
    torch.manual_seed(0)
    model = Pi05Policy(Pi05Config.from_lerobot(tiny_lerobot_config()))
    init_dummy_weights(model, seed=4, std=0.1)
    model.eval()
    engine = Pi05Engine(model.to(device), lambda name: Embodiment(IDENTITY, IDENTITY), torch.device(device),
                        torch.float32,
                        num_pages=64, page_size=4, cuda_graphs=cuda_graphs, batch_sizes=(2, 4))
    g = torch.Generator().manual_seed(1)
    requests = {  # id -> (pixels, ids, noise, steps)
        "a": (torch.rand(2, 3, 16, 16, generator=g) * 2 - 1, torch.randint(0, 90, (11,), generator=g),
              torch.randn(5, 6, generator=g), 3),
        "b": (torch.rand(1, 3, 16, 16, generator=g) * 2 - 1, torch.randint(0, 90, (7,), generator=g),
              torch.randn(5, 6, generator=g), 4),
        "c": (torch.rand(1, 3, 16, 16, generator=g) * 2 - 1, torch.randint(0, 90, (19,), generator=g),
              torch.randn(5, 6, generator=g), 3),
    }
    actions = {r: noise for r, (_, _, noise, _) in requests.items()}
    done = {}

    def item(r, op, iteration=0):
        pixels, ids, _, steps = requests[r]
        inputs = {"pixels": pixels, "prompt_ids": ids} if op == "prefill" else {"actions": actions[r]}
        return EngineItem(r, op, iteration, inputs, {"num_steps": steps, "action_dim": 5})

    schedule = [[item("a", "prefill")]]  # b and c arrive together while a denoises
    for k in range(5):
        batch = []
        if k < 3:
            batch.append(("a", "step", k))
        elif k == 3:
            batch.append(("a", "finish", 0))
        if k == 0:
            batch += [("b", "prefill", 0), ("c", "prefill", 0)]
        elif k <= 4:
            batch.append(("b", "step", k - 1))
            batch.append(("c", "step", k - 1) if k <= 3 else ("c", "finish", 0))
        schedule.append(batch)
    schedule.append([("b", "finish", 0)])
    for batch in schedule:
        items = [b if isinstance(b, EngineItem) else item(*b) for b in batch]
        for it, out in zip(items, engine.run(items), strict=True):
            if it.op == "step":
                actions[it.request_id] = out.outputs["actions"]
            elif it.op == "finish":
                done[it.request_id] = out.outputs["action"]
    assert max(engine.forward_rows) == 3  # a's, b's and c's steps shared forwards
    assert engine.pool.num_used_pages == 0
    if cuda_graphs:  # one or two requests' steps in bucket 2, three padded to 4; keys to multiples of 64
        # a key length's first step captured both buckets, whichever it needed
        lengths = {length for _, length in engine.graphs.inputs}
        assert set(engine.graphs.inputs) == {(rows, length) for rows in (2, 4) for length in lengths}
        assert all(length % 64 == 0 for length in lengths)
        # prefills: a alone padded to bucket 2 (two images, 11 prompt tokens), b and c in one
        # graph of 2 (one image, 7 and 19 prompt tokens: the prompts padded to 32)
        assert set(engine.prefill_graphs.inputs) == {(2, 2, 16), (2, 1, 32)}
    for r, (pixels, ids, noise, steps) in requests.items():
        want = model.sample_actions([pixels.to(device)], [ids.to(device)], noise[None].to(device), num_steps=steps,
                                    page_size=4)[0, :, :5].cpu()
        assert done[r].shape == (5, 5) and done[r].dtype == torch.float32
        tol = 1e-5 if device == "cpu" else 1e-4  # TF32 and other kernels on the GPU
        assert float((done[r] - want).abs().max()) <= tol * max(1.0, float(want.abs().max()))
        assert float((want - noise[:, :5]).abs().max()) > 0.1


def test_a_graphed_prefill_runs_as_parts_of_the_batch_buckets() -> None:
    """Any count of requests replays a few graphs: the largest bucket that fits, again and
    again, a rest below every bucket padded up to the smallest."""
    model = Pi05Policy(Pi05Config.from_lerobot(tiny_lerobot_config()))

    def parts(sizes, count):
        engine = Pi05Engine(model, lambda name: Embodiment(IDENTITY, IDENTITY), torch.device("cpu"), torch.float32,
                            num_pages=8, page_size=4, cuda_graphs=True, batch_sizes=sizes)
        return engine.prefill_parts(count)

    assert parts((1, 2, 4, 8, 16), 15) == [(8, 8), (4, 4), (2, 2), (1, 1)]
    assert parts((1, 2, 4, 8, 16), 16) == [(16, 16)]
    assert parts((1, 2, 4, 8, 16), 37) == [(16, 16), (16, 16), (4, 4), (1, 1)]
    assert parts((2, 4), 1) == [(1, 2)]
    assert parts((2, 4), 7) == [(4, 4), (2, 2), (1, 2)]
