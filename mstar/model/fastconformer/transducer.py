"""A FastConformer encoder with a transducer head, and its greedy decoding.

The head is an LSTM prediction network over the tokens emitted so far and a joint network
``head(act(encoder_frame + prediction))``. Greedy decoding walks each clip's encoder frames
with a cursor: at every step the joint scores the frame under the cursor against the
prediction network's last output; a non-blank token is emitted and fed to the LSTM (its
state and output advance), a blank leaves them as they are.

* **RNN-T** (Nemotron ASR): a blank moves the cursor one frame; so does the
  ``max_symbols_per_step``-th token in a row at one frame (which is still emitted).
* **TDT** (Parakeet): the joint also scores ``durations``; the cursor moves by the chosen one
  (a blank by at least one frame).

A clip's decoder state (LSTM state, last prediction, cursor, tokens in a row, steps left) is
a ``GreedyRows`` row; ``greedy_steps`` runs a bounded number of steps over many clips at once,
each row independent of the others, so a clip decodes the same in any batch. It is the
reference loop; ``device_steps`` runs the same steps with no read of the device inside (the
GPU's loop, checked against it). Parameter names
are the Hugging Face checkpoints' (``ParakeetForTDT``, ``Nemotron3_5AsrForRNNT``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mstar.model.fastconformer.config import TransducerConfig
from mstar.model.fastconformer.encoder import FastConformerEncoder, activation


class PredictionNetwork(nn.Module):
    def __init__(self, config: TransducerConfig) -> None:
        super().__init__()
        width = config.decoder_hidden_size
        self.embedding = nn.Embedding(config.vocab_size, width)
        self.lstm = nn.LSTM(width, width, num_layers=config.num_decoder_layers, batch_first=True)
        self.decoder_projector = nn.Linear(width, width)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor,
             cell: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token per row ``[n]`` from LSTM states ``[layers, n, width]``: the projected
        output ``[n, width]`` and the new states.

        The cell's arithmetic is written out (``nn.LSTM``'s, gates in its order: input, forget,
        cell, output) rather than calling the module: for one time step cuDNN's RNN costs
        about 0.9 ms of host time a call on an H200 host (it re-packs its weights each call),
        where two matmuls and a few element-wise kernels launch in a fraction of that and can
        be captured in a CUDA graph. The parameters stay ``nn.LSTM``'s (the checkpoint's
        names). As cuDNN does, the gates and the new states are computed in fp32 whatever the
        model's dtype, and stored in it."""
        x = self.embedding(tokens)
        hiddens, cells = [], []
        for layer in range(self.lstm.num_layers):
            gates = (F.linear(x, getattr(self.lstm, f"weight_ih_l{layer}"), getattr(self.lstm, f"bias_ih_l{layer}"))
                     .float() + F.linear(hidden[layer], getattr(self.lstm, f"weight_hh_l{layer}"),
                                         getattr(self.lstm, f"bias_hh_l{layer}")).float())
            i, f, g, o = gates.chunk(4, dim=-1)
            c = torch.sigmoid(f) * cell[layer].float() + torch.sigmoid(i) * torch.tanh(g)
            x = (torch.sigmoid(o) * torch.tanh(c)).to(hidden.dtype)
            hiddens.append(x)
            cells.append(c.to(cell.dtype))
        return self.decoder_projector(x), torch.stack(hiddens), torch.stack(cells)


class JointNetwork(nn.Module):
    def __init__(self, config: TransducerConfig) -> None:
        super().__init__()
        self.head = nn.Linear(config.decoder_hidden_size, config.vocab_size + len(config.durations))
        self.act = activation(config.hidden_act)

    def forward(self, frames: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(frames + predictions))


class PromptProjector(nn.Module):
    """Fuses a one-hot language prompt into each encoder frame (Nemotron ASR)."""

    def __init__(self, config: TransducerConfig) -> None:
        super().__init__()
        width = config.encoder.hidden_size
        self.linear_1 = nn.Linear(width + config.num_prompts, config.prompt_intermediate_size)
        self.linear_2 = nn.Linear(config.prompt_intermediate_size, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.relu(self.linear_1(x)))


