"""Where a Z-Image LoRA lands in ``ZImageTransformer``.

Our module names are diffusers' (``layers.N.attention.to_q``, ``noise_refiner.N.feed_forward.w1``,
``all_final_layer.2-1.linear``, ...), so a diffusers/PEFT adapter folds by name. diffusers'
Z-Image loader also takes the layouts other trainers write, and so does ``ZImageLoraLayout``:

* kohya / sd-scripts names: ``lora_unet_layers_0_attention_to_q`` (the module path with every
  ``.`` written as ``_``), with ``lora_down`` / ``lora_up`` weights and an ``alpha`` each;
* dotted names: ``layers.0.attention.to.q`` with ``lora.down`` / ``lora.up`` weights;
* the original Z-Image module tree: ``attention.out`` is ``attention.to_out.0``, and a fused
  ``attention.qkv`` update splits into its q, k and v thirds.

A name is compared with the model's own linear layers with every ``.`` read as ``_``, so the
underscores a flattened name lost come back from the model rather than from a list of guesses.
Some trainers write a block's projections twice, fused and split (``qkv`` next to ``to_q``,
``out`` next to ``to_out.0``); the fused copy is then dropped, as diffusers drops it, so the
update is not applied twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from mstar.model.lora import LoraAdapter, LoraPair, fold_adapter, read_adapter
from mstar.model.z_image.transformer import ZImageAttention

KOHYA_PREFIX = "lora_unet_"

Target = tuple[str, int, int]  # (module, chunk, chunks), as mstar.model.lora.fold_adapter takes it


def _flat(name: str) -> str:
    return name.replace(".", "_")


class ZImageLoraLayout:
    """The adapter-name -> module lookup of one ``ZImageTransformer`` (built from its modules)."""

    def __init__(self, model: nn.Module):
        self.lookup: dict[str, list[Target]] = {}
        self.fused: set[str] = set()  # flattened names of the original tree's qkv / out
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                self.lookup[_flat(name)] = [(name, 0, 1)]
            if isinstance(module, ZImageAttention):
                qkv = [(f"{name}.to_{p}", i, 3) for i, p in enumerate("qkv")]
                for alias, targets in (("qkv", qkv), ("out", [(f"{name}.to_out.0", 0, 1)])):
                    self.lookup[f"{_flat(name)}_{alias}"] = targets
                    self.fused.add(f"{_flat(name)}_{alias}")

    @staticmethod
    def _key(name: str) -> str:
        return _flat(name.removeprefix(KOHYA_PREFIX))

    def targets(self, name: str) -> Sequence[Target]:
        """The modules the adapter's module ``name`` updates; an unknown name is returned as it
        is, for ``fold_adapter`` to refuse with the name in its message."""
        return self.lookup.get(self._key(name), [(name, 0, 1)])

    def without_duplicates(self, pairs: Mapping[str, LoraPair]) -> dict[str, LoraPair]:
        """``pairs`` less the fused ``qkv`` / ``out`` copies of projections the file also holds split."""
        def modules(name: str) -> set[str]:
            return {target for target, _, _ in self.targets(name)}

        split = set().union(*(modules(name) for name in pairs if self._key(name) not in self.fused))
        return {name: pair for name, pair in pairs.items()
                if self._key(name) not in self.fused or not modules(name) & split}


def fold_z_image_adapters(model: nn.Module, adapters: Sequence[LoraAdapter], key: str = "model_kwargs.lora") -> None:
    """Fold each adapter into ``model`` in order (their updates add up), in any layout above."""
    layout = ZImageLoraLayout(model)
    for i, adapter in enumerate(adapters):
        where = f"{key}[{i}]"
        pairs = layout.without_duplicates(read_adapter(adapter.path, where))
        fold_adapter(model, pairs, adapter.scale, layout.targets, where)
