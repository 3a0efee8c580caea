"""Where the CUDA-graph equivalence tests build their engines: the CPU by default (``BucketGraphs``
runs the recorded step eagerly there), or the device ``MSTAR_GRAPH_TEST_DEVICE`` names, so that
the same tests check real captures and replays on a GPU machine
(``MSTAR_GRAPH_TEST_DEVICE=cuda pytest tests/model/nemotron_duplex -k graph``)."""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("MSTAR_GRAPH_TEST_DEVICE", "cpu"))
