"""Parity of the Higgs Audio v3 STT port, loaded from a tiny checkpoint in the release's key
layout, against references built from transformers' modules (float32, CPU): the audio tower
against ``WhisperEncoder`` (its own forward at the full 2 x max_source_positions frames, its
convolutions, positions and layers composed by hand for shorter slices; the average pool
before the final norm), the projector against a hand computation, slices of several lengths
batched against one at a time, and the LLM's logits at every step of a paged schedule
(prefills with audio rows spliced in, greedy decodes, a sequence joining mid-way) against
``Qwen3ForCausalLM`` over the same input embeddings."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.audio_prompt import splice
from mstar.model.higgs_audio.checkpoint import HiggsAudioCheckpoint
from mstar.model.higgs_audio.config import HiggsAudioConfig
from tests.support.fastconformer import snapshot_dir
from tests.support.higgs_audio import N_MELS, REPO, reference_projector, reference_tower, write_higgs_audio
from tests.support.pages import Pages

TOL = 1e-5
PAGE_SIZE, NUM_PAGES = 4, 96
AUDIO = 5  # <|AUDIO|>


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    refs = write_higgs_audio(root)
    ckpt = HiggsAudioCheckpoint.locate(str(snapshot_dir(root, REPO)), str(root))
    return ckpt.load_model(torch.device("cpu"), torch.float32, dummy=False, seed=0), refs


def test_tower_matches_whisper_encoder_at_full_length(loaded) -> None:
    ours, (encoder, _, _) = loaded
    mel = torch.randn(2, N_MELS, 64, generator=torch.Generator().manual_seed(1))
    head = copy.deepcopy(encoder)
    head.layer_norm = torch.nn.Identity()  # the release pools before its final norm
    with torch.no_grad():
        hidden = head(mel).last_hidden_state
        ref = encoder.layer_norm(F.avg_pool1d(hidden.transpose(1, 2), 2, 2).transpose(1, 2))
        check("tower, 64 frames (WhisperEncoder.forward)", ours.audio_tower(mel), ref)


@pytest.mark.parametrize("frames", [50, 37, 9, 3])
def test_tower_and_projector_match_the_reference(loaded, frames: int) -> None:
    ours, (encoder, projector, _) = loaded
    mel = torch.randn(3, N_MELS, frames, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        tower = ours.audio_tower(mel)
        check(f"tower, {frames} frames", tower, reference_tower(encoder, mel))
        embeds = ours.encode(mel)
        check(f"projector, {frames} frames", embeds, reference_projector(projector, tower))
    assert embeds.shape[1] == HiggsAudioConfig.positions(frames)


def test_slices_of_several_lengths_batch_as_one_at_a_time(loaded) -> None:
    ours, _ = loaded
    gen = torch.Generator().manual_seed(4)
    mels = [torch.randn(N_MELS, n, generator=gen) for n in (50, 50, 21, 50, 7, 21)]
    with torch.no_grad():
        together = ours.encode_slices(mels)
        for i, mel in enumerate(mels):
            check(f"slice {i} ({mel.shape[-1]} frames) batched", together[i], ours.encode(mel[None])[0])


def test_llm_logits_match_qwen3_at_every_paged_greedy_step(loaded) -> None:
    ours, (_, _, ref) = loaded
    gen = torch.Generator().manual_seed(5)
    audio = {"a": torch.randn(9, 48, generator=gen), "b": torch.randn(5, 48, generator=gen),
             "c": torch.randn(3, 48, generator=gen)}
    prompts = {s: [1, 6, 7, 8, 3] + [AUDIO] * len(a) + [4, 2, 1, 7] for s, a in audio.items()}
    steps = [["a", "b"]] * 4 + [["c", "a", "b"]] + [["b", "c", "a"]] * 5
    caches = allocate_kv_cache(2, NUM_PAGES, PAGE_SIZE, 2, 16, torch.float32, torch.device("cpu"))
    pages = Pages(NUM_PAGES, PAGE_SIZE, seed=3)
    embeds_of: dict[str, torch.Tensor] = {}
    last: dict[str, int] = {}
    for i, seqs in enumerate(steps):
        new = {s: [last[s]] if s in embeds_of else prompts[s] for s in seqs}
        counts = [len(new[s]) for s in seqs]
        meta = pages.step(list(zip(seqs, counts)))
        ids = torch.tensor([t for s in seqs for t in new[s]])
        with torch.no_grad():
            rows = []
            for s in seqs:
                step_ids = torch.tensor(new[s])
                e = ours.embed_input_ids(step_ids.masked_fill(step_ids == AUDIO, 0))
                if s not in embeds_of:
                    e = splice(e, step_ids, AUDIO, audio[s])
                rows.append(e)
                embeds_of[s] = torch.cat([embeds_of[s], e]) if s in embeds_of else e
            logits = ours.compute_logits(ours(ids, meta, caches, inputs_embeds=torch.cat(rows)))
            refs = [ref(inputs_embeds=embeds_of[s][None], use_cache=False).logits[0, -len(new[s]):] for s in seqs]
        check(f"llm step {i} {seqs} {counts}", logits, torch.cat(refs))
        ends = torch.tensor(counts).cumsum(0) - 1
        for s, row in zip(seqs, logits[ends].argmax(-1).tolist()):  # greedy: the next step feeds it back
            last[s] = row
