"""The duplex model's engines: the streamed speech encoder and the frame-synchronous nano LLM.

``EncoderEngine`` (node ``conformer_encoder``, a stream consumer of the client's audio; the
calls of a plan share one pass of the conformer blocks):
each call holds one slot of the ``encoder_state`` pool from its first chunk until it is
released, however it ends; the slot holds its front end (``MelStream``) and its encoder
state (in the pooled ``EncoderStreams``). A chunk is one append: its samples run through the
front end, the new mel frames through the encoder, and the encoder frames no later audio can
change leave, projected to LLM embeddings. The stream's last chunk (the client's end of input) flushes the
frames that read the clip's end. A chunk that finalises no frame writes nothing (no item for
the LLM's stream).

``NanoEngine`` (node ``nano_llm``): the Nemotron-H autoregressive engine (paged KV for the
attention layers, a ``mamba_state`` slot per call) behind two ops, laid out as NeMo's
``DuplexSTTStreamingInference`` lays out a call's sequence: the system prompt's positions,
then one per audio frame. Every position's input is its user channel (a prompt token's
embedding, or the frame, both scaled by ``user_channel_weight``: the encoder applies it to
the frames) plus the text channel, the embedding of the agent's previous text token scaled
by ``text_channel_weight`` (the pad at every prompt position and at the first frame; no
token is sampled at a prompt position). ``prime`` prefills the prompt's positions (none
when the call has no prompt: then the first frame is the prefill); ``frame`` runs, for each
new frame, one step and samples the next agent text token: one per 80 ms frame. The speech
channel is the talker's. The end-of-sequence token is an ordinary token here: the loop ends
when the audio does, not on it. The frames of every call in a plan run as one batched step
per frame position.

With the release's tool-call head (``use_function_head``) every position also adds the
embedding of the previous tool-call token times ``function_weight`` (the pad at the prompt's
positions and the first frame, then the head's greedy pick of the step before), and a frame's
output holds ``tool_token`` beside ``token`` (one per frame). The text token is chosen by
``DuplexRules``: NeMo's inference boosts of the pad, BOS and EOS logits, then the call's
repetition and presence penalties over the agent tokens it said so far (specials excepted),
then the engine's sampler (temperature 0: the argmax). The previous text and tool tokens are
kept per call (``last``, ``tool``) and dropped on release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mstar.engine.autoregressive import AutoregressiveEngine
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.cuda_graphs import BucketGraphs, buckets_up_to
from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sampler import penalise_repeats
from mstar.engine.sequence import Sequence
from mstar.engine.state_pool import StatePool
from mstar.layers.paged_kv import to_device
from mstar.model.fastconformer.features import MelSettings
from mstar.model.fastconformer.stream import EncoderStreams
from mstar.model.nemotron_duplex.features import MIN_SAMPLES, MelStream, _Bank, push_many
from mstar.model.nemotron_duplex.modeling import SpeechEncoder


class EncoderEngine(Engine):
    """``cuda_graphs``: a step where every call has one new frame (a steady tick) runs the
    conformer blocks and the projection from a CUDA graph per batch bucket (up to the pool's
    calls), captured by ``capture_all``; other steps (a call's first frames, its end, a long
    append) run eagerly over the same code."""

    def __init__(self, model: SpeechEncoder, settings: MelSettings, *, max_slots: int,
                 cuda_graphs: bool = False) -> None:
        self.model = model
        self.settings = settings
        self.bank = _Bank(settings)
        self.pool = StatePool(max_slots)
        self.streams = EncoderStreams(model.encoder, max_slots)
        self.fronts: dict[str, MelStream] = {}
        self.graphs: BucketGraphs | None = None
        if cuda_graphs:
            streams = self.streams
            calls = self.pool.capacity
            buffers = {"x": torch.zeros(calls, 1, model.encoder.config.hidden_size, dtype=streams.dtype,
                                        device=streams.device),
                       **{name: torch.zeros(calls, dtype=torch.int64, device=streams.device)
                          for name in ("slots", "filled", "sizes")}}
            pads = {"x": 0, "slots": self.pool.sink, "filled": 0, "sizes": 0}  # padded rows: the sink's state
            self.graphs = BucketGraphs(self._frame, buffers, pads, buckets_up_to(calls))

    def _frame(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """One new frame per call: the blocks and the projection (what a graph records)."""
        return self.model.project(self.streams.blocks(rows["x"], rows["slots"], rows["filled"], rows["sizes"]))

    def capture_all(self) -> None:
        if self.graphs is not None:
            self.graphs.capture_all()

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        """The calls' front ends (one STFT batch per signal length), then the subsampling per
        window shape and the conformer blocks once over all their new frames, then the
        projection."""
        for item in items:  # before any call's state moves: the worker then retries each alone
            if item.chunk is not None and item.chunk.last:
                front = self.fronts.get(item.request_id)
                heard = (front.received if front else 0) + item.inputs["audio"].numel()
                if heard < MIN_SAMPLES:
                    raise ValueError(f"the call ended with {heard} samples, too short to featurize "
                                     f"(at least {MIN_SAMPLES}, about 16 ms)")
        with torch.inference_mode():
            fronts = []
            for item in items:
                front = self.fronts.get(item.request_id)
                if front is None:
                    slot = self.pool.allocate(item.request_id)  # OutOfSlots fails the item: admission prevents it
                    self.streams.open(slot)
                    front = self.fronts[item.request_id] = MelStream(self.settings, self.bank)
                fronts.append(front)
            lasts = [item.chunk is not None and item.chunk.last for item in items]
            mels = push_many(fronts, [item.inputs["audio"].reshape(-1) for item in items], lasts)
            slots = [self.pool.slot(item.request_id) for item in items]
            chunk = self.streams.subsample(slots, mels, lasts)
            outputs = [EngineOutput({}) for _ in items]
            if chunk is None:
                return outputs
            inputs = self.streams.step_inputs(chunk)
            if self.graphs is not None and chunk.x.shape[1] == 1 and self.graphs.fits(len(chunk.live)):
                names = ("slots", "filled", "sizes")
                frames = self.graphs.run(len(chunk.live), {"x": chunk.x, **dict(zip(names, inputs))})
            else:
                frames = self.model.project(self.streams.blocks(chunk.x, *inputs))
            self.streams.advance(chunk)
            for row, i in enumerate(chunk.live):
                outputs[i] = EngineOutput({"frames": frames[row, :chunk.sizes[row]]})
            return outputs

    def release(self, request_id: str) -> None:
        self.fronts.pop(request_id, None)
        slot = self.pool.free(request_id)
        if slot is not None:
            self.streams.close(slot)

    def stats(self) -> dict[str, float]:
        return {"encoder_slots_used": float(self.pool.num_used)}


@dataclass
class _Said:
    """A call's state under ``DuplexRules``: its penalties, the agent tokens it said (for
    them), and the tool-call token its step in flight picked."""

    repetition: float = 1.0
    presence: float = 0.0
    said: set[int] = field(default_factory=set)
    tool: torch.Tensor | None = None


class DuplexRules(TokenRules):
    """The agent text's choice as NeMo's duplex STT model makes it at inference.

    ``logits`` are the text logits ``[B, V]``, followed by the tool-call head's ``[B, V]`` when
    the LLM has one (``DuplexLLM``). To the text logits NeMo's ``inference_*_boost`` are added
    (``boosts``: token id to boost; ``DuplexSTTModel.forward`` adds them when not training),
    then a call's penalties over the agent text tokens it said so far, the pad, BOS and EOS
    (``specials``) excepted: a repetition penalty ``r`` divides a positive logit by ``r`` and
    multiplies a negative one (transformers' ``repetition_penalty``) and a presence penalty
    ``p`` is subtracted (``params['text_penalties']``: ``repetition`` default 1, ``presence``
    default 0, both off). The engine's sampler then picks the token (greedy at temperature 0).
    The tool-call token is the argmax of the head's logits, and goes out as ``tool_token``."""

    extra_outputs = True

    def __init__(self, vocab: int, *, boosts: dict[int, float], specials: set[int], function_head: bool) -> None:
        self.vocab = vocab
        self.boosts = {token: value for token, value in boosts.items() if value}
        self.specials = specials
        self.function_head = function_head

    def start(self, params: dict[str, Any]) -> _Said:
        penalties = params.get("text_penalties") or {}
        return _Said(float(penalties.get("repetition", 1.0)), float(penalties.get("presence", 0.0)))

    def adjust(self, text: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The text logits ``[B, V]`` the sampler sees: boosted, then penalised."""
        text = text.clone()
        for token, value in self.boosts.items():
            text[:, token] += value
        said_by: dict[tuple[float, float], tuple[list[int], list[int]]] = {}  # the calls' penalties: their (row, id)s
        for row, seq in enumerate(seqs):
            said: _Said = seq.state
            if not said.said or (said.repetition == 1.0 and not said.presence):
                continue
            rows, ids = said_by.setdefault((said.repetition, said.presence), ([], []))
            ids += sorted(said.said)
            rows += [row] * len(said.said)
        for (repetition, presence), (rows, ids) in said_by.items():  # one upload per pair, not per call
            where = to_device(torch.tensor([rows, ids]), text.device)
            scores = text[where[0], where[1]]
            if repetition != 1.0:
                scores = penalise_repeats(scores, repetition)
            text[where[0], where[1]] = scores - presence
        return text

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        if self.function_head:
            # Copied without a wait: the engine's read of the sampled tokens (after this, on the
            # same stream) waits for it, and ``outputs`` runs after that read.
            tools = logits[:, self.vocab:].argmax(dim=-1).to("cpu", non_blocking=True)
            for row, seq in enumerate(seqs):
                seq.state.tool = tools[row:row + 1]
        return sample(self.adjust(logits[:, :self.vocab], seqs), seqs)

    def may_run_ahead(self, seq: Sequence) -> bool:
        return False  # the penalties read the token in flight

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        said: _Said = seq.state
        if token not in self.specials:
            said.said.add(token)
        return {} if said.tool is None else {"tool_token": said.tool}  # on the host: int64 (argmax)


def duplex_rules(config) -> DuplexRules:
    """The rules of a ``DuplexConfig``: its boosts, specials and function head."""
    boosts: dict[int, float] = {}
    for token, value in ((config.agent_pad_token_id, config.inference_pad_boost),
                         (config.bos_token_id, config.inference_bos_boost),
                         (config.eos_token_id, config.inference_eos_boost)):
        if token is not None and value:
            boosts[token] = boosts.get(token, 0.0) + value
    specials = {t for t in (config.agent_pad_token_id, config.bos_token_id, config.eos_token_id) if t is not None}
    return DuplexRules(config.llm.vocab_size, boosts=boosts, specials=specials,
                       function_head=config.use_function_head)


class NanoEngine(Engine):
    def __init__(self, inner: AutoregressiveEngine, model, *, pad_token_id: int, user_weight: float = 1.0,
                 text_weight: float = 1.0, function_weight: float = 1.0) -> None:
        self.inner = inner
        self.model = model
        self.pad = pad_token_id
        self.user_weight = user_weight
        self.text_weight = text_weight
        self.function_weight = function_weight
        self.tools = getattr(model, "function_head", None) is not None  # the tool-call channel
        self.last: dict[str, int] = {}  # the agent's previous text token, per call
        self.tool: dict[str, int] = {}  # the previous tool-call token, per call (with a function head)

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        primes = [i for i in items if i.op == "prime"]
        frames = [i for i in items if i.op == "frame"]
        done: dict[int, EngineOutput] = {}
        prompted = [i for i in primes if i.inputs["prompt_ids"].numel()]
        if prompted:
            with torch.inference_mode():
                batch = [EngineItem(i.request_id, "prefill", 0, {"prompt_ids": i.inputs["prompt_ids"],
                                                                  "input_embeds": self._prompt(i.inputs["prompt_ids"])},
                                    i.params) for i in prompted]
            self.inner.run(batch)
            for item in prompted:  # the token a prompt's prefill drew is no agent token
                seq = self.inner.seqs[item.request_id]
                if isinstance(seq.state, _Said):
                    seq.state.said.clear()
        for item in primes:
            self.last[item.request_id] = self.pad
            self.tool[item.request_id] = self.pad
            done[id(item)] = EngineOutput({"primed": torch.ones(1)})
        if frames:
            done |= self._frames(frames)
        return [done[id(item)] for item in items]

    def _text(self, tokens: list[int], tools: list[int | None] | None = None) -> torch.Tensor:
        """The text channels ``[len(tokens), hidden]`` of positions whose previous agent token is
        each of ``tokens``, plus the tool-call channel (previous tool tokens ``tools``, default
        the pad) with a function head. The ids go to the device in one copy, without a wait."""
        ids = tokens
        if self.tools:
            ids = tokens + [self.pad if tool is None else tool for tool in (tools or [None] * len(tokens))]
        embeds = self.model.embed_input_ids(to_device(torch.tensor(ids), self._device()))
        embed = embeds[:len(tokens)] * self.text_weight
        if self.tools:
            embed = embed + embeds[len(tokens):] * self.function_weight
        return embed

    def _prompt(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompt's positions: each token on the user channel, the pad on the text channel
        (and on the tool-call channel)."""
        ids = ids.reshape(-1).to(self._device())
        return self.model.embed_input_ids(ids) * self.user_weight + self._text([self.pad])

    def _frames(self, items: list[EngineItem]) -> dict[int, EngineOutput]:
        tokens: dict[int, list[int]] = {id(item): [] for item in items}
        tools: dict[int, list[int]] = {id(item): [] for item in items}
        longest = max(item.inputs["frame"].shape[0] for item in items)
        for j in range(longest):
            step = [item for item in items if item.inputs["frame"].shape[0] > j]
            starts, decodes = [], []
            with torch.inference_mode():
                text = self._text([self.last[item.request_id] for item in step],
                                  [self.tool.get(item.request_id) for item in step])
                frames = torch.cat([item.inputs["frame"][j:j + 1] for item in step])
                frames = to_device(frames, text.device)
                fused_all = frames.to(text.dtype) + text
                for row, item in enumerate(step):
                    fused = fused_all[row:row + 1]
                    seq = self.inner.seqs.get(item.request_id)
                    if seq is None:  # no prompt: the call's first frame is its prefill
                        starts.append(EngineItem(item.request_id, "prefill", j, {
                            "prompt_ids": torch.tensor([self.pad]), "input_embeds": fused}, item.params))
                    else:  # the engine checks a decode's token against its history
                        decodes.append(EngineItem(item.request_id, "decode", j, {
                            "token": torch.tensor([seq.tokens[-1]]), "input_embeds": fused}, item.params))
            results = {}
            for batch in (starts, decodes):
                if batch:
                    results |= {e.request_id: r for e, r in zip(batch, self.inner.run(batch))}
            outs = [results[item.request_id].outputs for item in step]
            drawn = torch.cat([out["token"].reshape(-1)[:1] for out in outs]).tolist()  # host tensors: one read
            for item, token in zip(step, drawn):
                self.last[item.request_id] = token
                tokens[id(item)].append(token)
            told = [(item, out["tool_token"].reshape(-1)[:1]) for item, out in zip(step, outs) if "tool_token" in out]
            if told:
                for (item, _), tool in zip(told, torch.cat([t for _, t in told]).tolist()):
                    self.tool[item.request_id] = tool
                    tools[id(item)].append(tool)
        return {key: EngineOutput({"token": torch.tensor(ids, dtype=torch.int64)}
                                  | ({"tool_token": torch.tensor(tools[key], dtype=torch.int64)} if self.tools else {}))
                for key, ids in tokens.items()}

    def _device(self) -> torch.device:
        return self.model.backbone.embeddings.weight.device

    def release(self, request_id: str) -> None:
        self.last.pop(request_id, None)
        self.tool.pop(request_id, None)
        self.inner.release(request_id)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()
