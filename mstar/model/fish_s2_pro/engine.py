"""Fish S2-Pro's engines: the dual AR on the autoregressive engine, the codec decoder as a
stream with per-request causal state.

**Dual AR** (an ``AutoregressiveEngine`` with ``SlowForward`` and ``FishRules``): every slow
step of every request runs in one forward over the paged KV cache. A row's input is its token
and that token's frame: a prefill reads the prompt's codes (``prompt_codes``, zero beside text
tokens, the reference clip's frames beside its semantic tokens), a decode the frame its
previous step made. ``FishRules.choose`` draws each row's slow token (only the semantic tokens
and ``<|im_end|>`` allowed), then runs the fast AR once over the rows that keep talking, so a
slow step makes one whole frame of ``num_codebooks`` codes per request; the step writes it
(``codes [1, N]``), silent at ``<|im_end|>``.

Sampling is ``generate.py``'s, draw for draw (``sampling.py``): each request has its own
generator seeded from its ``seed``, whose numbers pick its ids by inverse CDF, so a request's
frames do not depend on its batch. The draws run on the device, batched; the host reads the
slow tokens back once a step (the fast AR's codes stay on the device until the frame is done).

The slow AR's K/V depend on the frames fed back, not on the token ids alone: no prefix
caching, no preemption (a request holds its pages from admission), no step launched ahead.

**Codec** (``CodecStreams``): each chunk of new frames is decoded against the request's
``CodecState`` (the causal convs' last inputs, the transposed convs' tails, the window
attention's last keys and values), so only new frames are decoded and the stream of chunks
equals the whole decode. The state is dropped at the stream's last chunk and by ``release``
(the request ended, however it ended).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.forward import Forward
from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sequence import Sequence
from mstar.layers.paged_kv import PagedAttentionMetadata, to_device
from mstar.model.fish_s2_pro.codec import CodecDecoder, CodecState
from mstar.model.fish_s2_pro.dual_ar import DualAR
from mstar.model.fish_s2_pro.prompt import slow_candidates
from mstar.model.fish_s2_pro.sampling import RowSampling, Sampling, choose_slow, fast_sampler

__all__ = ["CodecStreams", "FishRules", "SlowForward", "dual_ar_engine", "sampling_of"]


def sampling_of(params: dict) -> tuple[Sampling, int]:
    """A request's fish sampling and seed from its ``sampling`` params (``temperature`` 0:
    greedy)."""
    sent = params.get("sampling") or {}
    temperature = float(sent.get("temperature", Sampling.temperature))
    sampling = Sampling(temperature=temperature, top_p=float(sent.get("top_p", Sampling.top_p)),
                        top_k=int(sent.get("top_k", Sampling.top_k)), greedy=temperature == 0.0,
                        repetition_aware=bool(params.get("repetition_aware", True)))
    seed = sent.get("seed")
    return sampling, int(seed) if seed is not None else int(torch.randint(0, 2**31, ()).item())


class SlowForward(Forward):
    """The slow AR over a step: each row's token with its frame. ``logits`` keeps the fast
    AR's input rows of the step's last positions (``last_fast``) for ``FishRules``."""

    runs_ahead = False
    kv_from_tokens = False
    preemptible = False

    def __init__(self, model: DualAR) -> None:
        super().__init__(model)  # type: ignore[arg-type]
        self.graph_rows = None
        self.next_codes: dict[str, torch.Tensor] = {}  # request id -> the frame [N] its next decode reads
        self.last_fast: torch.Tensor | None = None

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict:
        rows = [item.inputs["prompt_codes"].reshape(-1, self.model.config.num_codebooks) if item.op == "prefill"
                else self.next_codes[item.request_id][None] for item in items]  # kept: a failed step may rerun
        return {"codes": torch.cat(rows).to(input_ids.device, torch.int64)}

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict, counts: list[int] | None) -> torch.Tensor:
        normed, fast_input = self.model.slow(input_ids, inputs["codes"], meta, kv_caches)
        if self.model.config.norm_fastlayer_input:  # S2: the fast AR reads the normed rows themselves
            return normed
        return torch.cat((normed, fast_input), dim=-1)  # the engine picks the last rows of both

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.model.config.norm_fastlayer_input:
            normed = self.last_fast = hidden
        else:
            normed, self.last_fast = hidden.split(self.model.config.dim, dim=-1)
        return self.model.slow.logits(normed)

    def release(self, request_id: str) -> None:
        self.next_codes.pop(request_id, None)


@dataclass
class FishState:
    row: RowSampling  # the request's sampling, generator and recent slow tokens
    ignore_eos: bool = False  # <|im_end|> is never drawn
    codes: torch.Tensor | None = field(default=None, repr=False)  # [1, N]: the last step's frame


class FishRules(TokenRules):
    """The slow token drawn among the semantic tokens and ``<|im_end|>`` (never ``<|im_end|>``
    for a request with ``ignore_eos``), the frame's other codes from the fast AR in the same
    step, sampled on the device; a step writes its frame's ``codes``."""

    extra_outputs = True

    def __init__(self, forward: SlowForward) -> None:
        self.forward = forward
        self.model: DualAR = forward.model  # type: ignore[assignment]
        c = self.model.config
        self.eos = c.eos_token_id
        self.semantic = range(c.semantic_begin_id, c.semantic_begin_id + c.codebook_size)

    def start(self, params: dict) -> FishState:
        sampling, seed = sampling_of(params)
        generator = None if sampling.greedy else torch.Generator().manual_seed(seed)
        return FishState(RowSampling(sampling, generator), bool(params.get("ignore_eos", False)))

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        c = self.model.config
        candidates, ids = slow_candidates(logits, c.semantic_begin_id, c.codebook_size, c.eos_token_id)
        states: list[FishState] = [seq.state for seq in seqs]
        endless = [row for row, s in enumerate(states) if s.ignore_eos]
        if endless:
            candidates[to_device(torch.tensor(endless), logits.device), ids.index(self.eos)] = float("-inf")
        chosen = choose_slow(candidates, ids, [s.row for s in states], self.semantic)  # the step's one read-back
        talking = [row for row, token in enumerate(chosen) if token != self.eos]
        if talking:
            device = logits.device
            rows = to_device(torch.tensor(talking), device)
            code0 = self.model.code0(to_device(torch.tensor([chosen[r] for r in talking]), device))
            sampler = fast_sampler([states[r].row for r in talking], c.num_codebooks, device)
            frame = self.model.fast(self.forward.last_fast.index_select(0, rows), code0, sampler=sampler).codes
            host_frame = frame.cpu()  # one copy for the step's rows
            for j, row in enumerate(talking):
                states[row].codes = host_frame[j:j + 1].clone()
                self.forward.next_codes[seqs[row].request_id] = frame[j]
        return to_device(torch.tensor(chosen), logits.device)

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        return {} if token == self.eos else {"codes": seq.state.codes}


