"""Parity of the Canary-Qwen port, loaded from a tiny checkpoint in the released NeMo layout,
against references built from transformers' modules (float32, CPU): the encoder and the
modality adapter against ``ParakeetEncoder``s (the adapter's linear ``pre_encode`` in place of
its subsampling), the projection against a hand computation, the LoRA merge against a
hand-computed ``W + alpha / r * B @ A``, and the LLM's logits at every step of a paged
schedule (prefills with audio rows spliced in, decodes, a sequence joining mid-way) against
``Qwen3ForCausalLM`` over the same input embeddings."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.audio_prompt import splice
from mstar.model.canary_qwen.checkpoint import CanaryQwenCheckpoint
from tests.support.fastconformer import (
    CANARY_QWEN_REPO,
    LORA_ALPHA,
    LORA_R,
    canary_qwen_reference,
    snapshot_dir,
    write_canary_qwen,
)
from tests.support.markers import needs_cuda
from tests.support.pages import Pages

TOL = 1e-5
PAGE_SIZE, NUM_PAGES = 4, 96
MEL_FRAMES = {"a": 150, "b": 97, "c": 61}
LOCATOR = 70


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Our model loaded from the released layout, and the reference modules it was written from."""
    root = tmp_path_factory.mktemp("hub")
    refs = write_canary_qwen(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        ckpt = CanaryQwenCheckpoint.locate(str(snapshot_dir(root, CANARY_QWEN_REPO)), str(root))
        ours = ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0)
    return ours, refs


def test_speech_side_matches_parakeet_encoders_and_projection(loaded) -> None:
    ours, (encoder, adapter, proj, _) = loaded
    gen = torch.Generator().manual_seed(2)
    mel = torch.zeros(len(MEL_FRAMES), max(MEL_FRAMES.values()), 16)
    mask = torch.zeros(len(MEL_FRAMES), mel.shape[1], dtype=torch.long)
    for i, n in enumerate(MEL_FRAMES.values()):
        mel[i, :n] = torch.randn(n, 16, generator=gen)
        mask[i, :n] = 1
    with torch.no_grad():
        ref_enc = encoder(mel, attention_mask=mask)
        frames, lengths = ours.encoder(mel, mask.sum(-1))
        out_mask = ref_enc.attention_mask
        ref_adapted = adapter(ref_enc.last_hidden_state, attention_mask=out_mask).last_hidden_state
        adapted, adapted_lengths = ours.adapter(frames, lengths)
        embeds, embed_lengths = ours.encode(mel, mask.sum(-1))
    assert lengths.tolist() == out_mask.sum(-1).tolist() == adapted_lengths.tolist() == embed_lengths.tolist()
    for i, (name, n) in enumerate(zip(MEL_FRAMES, lengths.tolist())):
        check(f"encoder clip {name}", frames[i, :n], ref_enc.last_hidden_state[i, :n])
        check(f"adapter clip {name}", adapted[i, :n], ref_adapted[i, :n])
        by_hand = adapted[i, :n] @ proj.weight.T + proj.bias
        check(f"projection clip {name}", embeds[i, :n], by_hand)


def test_lora_is_merged_as_by_hand(loaded) -> None:
    ours, _ = loaded
    _, _, _, base, lora = canary_qwen_reference()  # the same seed: the checkpoint's base weights and pairs
    for layer in range(2):
        attn = ours.llm.model.layers[layer].self_attn
        q, k, v = attn.qkv_proj.weight.split([64, 32, 32])
        want = {}
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = base.model.layers[layer].self_attn.get_submodule(name).weight.detach().clone()
            pair = lora.get(f"model.layers.{layer}.self_attn.{name}")
            if pair is not None:  # by hand: W + alpha / r * B @ A, entry by entry
                a, b = pair
                for row in range(weight.shape[0]):
                    weight[row] += (LORA_ALPHA / LORA_R) * sum(b[row, j] * a[j] for j in range(LORA_R))
            want[name] = weight
        check(f"layer {layer} q_proj", q, want["q_proj"], 1e-6)
        check(f"layer {layer} k_proj", k, want["k_proj"], 0.0)
        check(f"layer {layer} v_proj", v, want["v_proj"], 1e-6)
        assert not torch.equal(q, base.model.layers[layer].self_attn.q_proj.weight)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_cuda(triton=True))],
                         ids=["cpu-eager", "cuda-fused"])
def test_llm_logits_match_qwen3_at_every_paged_step(loaded, fused: bool) -> None:
    """On the CPU eagerly; on a GPU (fp32) with ``fused_kernels``, against the same CPU reference."""
    ours, (_, _, _, ref) = loaded
    device = torch.device("cuda" if fused else "cpu")
    if fused:
        import copy

        ours = copy.deepcopy(ours).to(device)
        ours.use_fused_kernels(True)
    gen = torch.Generator().manual_seed(5)
    audio = {"a": torch.randn(9, 48, generator=gen), "b": torch.randn(5, 48, generator=gen),
             "c": torch.randn(3, 48, generator=gen)}
    prompts = {s: [1, 3, 5, 6, 7, 8] + [LOCATOR] * len(a) + [2, 1, 4] for s, a in audio.items()}
    prompts["c"] = [1, 3, 9] + [LOCATOR] * 3 + [2, 1, 4]
    steps = [["a", "b"]] + [["a", "b"]] * 3 + [["c", "a", "b"]] + [["b", "c", "a"]] * 4
    caches = allocate_kv_cache(2, NUM_PAGES, PAGE_SIZE, 2, 16, torch.float32, device)
    pages = Pages(NUM_PAGES, PAGE_SIZE, seed=3)
    embeds_of: dict[str, torch.Tensor] = {}
    for i, seqs in enumerate(steps):
        new = {s: [int(torch.randint(10, 70, (1,), generator=gen))] if s in embeds_of else prompts[s] for s in seqs}
        counts = [len(new[s]) for s in seqs]
        meta = pages.step(list(zip(seqs, counts)))
        meta = replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in fields(meta)
                                if isinstance(getattr(meta, f.name), torch.Tensor)})
        ids = torch.tensor([t for s in seqs for t in new[s]], device=device)
        with torch.no_grad():
            rows = []
            for s in seqs:
                step_ids = torch.tensor(new[s], device=device)
                e = ours.embed_input_ids(step_ids.masked_fill(step_ids == LOCATOR, 0))
                if s not in embeds_of:
                    e = splice(e, step_ids, LOCATOR, audio[s].to(device))
                rows.append(e)
                e = e.cpu()
                embeds_of[s] = torch.cat([embeds_of[s], e]) if s in embeds_of else e
            logits = ours.compute_logits(ours(ids, meta, caches, inputs_embeds=torch.cat(rows))).cpu()
            refs = [ref(inputs_embeds=embeds_of[s][None], use_cache=False).logits[0, -len(new[s]):] for s in seqs]
        check(f"llm step {i} {seqs} {counts}", logits, torch.cat(refs))
