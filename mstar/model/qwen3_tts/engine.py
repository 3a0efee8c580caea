"""Qwen3-TTS's engines: the talker on the autoregressive engine, the codec as a stateless node
over the stream's windows.

**Talker** (``TalkerEngine`` around an ``AutoregressiveEngine`` with ``TalkerStepForward``
(``talker_step``: Qwen3-Omni's ``TalkerForward`` with its decode inputs in a device table),
which runs a prefill's prompt rows and a decode's next input, and ``TalkerRules``): the
prefill builds the request's prompt (``prompt.talker_prompt``) on the worker, where the
embeddings are; each step draws codebook 0 (the codec's special ids masked, EOS too before
``MIN_FRAMES``), the code predictor fills the frame inside the same step, and the frame's
embedding sum plus the next text row is the next input. A step writes its frame
(``codes [1, Q]``) for the codec, silent at EOS.

The code predictor draws every row's codes at once on the device (``sampling.draw``: top 50
at temperature 0.9 by the exponential race on counter-based noise keyed by the request's
seed, the frame and the codebook), so a request's frames do not depend on what it is batched
with and the step reads nothing back; a request with ``temperature`` 0 takes the greedy codes.

**Codec** (``codec_fn``): each window's frames after its left context, the conv stack over the
new frames only (``Qwen3TTSCodec.decode_window``); windows of one shape decoded as a batch. An
in-context clone's clip frames top up its first windows' context. The opt-in AudioSeal
watermark marks each request's audio with its own stream (``CodecEngine``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, EngineOutput, StatelessEngine
from mstar.engine.cuda_graphs import DEFAULT_BATCH_SIZES, ShapeGraphs
from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sequence import Sequence
from mstar.layers.paged_kv import to_device
from mstar.model.audio_watermark import AudioSealGenerator, AudioWatermarkKnobs, WatermarkStream
from mstar.model.llama.modeling import use_fused_kernels
from mstar.model.qwen3_tts.codec import Qwen3TTSCodec, with_prefix
from mstar.model.qwen3_tts.config import Qwen3TTSConfig
from mstar.model.qwen3_tts.prompt import talker_prompt
from mstar.model.qwen3_tts.sampling import request_key
from mstar.model.qwen3_tts.speech import suppressed_codes
from mstar.model.qwen3_tts.talker import Qwen3TTSTalker
from mstar.model.qwen3_tts.talker_step import FramePredictor, TalkerStepForward

MIN_FRAMES = 2  # the reference's ``min_new_tokens``


@dataclass
class TalkerState:
    greedy: bool = False
    key: int = 0  # the code predictor's noise stream (``sampling.request_key`` of the seed)
    # [1, Q] host rows of the frames chosen and not yet written, oldest first (a step launched
    # ahead adds the next one before this step's is written)
    pending: list[torch.Tensor] = field(default_factory=list)


def codes_to_host(codes: torch.Tensor) -> torch.Tensor:
    """A host copy of a step's ``codes [B, Q]``, started without waiting for the device (the
    engine's read of the step's ids, queued after it, waits for both)."""
    if codes.device.type != "cuda":
        return codes
    host = torch.empty(codes.shape, dtype=codes.dtype, pin_memory=True)
    return host.copy_(codes, non_blocking=True)


class TalkerRules(TokenRules):
    """Codebook 0 with the engine's sampler (suppressed ids and early EOS masked), then the
    frame's other codes from the code predictor, every row at once on the device
    (``FramePredictor``). EOS rows run the predictor too (their frame is dropped): which rows
    spoke is not read back before the step ends. A row's frame index is its sequence's
    generated count plus ``lead``, so a step launched ahead needs nothing from the host."""

    extra_outputs = True

    def __init__(self, forward: TalkerStepForward, frames: FramePredictor) -> None:
        self.forward = forward
        self.frames = frames
        talker: Qwen3TTSTalker = forward.model
        self.eos = talker.config.codec_eos_token_id
        self.suppressed = torch.tensor(suppressed_codes(talker), dtype=torch.int64)

    def start(self, params: dict) -> TalkerState:
        sampling = params.get("sampling") or {}
        seed = sampling.get("seed")
        seed = int(seed) if seed is not None else int(torch.randint(0, 2**31, ()).item())
        return TalkerState(greedy=float(sampling.get("temperature", 1.0)) == 0.0, key=request_key(seed))

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        indexes = [seq.generated + lead for seq in seqs]  # each row's frame: its text row's index
        states: list[TalkerState] = [seq.state for seq in seqs]
        # one copy to the device, never waited for: the noise keys, frame indexes, greedy flags
        rows = to_device(torch.tensor([[s.key for s in states], indexes, [s.greedy for s in states]],
                                      dtype=torch.int64), logits.device)
        if self.suppressed.device != logits.device:
            self.suppressed = self.suppressed.to(logits.device)
        logits = logits.index_fill(1, self.suppressed, float("-inf"))
        if min(indexes) < MIN_FRAMES:  # no EOS before MIN_FRAMES frames
            logits[:, self.eos] = logits[:, self.eos].masked_fill(rows[1] < MIN_FRAMES, float("-inf"))
        code0 = sample(logits, seqs)
        frame = self.frames(self.forward.last_hidden, code0, rows[0], rows[1], rows[2])
        host = codes_to_host(frame.codes)
        prompts = [self.forward.prompts[seq.request_id] for seq in seqs]
        following = frame.embeds + torch.stack([p.text_row(f) for p, f in zip(prompts, indexes)])
        self.forward.write([self.forward.row(seq.request_id, len(seq.tokens) + lead) for seq in seqs], following)
        for j, state in enumerate(states):
            if lead == 0:  # frames left from a discarded step launched ahead go
                state.pending.clear()
            state.pending.append(host[j:j + 1])
        return code0

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        codes = seq.state.pending.pop(0)
        return {} if token == self.eos else {"codes": codes.clone()}


class TalkerEngine(Engine):
    """The talker node: each request's prompt built at its prefill from its params (text ids,
    instruction ids, language, speaker or clip vector, text layout; for in-context cloning the
    clip's frames ``ref_codes [T, Q]`` and its transcript's ``ref_ids``)."""

    def __init__(self, engine: AutoregressiveEngine, config: Qwen3TTSConfig) -> None:
        self.engine = engine
        self.forward: TalkerStepForward = engine.forward
        self.config = config
        self.placeholder = config.talker.codec_pad_id  # the id the prompt's rows stand under

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        runs = []
        for item in items:
            if item.op == "prefill":
                prompt = self._prompt(item)
                self.forward.prompts[item.request_id] = prompt
                ids = torch.full((prompt.embeds.shape[0],), self.placeholder, dtype=torch.int64)
                item = EngineItem(item.request_id, "prefill", item.iteration, {"prompt_ids": ids}, item.params)
            runs.append(item)
        return self.engine.run(runs)

    @torch.inference_mode()
    def _prompt(self, item: EngineItem):
        params, talker = item.params, self.forward.model
        weight = talker.codec_head.weight
        embed = item.inputs.get("speaker_embed")
        embed = embed.reshape(-1).to(weight.device, weight.dtype) if embed is not None and embed.numel() else None
        codes = item.inputs.get("ref_codes")
        reference = None
        if codes is not None and codes.numel():  # in-context cloning: the clip's frames and transcript
            codes = codes.reshape(-1, self.config.talker.num_code_groups).to(weight.device, torch.int64)
            reference = (list(params["ref_ids"]), codes)
        return talker_prompt(talker, self.config, item.inputs["prompt_ids"].reshape(-1).tolist(),
                             language=params["language"], speaker=params.get("speaker"),
                             instruct_ids=params.get("instruct_ids") or None, speaker_embed=embed,
                             non_streaming=bool(params["non_streaming"]), reference=reference)

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


WINDOW_BUCKETS = (1, 2, 4, 8, 16, 32)  # the codec graphs' batch buckets
TOTAL_STEP = 8  # a packed batch's window length is rounded up to a multiple of this


def conv_frames(n: int) -> int:
    """The conv stack's length for windows needing ``n`` frames (lead and new): 1, 2, 4, 8, then
    a multiple of 4, so that windows of nearby sizes share a graph at little padding."""
    return n if n <= 2 else 4 if n <= 4 else 8 if n <= 8 else -(-n // 4) * 4


def packed_windows(codec: Qwen3TTSCodec, left_context: int = 72, max_frames: int = 25
                   ) -> Callable[[list[tuple[torch.Tensor, int]]], list[torch.Tensor]]:
    """The windows of a codec step, ``(codes [Q, T], context)`` each, decoded in few calls of few
    shapes (``codec_cuda_graphs``): windows whose conv stacks round to one length ``C``
    (``conv_frames`` of their lead and new frames) form a batch whatever their contexts, each
    left-aligned and padded on the right to ``left_context + C`` frames, the longest such a
    window can be (``Qwen3TTSCodec.decode_rows``: every layer is causal, so a row's own samples
    are those of its window alone; the padding costs only transformer rows, the conv stack
    being nearly all of the decoder's time). A batch is padded to the next of
    ``WINDOW_BUCKETS`` rows of zeros and replays a CUDA graph per (rows,
    ``C``): a few dozen shapes in all, every window up to ``max_frames`` new frames, captured at
    start (``decode.capture_all``) so that no stream waits on a capture. (Keyed by each
    window's length and context, the adaptive ramp's varied windows captured graphs
    mid-stream.) Off CUDA the same padding and static inputs run eagerly."""
    weight = next(codec.parameters())
    reach, spf, largest = codec.conv_reach, codec.samples_per_frame, WINDOW_BUCKETS[-1]
    lengths = sorted({conv_frames(n) for n in range(1, reach + max_frames + 1)})
    frames_now = [0]  # the conv stack's length: a Python int, part of the graph's key
    graphs = ShapeGraphs(lambda codes, starts: codec.decode_rows(codes, starts, frames_now[0]), weight.device,
                         max_graphs=len(WINDOW_BUCKETS) * len(lengths))

    def length_of(frames: int, longest: int) -> int:
        return -(-max(left_context + frames, longest) // TOTAL_STEP) * TOTAL_STEP

    def decode(windows: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        spans = []  # (lead, new, start of the conv stack's input) a window
        groups: dict[int, list[int]] = defaultdict(list)
        for i, (codes, context) in enumerate(windows):
            lead = min(reach, context)
            spans.append((lead, codes.shape[-1] - context, context - lead))
            groups[conv_frames(codes.shape[-1] - context + lead)].append(i)
        out: list[torch.Tensor | None] = [None] * len(windows)
        for frames, members in groups.items():
            for first in range(0, len(members), largest):
                rows = members[first:first + largest]
                bucket = next(size for size in WINDOW_BUCKETS if size >= len(rows))
                length = length_of(frames, max(windows[i][0].shape[-1] for i in rows))
                codes = torch.zeros(bucket, windows[rows[0]][0].shape[0], length, dtype=torch.int64)
                starts = torch.zeros(bucket, dtype=torch.int64)
                for row, i in enumerate(rows):  # rows past them stay zeros: codes of their own, never read
                    window = windows[i][0]
                    codes[row, :, :window.shape[-1]] = window
                    starts[row] = spans[i][2]
                frames_now[0] = frames
                with torch.inference_mode():
                    wav = graphs((bucket, length, frames), to_device(codes, weight.device),
                                 to_device(starts, weight.device))
                    wav = wav[:len(rows)].float().cpu()  # one copy a batch
                for row, i in enumerate(rows):
                    lead, new, _ = spans[i]
                    out[i] = wav[row, lead * spf:(lead + new) * spf].clone()
        return out  # type: ignore[return-value]

    def capture_all() -> None:
        """Every (rows, conv length) graph, now (CUDA only)."""
        if weight.device.type != "cuda":
            return
        for bucket in WINDOW_BUCKETS:
            for frames in lengths:
                length, frames_now[0] = length_of(frames, 0), frames
                codes = torch.zeros(bucket, codec.config.num_quantizers, length, dtype=torch.int64)
                with torch.inference_mode():
                    graphs((bucket, length, frames), codes.to(weight.device),
                           torch.zeros(bucket, dtype=torch.int64, device=weight.device))

    decode.graphs = graphs  # type: ignore[attr-defined]  (its shapes, for the tests)
    decode.capture_all = capture_all  # type: ignore[attr-defined]
    return decode


def codec_fn(codec: Qwen3TTSCodec, left_context: int = 72, watermark: AudioSealGenerator | None = None,
             marks: AudioWatermarkKnobs | None = None, streams: dict[str, WatermarkStream] | None = None,
             cuda_graphs: bool = False, max_frames: int = 25):
    """The codec node: each window (``codes [n, Q]``, its left context first) decoded; the
    context's frames run through the transformer only; windows of one shape batched. An
    in-context clone's first windows take their missing context (up to ``left_context``
    frames) from the end of its clip's frames (``ref_codes``), as the reference decodes the
    clip's frames before the new ones. With a ``watermark``, each request's new audio is then
    marked with its own stream (in ``streams``, made at its first window and dropped after its
    last), so its windows come out as its whole utterance marked at once, however it was cut.
    ``cuda_graphs``: windows of nearby sizes packed, each batch replayed per shape
    (``packed_windows``, windows of up to ``max_frames`` new frames captured now)."""
    weight = next(codec.parameters())
    packed = packed_windows(codec, left_context, max_frames) if cuda_graphs else None
    if packed is not None:
        packed.capture_all()
    groups_q = codec.config.num_quantizers
    streams = {} if streams is None else streams

    def window(item: EngineItem) -> tuple[torch.Tensor, int]:
        codes = item.inputs["codes"].reshape(-1, groups_q).T
        ref = item.inputs.get("ref_codes")
        if ref is None or not ref.numel():
            return codes, item.chunk.keep_start
        return with_prefix(codes, item.chunk.keep_start, ref.reshape(-1, groups_q).T, left_context)

    def mark(item: EngineItem, audio: torch.Tensor) -> torch.Tensor:
        stream = streams.get(item.request_id)
        if stream is None:
            stream = streams[item.request_id] = watermark.new_stream(marks.message, marks.alpha)
        out = watermark.mark_chunk(audio.to(next(watermark.parameters()).device), stream).float().cpu()
        if item.chunk is not None and item.chunk.last:
            streams.pop(item.request_id, None)
        return out

    def decode(windows: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        if packed is not None:
            return packed(windows)
        audio: list[torch.Tensor | None] = [None] * len(windows)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, (codes, context) in enumerate(windows):
            groups[(codes.shape[-1], context)].append(i)
        for (_, context), indices in groups.items():
            codes = torch.stack([windows[i][0] for i in indices])
            with torch.inference_mode():
                wav = codec.decode_window(to_device(codes.long(), weight.device), context).float().cpu()  # one copy
            for row, i in enumerate(indices):
                audio[i] = wav[row].clone()
        return audio  # type: ignore[return-value]

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        audio = decode([window(item) for item in items])
        return [{"audio": mark(item, wav) if watermark is not None else wav} for item, wav in zip(items, audio)]

    return run


class CodecEngine(StatelessEngine):
    """The codec node's engine: ``codec_fn``, and a cancelled request's watermark stream freed."""

    def __init__(self, codec: Qwen3TTSCodec, watermark: AudioSealGenerator | None = None,
                 marks: AudioWatermarkKnobs | None = None, *, left_context: int = 72,
                 cuda_graphs: bool = False, max_frames: int = 25) -> None:
        if watermark is not None and codec.samples_per_frame % watermark.cfg.hop:
            raise ValueError(f"model_kwargs.audio_watermark.generator: its hop of {watermark.cfg.hop} samples "
                             f"does not divide the codec's {codec.samples_per_frame} samples a frame")
        self.streams: dict[str, WatermarkStream] = {}
        self.codec = codec
        super().__init__(codec_fn(codec, left_context, watermark, marks, self.streams, cuda_graphs, max_frames))

    def release(self, request_id: str) -> None:
        self.streams.pop(request_id, None)


def talker_engine(talker: Qwen3TTSTalker, config: Qwen3TTSConfig, *, num_pages: int, page_size: int,
                  max_seq_len: int, device: torch.device, dtype: torch.dtype, max_requests: int = 64,
                  attention_backend: str = "torch", cuda_graphs: bool = False, overlap_scheduling: bool = False,
                  fused_kernels: bool = False,
                  graph_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> TalkerEngine:
    """The talker node's engine. ``max_requests``: requests held at once. ``cuda_graphs``: a
    decode step's talker layers replay the engine's decode graphs and the code predictor's
    frame its own (``FramePredictor``), per batch bucket of ``graph_batch_sizes``, all
    captured now on CUDA (with the Triton attention kernels, whatever ``attention_backend``
    says); off CUDA the bucketed path runs eagerly. ``overlap_scheduling``: the next decode
    step is launched before this one's codes are read back. ``fused_kernels``: the talker's
    and the predictor's layers run Llama's fused kernels (``use_fused_kernels``)."""
    use_fused_kernels(talker, fused_kernels)
    backend = "triton" if cuda_graphs and device.type == "cuda" else attention_backend
    forward = TalkerStepForward(talker, max_requests)
    frames = FramePredictor(talker, backend=backend, cuda_graphs=cuda_graphs, batch_sizes=graph_batch_sizes)
    engine = AutoregressiveEngine(talker, KVLayout(*talker.cache_shape()), num_pages=num_pages, page_size=page_size,
                                  max_seq_len=max_seq_len, device=device, dtype=dtype, forward=forward,
                                  rules=TalkerRules(forward, frames), attention_backend=backend,
                                  cuda_graphs=cuda_graphs, graph_batch_sizes=graph_batch_sizes,
                                  overlap_scheduling=overlap_scheduling)
    if engine.graphs is not None:
        engine.graphs.capture_all()
        frames.capture_all()
    return TalkerEngine(engine, config)
