"""Parity of the Qwen3-ASR port against transformers' ``Qwen3ASRForConditionalGeneration`` on a
tiny random config (float32, CPU): the AuT encoder and projector (ragged clips batched in one
forward, each clip alone, and the reference's masked batch), and the LLM's logits at every step
of a greedy decode (two clips prefilled and decoded together on the paged cache) against the
reference's ``generate``, each clip alone."""

from __future__ import annotations

import pytest
import torch

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.audio_prompt import splice
from mstar.model.qwen3_asr.checkpoint import Qwen3ASRCheckpoint
from tests.support.pages import Pages
from tests.support.qwen3_asr import AUDIO_TOKEN, MEL_BINS, reference, write_transformers

TOL = 1e-5
MEL_FRAMES = {"a": 530, "b": 150, "c": 61, "d": 100, "e": 9}  # 3 ragged windows, ..., under a chunk
STEPS = 8


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    ref = reference()
    directory = write_transformers(ref, tmp_path_factory.mktemp("qwen3_asr"))
    ours = Qwen3ASRCheckpoint.locate(str(directory)).load_model(torch.device("cpu"), torch.float32, dummy=False,
                                                                seed=0)
    gen = torch.Generator().manual_seed(1)
    mels = {k: torch.randn(n, MEL_BINS, generator=gen) for k, n in MEL_FRAMES.items()}
    return ours, ref, mels


def reference_features(ref, mels: list[torch.Tensor]) -> torch.Tensor:
    """The reference's projected audio rows of ``mels`` as one masked batch (concatenated)."""
    chunk = 2 * ref.config.audio_config.n_window
    width = -(-max(m.shape[0] for m in mels) // chunk) * chunk
    features = torch.zeros(len(mels), MEL_BINS, width)
    mask = torch.zeros(len(mels), width, dtype=torch.long)
    for i, m in enumerate(mels):
        features[i, :, :m.shape[0]] = m.T
        mask[i, :m.shape[0]] = 1
    with torch.no_grad():
        return ref.model.get_audio_features(features, mask).pooler_output


def test_encoder_batched_solo_and_reference_agree(loaded) -> None:
    ours, ref, mels = loaded
    clips = list(mels.values())
    with torch.no_grad():
        batched = ours.encode(clips)
        solo = [ours.encode([m])[0] for m in clips]
        states = ours.audio_tower(clips)
        in_parts = ours.audio_tower(clips, conv_batch=3)  # the 11 chunks through the convolutions 3 at a time
    for whole, parts in zip(states, in_parts):
        check("conv chunks in parts vs at once", parts, whole, 1e-6)
    assert [b.shape[0] for b in batched] == [ours.config.audio.positions(m.shape[0]) for m in clips]
    want = reference_features(ref, clips).split([b.shape[0] for b in batched])
    for name, b, s, r in zip(mels, batched, solo, want):
        check(f"clip {name} batched vs reference", b, r)
        check(f"clip {name} solo vs reference", s, r)
        check(f"clip {name} batched vs solo", b, s, 1e-6)
    # the long clip spans two attention windows of different lengths
    assert ours.config.audio.positions(MEL_FRAMES["a"]) > ours.config.audio.window_positions


def prompt(n_audio: int) -> list[int]:
    return [5, 6, 7, 3] + [AUDIO_TOKEN] * n_audio + [4, 5, 8, 9]


def test_greedy_decode_logits_match_generate_at_every_step(loaded) -> None:
    ours, ref, mels = loaded
    names = ["a", "c", "e"]
    with torch.no_grad():
        audio = dict(zip(names, ours.encode([mels[n] for n in names])))
    refs = {}
    for n in names:
        ids = torch.tensor([prompt(audio[n].shape[0])])
        chunk = 2 * ref.config.audio_config.n_window
        width = -(-mels[n].shape[0] // chunk) * chunk
        features = torch.zeros(1, MEL_BINS, width)
        features[0, :, :mels[n].shape[0]] = mels[n].T
        mask = torch.zeros(1, width, dtype=torch.long)
        mask[0, :mels[n].shape[0]] = 1
        with torch.no_grad():
            out = ref.generate(input_ids=ids, input_features=features, input_features_mask=mask,
                               attention_mask=torch.ones_like(ids), max_new_tokens=STEPS, min_new_tokens=STEPS,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
        refs[n] = (out.sequences[0, ids.shape[1]:].tolist(), torch.cat(out.logits))
    page_size, num_pages = 4, 64
    caches = allocate_kv_cache(2, num_pages, page_size, 2, 8, torch.float32, torch.device("cpu"))
    pages = Pages(num_pages, page_size, seed=3)
    tokens: dict[str, list[int]] = {n: [] for n in names}
    logits: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for step in range(STEPS):
        new = {n: prompt(audio[n].shape[0]) if step == 0 else [tokens[n][-1]] for n in names}
        meta = pages.step([(n, len(new[n])) for n in names])
        ids = torch.tensor([t for n in names for t in new[n]])
        with torch.no_grad():
            rows = []
            for n in names:
                step_ids = torch.tensor(new[n])
                e = ours.embed_input_ids(step_ids.masked_fill(step_ids == AUDIO_TOKEN, 0))
                rows.append(splice(e, step_ids, AUDIO_TOKEN, audio[n]) if step == 0 else e)
            hidden = ours(ids, meta, caches, inputs_embeds=torch.cat(rows))
            last = meta.query_start_loc[1:] - 1
            out = ours.compute_logits(hidden[last])
        for row, n in enumerate(names):
            logits[n].append(out[row])
            tokens[n].append(int(out[row].argmax()))
    for n in names:
        check(f"clip {n}: logits of {STEPS} greedy steps", torch.stack(logits[n]), refs[n][1])
        assert tokens[n] == refs[n][0]