def dual_ar_engine(model: DualAR, *, num_pages: int, page_size: int, max_seq_len: int, device: torch.device,
                   dtype: torch.dtype, attention_backend: str = "torch") -> AutoregressiveEngine:
    forward = SlowForward(model)
    return AutoregressiveEngine(model, KVLayout(*model.cache_shape()), num_pages=num_pages,  # type: ignore[arg-type]
                                page_size=page_size, max_seq_len=max_seq_len, device=device, dtype=dtype,
                                forward=forward, rules=FishRules(forward), attention_backend=attention_backend)


class CodecStreams(Engine):
    """The codec node: each chunk (``codes [n, N]``, new frames only) decoded against its
    request's causal state."""

    def __init__(self, codec: CodecDecoder) -> None:
        self.codec = codec
        self.weight = next(codec.parameters())
        self.states: dict[str, CodecState] = {}

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        outputs = []
        for item in items:
            state = self.states.setdefault(item.request_id, CodecState())
            codes = item.inputs["codes"].reshape(-1, self.codec.config.n_codebooks + 1).T[None]
            with torch.inference_mode():
                audio = self.codec.step(codes.to(self.weight.device, torch.int64), state)[0].float().cpu()
            if item.chunk is not None and item.chunk.last:
                self.states.pop(item.request_id, None)
            outputs.append(EngineOutput({"audio": audio}))
        return outputs

    def release(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        return {"codec_streams": float(len(self.states))}
