"""Pi0.5's fast path, applied to a policy from outside: ``torch.compile`` of the action
expert's dense blocks, and of the prefix's (the language model's and SigLIP's norms and MLPs).

A denoise step runs the expert over ``B x chunk`` tokens against the cached prefix, the same
shapes at every one of a request's steps. Its time at batch 1 goes to many small kernels: per
layer two adaptive RMS norms (float32 upcast, modulation, gate) and a gated-GELU MLP, each a
handful of element-wise launches around three matrix products. Compiling those blocks fuses
the element-wise work into the products' neighbours. The paged attention between them stays
eager: its metadata carries host-side sequence lengths that differ per request, and a
compiled graph guarding on them would retrace for every new prefix length. The prefill's
blocks are the same kind of work over many more tokens (a prefix is ~800 tokens an
observation): their element-wise passes (float32 norms, tanh-GELU, the gating product) are
what compiling fuses.

Each block is compiled with dynamic token counts (``dynamic=None``: traced static first, then
once more with a symbolic count when a second batch size comes), so the graphs of one layer
serve every layer (parameters are graph inputs) and every batch size. Eager stays the
reference: ``tests/model/test_pi05_fast.py`` checks the compiled expert against it.
"""

from __future__ import annotations

from torch import nn

from mstar.model.pi05.modeling import Pi05Policy


def expert_blocks(policy: Pi05Policy) -> list[nn.Module]:
    """The modules ``compile_expert`` compiles: every expert layer's two norms and MLP, and
    the expert's final norm."""
    expert = policy.paligemma_with_expert.gemma_expert.model
    blocks: list[nn.Module] = []
    for layer in expert.layers:
        blocks += [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp]
    return [*blocks, expert.norm]


def prefix_blocks(policy: Pi05Policy) -> list[nn.Module]:
    """The prefill's modules ``compile_policy`` compiles: every language-model layer's two norms
    and MLP and its final norm, every SigLIP layer's two layer norms and MLP and its last norm."""
    lm = policy.language_model
    blocks: list[nn.Module] = []
    for layer in lm.layers:
        blocks += [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp]
    vision = policy.paligemma.vision_tower.vision_model
    for layer in vision.encoder.layers:
        blocks += [layer.layer_norm1, layer.layer_norm2, layer.mlp]
    return [*blocks, lm.norm, vision.post_layernorm]


def compile_policy(policy: Pi05Policy, backend: str = "inductor") -> Pi05Policy:
    """Compile ``policy``'s denoise and prefill blocks in place (``nn.Module.compile``) and
    return it."""
    for block in expert_blocks(policy) + prefix_blocks(policy):
        block.compile(backend=backend, dynamic=None)
    return policy
