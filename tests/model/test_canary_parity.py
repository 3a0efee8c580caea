"""Parity of the Canary port against transformers' ``CanaryForConditionalGeneration``: the
encoder on a batch of clips of different lengths, and the decoder's logits at every step of
a paged schedule (batched prefills of prompts of different lengths, decodes, a clip joining
mid-way), each sequence cross-attending to its own clip; float32 on the CPU."""

from __future__ import annotations

import torch
from transformers import CanaryConfig as HFCanaryConfig
from transformers import CanaryForConditionalGeneration as HFCanary
from transformers.models.parakeet.modeling_parakeet import ParakeetEncoderModelOutput

from mstar.layers.paged_kv import allocate_kv_cache
from mstar.model.canary.config import CanaryConfig
from mstar.model.canary.modeling import CanaryForConditionalGeneration, CrossBatch
from mstar.model.weights import load_weights
from tests.support.pages import Pages

TOL = 1e-5
PAGE_SIZE, NUM_PAGES = 4, 64
VOCAB = 60
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               subsampling_conv_channels=8, num_mel_bins=16, conv_kernel_size=5, dropout=0.0, layerdrop=0.0,
               activation_dropout=0.0, attention_dropout=0.0, scale_input=False)
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=12, max_position_embeddings=64)
MEL_FRAMES = {"a": 150, "b": 97, "c": 61, "d": 120}


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape, (name, ours.shape, ref.shape)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    print(f"[parity] {name}: max rel err {err:.2e}")
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol}"


def models() -> tuple[HFCanary, CanaryForConditionalGeneration]:
    torch.manual_seed(0)
    hf_config = HFCanaryConfig(encoder_config=ENCODER, decoder_config=DECODER, vocab_size=VOCAB)
    ref = HFCanary(hf_config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random norms, biases and batch-norm statistics too
        for name, tensor in ref.state_dict().items():
            if tensor.is_floating_point() and "positional_embedding" not in name:
                values = torch.randn(tensor.shape, generator=gen) * 0.2
                if name.endswith("running_var") or ("norm" in name and name.endswith("weight")):
                    values = 1.0 + values.abs()
                tensor.copy_(values)
    ours = CanaryForConditionalGeneration(CanaryConfig.from_hf_dict(hf_config.to_dict())).eval()
    load_weights(ours, ref.state_dict().items())
    return ref, ours


def test_canary_encoder_and_paged_decoder_match_transformers() -> None:
    ref, ours = models()
    gen = torch.Generator().manual_seed(2)
    names = list(MEL_FRAMES)
    mel = torch.zeros(len(names), max(MEL_FRAMES.values()), 16)
    mask = torch.zeros(len(names), mel.shape[1], dtype=torch.long)
    for i, n in enumerate(MEL_FRAMES.values()):
        mel[i, :n] = torch.randn(n, 16, generator=gen)
        mask[i, :n] = 1
    with torch.no_grad():
        ref_enc = ref.model.encoder(mel, attention_mask=mask)
        frames, lengths = ours.encode(mel, mask.sum(-1))
    clips, ref_clips = {}, {}
    for i, (name, n) in enumerate(zip(names, lengths.tolist())):
        check(f"encoder clip {name}", frames[i, :n], ref_enc.last_hidden_state[i, :n])
        clips[name] = ours.cross_kv(frames[i, :n])
        ref_clips[name] = ref_enc.last_hidden_state[i:i + 1, :n]

    prompts = {"a": [7, 4, 16, 22, 9], "b": [7, 4, 16], "c": [7, 11, 12, 13, 14, 15, 16], "d": [7, 5]}
    steps = [["a", "b", "c"]] + [["a", "b", "c"]] * 3 + [["c", "d", "a", "b"]] + [["b", "a", "d", "c"]] * 4
    caches = allocate_kv_cache(*ours.kv_layout()[:1], NUM_PAGES, PAGE_SIZE, *ours.kv_layout()[1:], torch.float32,
                               "cpu")
    pages = Pages(NUM_PAGES, PAGE_SIZE, seed=3)
    tokens: dict[str, list[int]] = {}
    for i, seqs in enumerate(steps):
        new = {s: [int(torch.randint(20, VOCAB, (1,), generator=gen))] if s in tokens else prompts[s] for s in seqs}
        for s in seqs:
            tokens.setdefault(s, []).extend(new[s])
        counts = [len(new[s]) for s in seqs]
        meta = pages.step(list(zip(seqs, counts)))
        ids = torch.tensor([t for s in seqs for t in new[s]])
        with torch.no_grad():
            logits = ours.compute_logits(ours(ids, meta, caches, CrossBatch.build([clips[s] for s in seqs], counts)))
        refs = []
        for s in seqs:
            with torch.no_grad():
                out = ref(encoder_outputs=ParakeetEncoderModelOutput(last_hidden_state=ref_clips[s]),
                          decoder_input_ids=torch.tensor([tokens[s]]), use_cache=False)
            refs.append(out.logits[0, -len(new[s]):])
        check(f"decoder step {i} {seqs} {counts}", logits, torch.cat(refs))
