"""What a node's tensor- and sequence-parallel degrees must divide (torch-free: placement
checks it at startup, before any weights load)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of one node that parallelism splits.

    ``tensor``: sizes ``tp_size`` must divide (attention heads, KV heads, MLP width), by
    name. ``sequence``: sizes ``tp_size * sp_size`` must divide for Ulysses sequence
    parallelism (the attention heads, split by TP first and by SP within each TP shard);
    empty when the node cannot run sequence parallel.
    """

    tensor: dict[str, int]
    sequence: dict[str, int] = field(default_factory=dict)

    def problems(self, tp_size: int, sp_size: int) -> list[str]:
        """What is wrong with splitting this node ``tp_size`` x ``sp_size`` ways (empty: fine)."""
        found = [f"tp_size {tp_size} does not divide {name} ({size})"
                 for name, size in self.tensor.items() if size % tp_size]
        if sp_size > 1 and not self.sequence:
            found.append("the node does not support sequence parallelism (sp_size must be 1)")
        found += [f"tp_size x sp_size ({tp_size * sp_size}) does not divide {name} ({size})"
                  for name, size in self.sequence.items() if size % (tp_size * sp_size)]
        return found
