"""Where the CUDA-graph equivalence tests build their engines: the CPU by default (``BucketGraphs``
runs the recorded step eagerly there), or the device ``MSTAR_GRAPH_TEST_DEVICE`` names, so that
the same tests check real captures and replays on a GPU machine
(``MSTAR_GRAPH_TEST_DEVICE=cuda pytest tests/model/nemotron_duplex -k graph``)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("MSTAR_GRAPH_TEST_DEVICE", "cpu"))

# Off CUDA a bucket counts as captured when first used, so a test can tell which buckets its
# ticks replayed; on CUDA every bucket is captured at build and no replay runs Python.
REPLAYS_RUN_PYTHON = DEVICE.type != "cuda"
on_cuda_replays_run_no_python = pytest.mark.skipif(
    not REPLAYS_RUN_PYTHON, reason="watches the recorded step's Python, which a CUDA replay never runs")
