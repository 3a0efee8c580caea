"""Which parameters and buffers a build creates, and in which dtype (the build-in-dtype tests)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)


class Registrations:
    """Every parameter and buffer registered while it is entered: ``(module, name, dtype)``."""

    def __enter__(self):
        self.params: list[tuple[nn.Module, str, torch.dtype]] = []
        self.buffers: list[tuple[nn.Module, str, torch.dtype]] = []
        self.handles = [
            register_module_parameter_registration_hook(
                lambda m, n, p: self.params.append((m, n, p.dtype)) if p is not None else None),
            register_module_buffer_registration_hook(
                lambda m, n, b: self.buffers.append((m, n, b.dtype)) if b is not None else None)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def of(self, model: nn.Module, kind: str) -> list[tuple[str, torch.dtype]]:
        """Those registered by ``model``'s own modules (``kind``: "params" or "buffers"), as
        ``(module class.name, dtype)``."""
        own = {id(m) for m in model.modules()}
        return [(f"{type(m).__name__}.{n}", d) for m, n, d in getattr(self, kind) if id(m) in own]
