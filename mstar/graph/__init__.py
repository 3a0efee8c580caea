"""The Walk Graph: a model as a dataflow graph of components, a request as a walk over it.

Pure Python (no torch): models declare nodes and walks with these primitives, and the
graph is validated when the model loads.
"""

from mstar.graph.chunking import (
    Chunk,
    ChunkPolicy,
    FixedFrames,
    GrowingChunks,
    ScheduledChunks,
    SlidingWindow,
)
from mstar.graph.graph import Graph, GraphError
from mstar.graph.nodes import Emit, EngineKind, Modality, Node, Step
from mstar.graph.walk import ClientStream, Loop, Parallel, Sequential, StreamEdge, Walk

__all__ = [
    "Chunk", "ChunkPolicy", "ClientStream", "Emit", "EngineKind", "FixedFrames", "Graph", "GraphError",
    "GrowingChunks", "Loop", "Modality", "Node", "Parallel", "ScheduledChunks", "Sequential", "SlidingWindow",
    "Step", "StreamEdge", "Walk",
]
