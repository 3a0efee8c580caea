"""Greedy transducer decoding against transformers' own ``generate``: TDT (``ParakeetForTDT``)
and RNN-T with a language prompt and a lookahead (``Nemotron3_5AsrForRNNT``), on a batch of
clips of different lengths; transcripts token-identical, in any batch and however many steps
a decode iteration runs."""

from __future__ import annotations

import pytest
import torch
from transformers import Nemotron3_5AsrConfig, Nemotron3_5AsrForRNNT, ParakeetForTDT, ParakeetTDTConfig

from mstar.model.fastconformer.config import TransducerConfig
from mstar.model.fastconformer.transducer import TransducerModel, fresh_rows, greedy_decode, greedy_steps
from mstar.model.weights import load_weights

ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
               subsampling_conv_channels=8, num_mel_bins=16, conv_kernel_size=5, dropout=0.0, layerdrop=0.0,
               activation_dropout=0.0, attention_dropout=0.0)
VOCAB, BLANK, PAD = 30, 29, 2
MEL_FRAMES = (190, 120, 57, 160)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                scale = 0.5 if "decoder" in name or "joint" in name or "projector" in name else 0.2
                if name.startswith("encoder.") and tensor.dim() == 1:
                    scale = 0.02  # small biases: the frames differ, as speech does
                values = torch.randn(tensor.shape, generator=gen) * scale
                if name.endswith("running_var") or ("norm" in name and name.endswith("weight")):
                    values = 1.0 + values.abs()
                tensor.copy_(values)


def _bias_joint(head: torch.nn.Linear, blank: float, durations: list[float] | None = None) -> None:
    """Make the random joint decode like a transcriber: blanks often, never the pad token
    (transformers writes it after a clip ends), and (TDT) mostly forward moves."""
    with torch.no_grad():
        head.bias[BLANK] += blank
        head.bias[PAD] = -1e4
        if durations is not None:
            head.bias[VOCAB:] += torch.tensor(durations)


def tdt_pair() -> tuple[ParakeetForTDT, TransducerModel]:
    torch.manual_seed(0)
    hf = ParakeetTDTConfig(encoder_config=ENCODER, vocab_size=VOCAB, blank_token_id=BLANK, pad_token_id=PAD,
                           decoder_hidden_size=24, num_decoder_layers=2, durations=[0, 1, 2, 3, 4])
    ref = ParakeetForTDT(hf).eval()
    _randomise(ref, seed=5)
    _bias_joint(ref.joint.head, blank=6.0, durations=[0.0, 2.0, 1.5, 0.5, 0.0])
    ours = TransducerModel(TransducerConfig.from_hf_dict(hf.to_dict())).eval()
    load_weights(ours, ref.state_dict().items())
    return ref, ours


def rnnt_pair(max_symbols: int = 3) -> tuple[Nemotron3_5AsrForRNNT, TransducerModel]:
    torch.manual_seed(0)
    hf = Nemotron3_5AsrConfig(encoder_config=dict(ENCODER, sliding_window=71, default_num_lookahead_tokens=13),
                              vocab_size=VOCAB, blank_token_id=BLANK, pad_token_id=PAD, decoder_hidden_size=24,
                              num_decoder_layers=2, max_symbols_per_step=max_symbols, num_prompts=8,
                              prompt_intermediate_size=40, default_prompt_id=7)
    ref = Nemotron3_5AsrForRNNT(hf).eval()
    _randomise(ref, seed=6)
    with torch.no_grad():
        ref.joint.head.weight.mul_(0.1)  # the prompt fusion makes wide frames: keep the logits near speech's
    _bias_joint(ref.joint.head, blank=4.5)
    ours = TransducerModel(TransducerConfig.from_hf_dict(hf.to_dict())).eval()
    load_weights(ours, ref.state_dict().items())
    return ref, ours


