"""CFG parallelism over two worker processes: FLUX.2 [klein] base with ``cfg_parallel`` and the
unconditional branch (``dit_uncond``) on rank 1, tensors between the ranks over shared memory,
against the batched pair on one rank (issue #7: a guided denoise step with CFG split over two
ranks equals the batched pair). The same runs on two GPUs (``cuda``: the pair on GPU 0, the
branches on GPUs 0 and 1; skipped without them), in float32 without TF32."""

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from test_flux2_klein_walk import reference  # noqa: E402, F401  (tiny diffusers-layout checkpoint)

from mstar.config import parse_config  # noqa: E402
from mstar.contract import ImageSpec  # noqa: E402
from mstar.model.spec import OutputStream  # noqa: E402
from mstar.runtime.launch import start  # noqa: E402
from tests.distributed.helpers import devices, fp32_only  # noqa: E402

SPEC = ImageSpec("cfg", "a cat", 48, 32, 1, 5, 3, guidance_scale=4.0)


class KeepImage(OutputStream):
    """Keeps the emitted image tensor itself (not its PNG): uint8 pixels [H, W, 3]."""

    def __init__(self):
        self.image = None

    def feed(self, modality, value):
        self.image = value.clone()
        return None


def image_of(deployment, request_id: str, spec: ImageSpec) -> torch.Tensor:
    request = deployment.spec.prepare_image(spec)
    stream, done, errors = KeepImage(), threading.Event(), []

    def sink(event):
        if event is None:
            done.set()
        elif event.error:
            errors.append(event.error)

    deployment.runtime.submit(request_id, request, stream, sink)
    assert done.wait(300), "the request did not finish"
    assert not errors and stream.image is not None, errors
    return stream.image


@pytest.fixture(scope="module", params=devices(2))
def device(request) -> str:
    return request.param


def deployment_config(reference_root: Path, device: str, **extra) -> dict:
    return {"model": "flux2_klein_base", "model_path": str(reference_root), "device": device, "dtype": "float32",
            **extra}


@pytest.fixture(scope="module")
def pair_images(reference, device):  # noqa: F811
    with fp32_only(device):
        d = start(parse_config(deployment_config(reference[0], device)), in_process=True)
        try:
            yield image_of(d, "pair", SPEC), image_of(d, "plain", ImageSpec(**{**SPEC.__dict__, "guidance_scale": 1.0}))
        finally:
            d.close()


@pytest.mark.parametrize("protocol", ["SHM"])
def test_cfg_split_over_two_ranks_equals_the_batched_pair(reference, device, pair_images, protocol):  # noqa: F811
    config = parse_config(deployment_config(
        reference[0], device, tensor_comm_protocol=protocol,
        node_groups=[{"node_names": ["text_encoder", "dit", "vae"], "ranks": [0]},
                     {"node_names": ["dit_uncond"], "ranks": [1]}],
        model_kwargs={"cfg_parallel": True},
    ))
    with fp32_only(device):  # the worker processes inherit it
        d = start(config, in_process=False)
        try:
            split = image_of(d, "split", SPEC)
            split_again = image_of(d, "split-again", SPEC)  # loop-carried versions hold up over requests
        finally:
            d.close()
    pair, plain = pair_images
    assert split.shape == pair.shape == (32, 48, 3)
    split, split_again, pair, plain = (x.int() for x in (split, split_again, pair, plain))
    assert (split - pair).abs().max() <= 1  # at most a rounding flip of a pixel at a .5 boundary
    assert torch.equal(split, split_again)
    assert (plain - pair).abs().float().mean() > 1  # guidance is visible in the image