class TransducerModel(nn.Module):
    def __init__(self, config: TransducerConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = FastConformerEncoder(config.encoder)
        self.encoder_projector = nn.Linear(config.encoder.hidden_size, config.decoder_hidden_size)
        self.decoder = PredictionNetwork(config)
        self.joint = JointNetwork(config)
        if config.num_prompts:
            self.prompt_projector = PromptProjector(config)
        # the durations (frames) of the joint's duration outputs, on the model's device for the
        # device loop (TDT; RNN-T keeps a placeholder)
        self.register_buffer("durations", torch.tensor(config.durations or (0,), dtype=torch.int64),
                             persistent=False)

    def encode(self, mel: torch.Tensor, lengths: torch.Tensor | None = None, prompt_ids: torch.Tensor | None = None,
               lookahead: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The joint's view of each frame ``[B, T', decoder_hidden]`` and the frames per row,
        of log-mels ``[B, T, mel]``; ``prompt_ids`` ``[B]``: each clip's language prompt
        (default the checkpoint's)."""
        hidden, lengths = self.encoder(mel, lengths, lookahead=lookahead)
        if self.config.num_prompts:
            if prompt_ids is None:
                prompt_ids = torch.full((hidden.shape[0],), self.config.default_prompt_id, dtype=torch.int64)
            one_hot = F.one_hot(prompt_ids.to(hidden.device, torch.int64), self.config.num_prompts).to(hidden.dtype)
            hidden = self.prompt_projector(torch.cat([hidden, one_hot[:, None].expand(-1, hidden.shape[1], -1)], -1))
        return self.encoder_projector(hidden), lengths

    def start(self, rows: int, device: torch.device,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prediction network's first output and states for ``rows`` fresh clips: the
        start token from zero states."""
        width, layers = self.config.decoder_hidden_size, self.config.num_decoder_layers
        zeros = torch.zeros(layers, rows, width, device=device, dtype=dtype)
        tokens = torch.full((rows,), self.config.decoder_start_token_id, dtype=torch.int64, device=device)
        return self.decoder.step(tokens, zeros, zeros.clone())


@dataclass
class GreedyRows:
    """The decoder state of ``n`` clips: ``frames`` ``[n, T, width]`` (padded) with ``lengths``
    ``[n]``; the LSTM's ``hidden``/``cell`` ``[layers, n, width]`` and last ``output``
    ``[n, width]``; ``cursor`` (frame under the joint), ``symbols`` (tokens in a row at that
    frame) and ``budget`` (greedy steps left), all ``[n]``."""

    frames: torch.Tensor
    lengths: torch.Tensor
    hidden: torch.Tensor
    cell: torch.Tensor
    output: torch.Tensor
    cursor: torch.Tensor
    symbols: torch.Tensor
    budget: torch.Tensor
    offsets: torch.Tensor | None = None

    def done(self) -> torch.Tensor:
        """``[n]``: rows past their last frame or out of steps."""
        return (self.cursor >= self.lengths) | (self.budget <= 0)

    def frames_under_cursor(self) -> torch.Tensor:
        """``[n, width]``: each row's frame under its cursor (a finished row's last, or any
        frame: what the joint says of it is not used). ``frames`` is padded ``[n, T, width]``,
        or with ``offsets`` ``[n]`` every row's frames one after the other ``[F, width]``."""
        if self.offsets is None:
            row = torch.arange(self.cursor.shape[0], device=self.cursor.device)
            return self.frames[row, self.cursor.clamp(max=self.frames.shape[1] - 1)]
        return self.frames[self.offsets + torch.minimum(self.cursor, self.lengths - 1).clamp(min=0)]


@torch.no_grad()
def greedy_steps(model: TransducerModel, rows: GreedyRows, max_steps: int) -> list[list[int]]:
    """Up to ``max_steps`` greedy steps of every unfinished row (``rows`` advance in place);
    the tokens each row emitted, blanks left out."""
    config = model.config
    vocab, blank = config.vocab_size, config.blank_token_id
    emitted_rows, emitted_tokens = [], []
    for _ in range(max_steps):
        live = (~rows.done()).nonzero()[:, 0]
        if live.numel() == 0:
            break
        cursor = rows.cursor[live]
        logits = model.joint(rows.frames[live, cursor.clamp(max=rows.frames.shape[1] - 1)], rows.output[live])
        token = logits[:, :vocab].argmax(-1)
        is_blank = token == blank
        if config.is_tdt:
            advance = model.durations[logits[:, vocab:].argmax(-1)]
            advance = torch.where(is_blank & (advance == 0), torch.ones_like(advance), advance)
        else:
            symbols = torch.where(is_blank, torch.zeros_like(cursor), rows.symbols[live] + 1)
            moves = is_blank | (symbols >= config.max_symbols_per_step)
            rows.symbols[live] = torch.where(moves, torch.zeros_like(symbols), symbols)
            advance = moves.to(torch.int64)
        rows.cursor[live] = cursor + advance
        rows.budget[live] -= 1
        speak = live[~is_blank]
        if speak.numel():
            said = token[~is_blank]
            output, hidden, cell = model.decoder.step(said, rows.hidden[:, speak], rows.cell[:, speak])
            rows.output[speak], rows.hidden[:, speak], rows.cell[:, speak] = output, hidden, cell
            emitted_rows.append(speak)
            emitted_tokens.append(said)
    tokens: list[list[int]] = [[] for _ in range(rows.cursor.shape[0])]
    if emitted_rows:
        for row, token in zip(torch.cat(emitted_rows).tolist(), torch.cat(emitted_tokens).tolist()):
            tokens[row].append(token)
    return tokens


@torch.no_grad()
def device_steps(model: TransducerModel, rows: GreedyRows, max_steps: int) -> torch.Tensor:
    """``greedy_steps`` with no read of the device inside: exactly ``max_steps`` steps over
    every row at fixed shapes, a finished row's step changing nothing (masks instead of the
    live rows' indices, the prediction network run on every row and kept where a token was
    said). Returns the tokens ``[n, max_steps]`` (-1 where a row said nothing) still on the
    device; ``emitted`` reads them once. The rows advance as ``greedy_steps`` advances them
    (their fields are replaced, never written in place: a CUDA graph of the loop keeps its
    inputs). The frames may be padded or one after the other (``GreedyRows.offsets``).

    On a GPU the eager loop reads the device two or three times a step (the live rows, the
    rows that spoke); this one queues ``max_steps`` steps of kernels back to back."""
    config = model.config
    vocab, blank = config.vocab_size, config.blank_token_id
    tokens = torch.full((rows.cursor.shape[0], max_steps), -1, dtype=torch.int64, device=rows.cursor.device)
    for step in range(max_steps):
        live = (rows.cursor < rows.lengths) & (rows.budget > 0)
        logits = model.joint(rows.frames_under_cursor(), rows.output)
        token = logits[:, :vocab].argmax(-1)
        is_blank = token == blank
        if config.is_tdt:
            advance = model.durations[logits[:, vocab:].argmax(-1)]
            advance = torch.where(is_blank & (advance == 0), 1, advance)
        else:
            symbols = torch.where(is_blank, 0, rows.symbols + 1)
            moves = is_blank | (symbols >= config.max_symbols_per_step)
            rows.symbols = torch.where(live, torch.where(moves, 0, symbols), rows.symbols)
            advance = moves.to(torch.int64)
        rows.cursor = rows.cursor + advance * live
        rows.budget = rows.budget - live.to(torch.int64)
        speak = live & ~is_blank
        output, hidden, cell = model.decoder.step(token, rows.hidden, rows.cell)
        rows.output = torch.where(speak[:, None], output, rows.output)
        rows.hidden = torch.where(speak[None, :, None], hidden, rows.hidden)
        rows.cell = torch.where(speak[None, :, None], cell, rows.cell)
        tokens[:, step] = torch.where(speak, token, -1)
    return tokens


def emitted(tokens: torch.Tensor) -> list[list[int]]:
    """Each row's tokens of ``device_steps``'s table (one read of the device)."""
    return [[t for t in row if t >= 0] for row in tokens.tolist()]


def fresh_rows(model: TransducerModel, frames: list[torch.Tensor]) -> GreedyRows:
    """The decoder state of clips about to decode, from their joint-side encoder frames
    ``[T_i, width]`` each; a clip may take ``max_symbols_per_step`` steps per frame."""
    device, dtype = frames[0].device, frames[0].dtype
    lengths = torch.tensor([f.shape[0] for f in frames], dtype=torch.int64, device=device)
    output, hidden, cell = model.start(len(frames), device, dtype)
    zeros = torch.zeros(len(frames), dtype=torch.int64, device=device)
    return GreedyRows(nn.utils.rnn.pad_sequence(frames, batch_first=True), lengths, hidden, cell, output,
                      zeros, zeros.clone(), lengths * model.config.max_symbols_per_step)


def greedy_decode(model: TransducerModel, frames: list[torch.Tensor], max_steps: int = 64) -> list[list[int]]:
    """Whole transcripts (token ids, blanks left out) of clips given as joint-side encoder
    frames, decoding ``max_steps`` at a time until every clip is done."""
    rows = fresh_rows(model, frames)
    tokens: list[list[int]] = [[] for _ in frames]
    while not bool(rows.done().all()):
        for row, new in enumerate(greedy_steps(model, rows, max_steps)):
            tokens[row] += new
    return tokens