def mels(frames=MEL_FRAMES, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mel = torch.zeros(len(frames), max(frames), 16)
    mask = torch.zeros(len(frames), max(frames), dtype=torch.long)
    for i, n in enumerate(frames):
        mel[i, :n] = torch.randn(n, 16, generator=gen)
        mask[i, :n] = 1
    return mel, mask


def reference_tokens(out, lengths: torch.Tensor) -> list[list[int]]:
    """transformers' sequences (start token, then one per step) as transcripts: the tokens
    it emitted while its cursor (the running sum of ``durations``) was on the clip. In a
    batch, transformers goes on decoding a finished clip on its last frame until every clip
    is done (its only stopping criterion for a row is the whole batch's): those tokens are
    not the clip's."""
    transcripts = []
    for row, moves, length in zip(out.sequences.tolist(), out.durations.tolist(), lengths.tolist()):
        frame, tokens = 0, []
        for token, move in zip(row[1:], moves[1:]):
            if frame >= length:
                break
            if token != BLANK:
                tokens.append(token)
            frame += move
        transcripts.append(tokens)
    return transcripts


def ours_tokens(model: TransducerModel, mel: torch.Tensor, mask: torch.Tensor, max_steps: int, **encode) -> list:
    with torch.no_grad():
        frames, lengths = model.encode(mel, mask.sum(-1), **encode)
    return greedy_decode(model, [f[:n] for f, n in zip(frames, lengths.tolist())], max_steps=max_steps)


@pytest.mark.parametrize("max_steps", [64, 5])
def test_tdt_greedy_matches_generate(max_steps: int) -> None:
    ref, ours = tdt_pair()
    mel, mask = mels()
    with torch.no_grad():
        want = reference_tokens(ref.generate(input_features=mel, attention_mask=mask, decoder_start_token_id=BLANK),
                                ref._get_subsampling_output_length(mask.sum(-1)))
    assert all(want) and len({tuple(t) for t in want}) == len(want), "a degenerate random decode"
    got = ours_tokens(ours, mel, mask, max_steps)
    assert got == want


@pytest.mark.parametrize("lookahead,prompt", [(13, 3), (1, None)])
def test_rnnt_greedy_matches_generate(lookahead: int, prompt: int | None) -> None:
    ref, ours = rnnt_pair()
    mel, mask = mels()
    prompts = None if prompt is None else torch.full((mel.shape[0],), prompt)
    with torch.no_grad():
        out = ref.generate(input_features=mel, attention_mask=mask, decoder_start_token_id=BLANK,
                           num_lookahead_tokens=lookahead, prompt_ids=prompts)
    want = reference_tokens(out, ref._get_subsampling_output_length(mask.sum(-1)))
    assert sum(map(bool, want)) >= 3 and len({tuple(t) for t in want}) >= 3, "a degenerate random decode"
    got = ours_tokens(ours, mel, mask, max_steps=7, lookahead=lookahead, prompt_ids=prompts)
    assert got == want


def test_rows_decode_the_same_in_any_batch() -> None:
    """A clip's decode does not depend on the clips beside it, nor on when they start."""
    _, ours = tdt_pair()
    mel, mask = mels()
    with torch.no_grad():
        frames, lengths = ours.encode(mel, mask.sum(-1))
    clips = [f[:n] for f, n in zip(frames, lengths.tolist())]
    together = greedy_decode(ours, clips, max_steps=8)
    alone = [greedy_decode(ours, [clip], max_steps=64)[0] for clip in clips]
    assert together == alone
    # rows joined mid-way: clip 0 runs two iterations before the others start
    rows = fresh_rows(ours, clips[:1])
    early = greedy_steps(ours, rows, 3)[0] + greedy_steps(ours, rows, 3)[0]
    rest = fresh_rows(ours, clips[1:])
    assert early == together[0][:len(early)]
    assert rest.hidden.shape[1] == 3 and rows.done().tolist() == [False]


def test_budget_bounds_a_clip_that_never_moves() -> None:
    """A TDT joint that always says a token of duration 0 stops at its step budget."""
    _, ours = tdt_pair()
    with torch.no_grad():
        ours.joint.head.bias.zero_()
        ours.joint.head.weight.zero_()
        ours.joint.head.bias[5] = 10.0  # token 5
        ours.joint.head.bias[VOCAB] = 10.0  # duration 0
    clip = torch.randn(4, 24)
    tokens = greedy_decode(ours, [clip], max_steps=64)[0]
    assert tokens == [5] * (4 * ours.config.max_symbols_per_step)
