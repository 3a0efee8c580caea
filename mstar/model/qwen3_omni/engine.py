"""Qwen3-Omni's engines: the thinker and the talker on the autoregressive engine, code2wav as
a stateless node over chunks of codec frames.

**Thinker** (``ThinkerForward``, ``ThinkerRules``): a prefill splices its request's audio clips
(the audio tower, run per request: a clip's short last chunk depends on what else is in the
encoder call) and images and videos (the vision tower over both in prompt order, their rows
spliced over the image and video pads, with deepstack and 3-axis positions) into the prompt's
embeddings. Positions are float32 whenever a request has 3-axis ones (a video's temporal steps
may be fractional; whole positions are exact in float32). A request of the ``speech`` walk
(param ``keep_states``) also keeps, over every step, the input embeddings and the talker's
``accept_hidden_layer`` states of the tokens it runs; its last step writes them
(``thinker_embeds``, ``thinker_hidden``, the three ``tts_*`` embeddings appended to the first)
with its ids (``thinker_ids``) for the talker.

**Talker** (``TalkerEngine`` around an ``AutoregressiveEngine`` with ``TalkerForward`` and
``TalkerRules``): its prefill builds the request's talker prompt from the thinker's states
(``speech.talker_prompt``) and runs it as input embeddings (the sequence's token ids are
placeholders); each step draws codebook 0 (the reference's suppressed ids masked), the code
predictor fills the frame inside the same step, and the frame's embedding sum plus the next
text row is the next step's input. A step writes the frame's codes (``[1, Q]``) for the
stream to code2wav, silent at the codec EOS. The talker reads its own params
(``talker_sampling``, ``talker_max_frames``) and raises ``talker_stop`` (the thinker's ``stop``
is already set on the request). An answer too short to speak (fewer than two tokens) makes
no frames: the prefill raises ``talker_stop`` without running.

**code2wav** (``code2wav_fn``): each chunk's frames decoded after its left context, whose
samples are dropped (``Qwen3OmniCode2Wav.decode_chunks``' cut); chunks of one length batched.

No preemption, no step launched ahead, no CUDA graphs: the thinker's media and the talker's
embedding inputs are not recomputed from token ids, so requests hold their pages from admission.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from mstar.engine.autoregressive import AutoregressiveEngine, KVLayout
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.forward import Forward
from mstar.engine.rules import Sample, TokenRules
from mstar.engine.sequence import Sequence
from mstar.layers.paged_kv import PagedAttentionMetadata, to_device
from mstar.model.qwen3_omni.checkpoint import Qwen3OmniThinker
from mstar.model.qwen3_omni.code2wav import Qwen3OmniCode2Wav
from mstar.model.qwen3_omni.inputs import splice_features
from mstar.model.qwen3_omni.modeling import Deepstack
from mstar.model.qwen3_omni.speech import ChatTokens, TalkerPrompt, special_codes, talker_prompt
from mstar.model.qwen3_omni.talker import Qwen3OmniTalker

TALKER_STOP = "talker_stop"
THINKER_STATES = ("thinker_ids", "thinker_embeds", "thinker_hidden")
MEDIA_INPUTS = ("audio_mels", "audio_frames", "pixel_values", "grid_thw", "positions")


# ------------------------------------------------------------------------------ thinker
class ThinkerForward(Forward):
    """The thinker over a step: media spliced into prefills, 3-axis positions for requests with
    images or videos, and the kept rows of ``keep_states`` requests."""

    runs_ahead = False
    kv_from_tokens = False
    preemptible = False

    def __init__(self, thinker: Qwen3OmniThinker, *, keep_layer: int, audio_id: int, image_id: int,
                 video_id: int) -> None:
        super().__init__(thinker)
        self.graph_rows = None
        self.keep_layer = keep_layer
        self.audio_id, self.vision_ids = audio_id, torch.tensor([image_id, video_id])
        self.rope_deltas: dict[str, float] = {}
        self.kept: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)

    def prepare(self, items: list[EngineItem], input_ids: torch.Tensor, meta: PagedAttentionMetadata,
                counts: list[int] | None) -> dict:
        embeds = self.model.text.model.embed_tokens(input_ids)
        bounds = meta.host_query_start_loc
        positions = None
        image_rows = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        deepstack: list[list[torch.Tensor]] = []
        for row, item in enumerate(items):
            lo, hi = bounds[row], bounds[row + 1]
            if item.op == "prefill":
                embeds[lo:hi] = self._audio(item, input_ids[lo:hi], embeds[lo:hi])
                features = self._vision(item)
                if features is not None:
                    mask = torch.isin(input_ids[lo:hi], self.vision_ids.to(input_ids.device))
                    embeds[lo:hi] = splice_features(embeds[lo:hi], mask.long(), 1, [features.embeds],
                                                    kind="image and video")
                    image_rows[lo:hi] = mask
                    deepstack.append(list(features.deepstack))
                given = item.inputs.get("positions")
                if given is not None and given.numel():
                    if positions is None:
                        positions = meta.positions[None].repeat(3, 1).float()
                    positions[:, lo:hi] = given.to(positions.device, torch.float32)
                    self.rope_deltas[item.request_id] = float(given.max()) + 1 - given.shape[1]
            elif item.request_id in self.rope_deltas:
                if positions is None:
                    positions = meta.positions[None].repeat(3, 1).float()
                positions[:, lo:hi] += self.rope_deltas[item.request_id]
        stack = None
        if deepstack:
            stack = Deepstack(image_rows, [torch.cat(layer) for layer in zip(*deepstack)])
        keep = [(item.request_id, bounds[row], bounds[row + 1]) for row, item in enumerate(items)
                if item.params.get("keep_states")]
        return {"embeds": embeds, "positions": positions, "deepstack": stack, "keep": keep}

    def _audio(self, item: EngineItem, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        frames = item.inputs.get("audio_frames")
        if frames is None or not frames.numel():
            return embeds
        tower = self.model.audio_tower
        mels = item.inputs["audio_mels"].to(embeds.device, tower.conv2d1.weight.dtype)
        clips = tower(list(mels.split(frames.tolist(), dim=1)))
        return splice_features(embeds, ids, self.audio_id, clips, kind="audio")

    def _vision(self, item: EngineItem):
        grid = item.inputs.get("grid_thw")
        if grid is None or not grid.numel():
            return None
        visual = self.model.visual
        weight = visual.patch_embed.proj.weight
        return visual(item.inputs["pixel_values"].to(weight.device, weight.dtype), grid.reshape(-1, 3).tolist())

    def hidden(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata, kv_caches: list[torch.Tensor],
               inputs: dict, counts: list[int] | None) -> torch.Tensor:
        final, kept = self.model.text.model.forward_keeping(
            None, meta, kv_caches, inputs["embeds"], inputs["positions"], inputs["deepstack"],
            layer=self.keep_layer if inputs["keep"] else None)
        for request_id, lo, hi in inputs["keep"]:
            self.kept[request_id].append((inputs["embeds"][lo:hi].clone(), kept[lo:hi].clone()))
        return final

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.text.compute_logits(hidden)

    def take(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's kept input embeddings and layer states, every token it ran, in order."""
        rows = self.kept.pop(request_id, [])
        return torch.cat([e for e, _ in rows]), torch.cat([h for _, h in rows])

    def release(self, request_id: str) -> None:
        self.rope_deltas.pop(request_id, None)
        self.kept.pop(request_id, None)


class ThinkerRules(TokenRules):
    """Every token sampled; a ``keep_states`` request's last step writes what the talker reads."""

    extra_outputs = True

    def __init__(self, forward: ThinkerForward, tts_ids: tuple[int, int, int]) -> None:
        self.forward = forward
        self.tts_ids = tts_ids  # tts_bos, tts_eos, tts_pad

    def start(self, params: dict) -> bool:
        return bool(params.get("keep_states", False))

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        return {}

    def last_outputs(self, seq: Sequence) -> dict[str, torch.Tensor]:
        if not seq.state:
            return {}
        embeds, hidden = self.forward.take(seq.request_id)
        embed = self.forward.model.text.model.embed_tokens
        with torch.inference_mode():
            tts = embed(torch.tensor(self.tts_ids, device=embeds.device))
        return {"thinker_ids": torch.tensor(seq.tokens, dtype=torch.int64),
                "thinker_embeds": torch.cat((embeds, tts)), "thinker_hidden": hidden}

    def release(self, request_id: str) -> None:
        self.forward.kept.pop(request_id, None)


# ------------------------------------------------------------------------------- talker
class TalkerForward(Forward):
    """The talker over a step: prefills run their talker prompt's rows, decodes the input their
    previous step left (frame embedding sum + text row)."""

    runs_ahead = False
    kv_from_tokens = False
    preemptible = False

    def __init__(self, talker: Qwen3OmniTalker) -> None:
        super().__init__(talker)
        self.graph_rows = None
        self.prompts: dict[str, TalkerPrompt] = {}
        self.next_input: dict[str, torch.Tensor] = {}
        self.last_hidden: torch.Tensor | None = None

    def prepare(self, items, input_ids, meta, counts) -> dict:
        rows = [self.prompts[item.request_id].embeds if item.op == "prefill"
                else self.next_input.pop(item.request_id)[None] for item in items]
        return {"embeds": torch.cat(rows)}

    def hidden(self, input_ids, meta, kv_caches, inputs, counts) -> torch.Tensor:
        return self.model(inputs["embeds"], meta, kv_caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.last_hidden = hidden  # the code predictor's first row (``TalkerRules.choose``)
        return self.model.compute_logits(hidden)

    def release(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.next_input.pop(request_id, None)


@dataclass
class TalkerState:
    frames: int = 0  # frames drawn so far: the next text row's index
    codes: torch.Tensor | None = None  # [1, Q]: the last step's frame


class TalkerRules(TokenRules):
    """Codebook 0 drawn with the suppressed ids masked, then the rest of the frame from the code
    predictor (greedy); a step writes its frame's ``codes``, silent at the codec EOS."""

    extra_outputs = True

    def __init__(self, forward: TalkerForward) -> None:
        self.forward = forward
        talker: Qwen3OmniTalker = forward.model
        self.eos = talker.config.codec_eos_token_id
        self.suppressed = torch.tensor(special_codes(talker), dtype=torch.int64)

    def start(self, params: dict) -> TalkerState:
        return TalkerState()

    def choose(self, logits: torch.Tensor, seqs: list[Sequence], sample: Sample, lead: int = 0) -> torch.Tensor:
        logits = logits.index_fill(1, self.suppressed.to(logits.device), float("-inf"))
        code0 = sample(logits, seqs)
        speaking = [row for row, token in enumerate(code0.tolist()) if token != self.eos]
        if speaking:
            rows = to_device(torch.tensor(speaking), code0.device)
            frame = self.forward.model.predict_frame(self.forward.last_hidden.index_select(0, rows),
                                                     code0.index_select(0, rows))
            for j, row in enumerate(speaking):
                seq = seqs[row]
                state: TalkerState = seq.state
                state.codes = frame.codes[j:j + 1].cpu()
                prompt = self.forward.prompts[seq.request_id]
                self.forward.next_input[seq.request_id] = frame.embeds[j] + prompt.text_row(state.frames)
                state.frames += 1
        return code0

    def outputs(self, seq: Sequence, token: int) -> dict[str, torch.Tensor]:
        return {} if token == self.eos else {"codes": seq.state.codes}


class TalkerEngine(Engine):
    """The talker node: the thinker's states become each request's talker prompt at its prefill;
    the steps run on ``engine`` with the talker's own params, raising ``talker_stop``."""

    def __init__(self, engine: AutoregressiveEngine, tokens: ChatTokens, placeholder: int) -> None:
        self.engine = engine
        self.forward: TalkerForward = engine.forward
        self.tokens = tokens
        self.placeholder = placeholder  # the id the prompt's rows stand under (never embedded)

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        outputs: list[EngineOutput | None] = [None] * len(items)
        runs: list[tuple[int, EngineItem]] = []
        for i, item in enumerate(items):
            params = {**item.params, "sampling": item.params["talker_sampling"],
                      "max_new_tokens": item.params["talker_max_frames"],
                      "stop_token_ids": [self.forward.model.config.codec_eos_token_id]}
            if item.op == "prefill":
                prompt = self._prompt(item)
                if prompt is None:  # nothing to speak
                    outputs[i] = EngineOutput(flags=(TALKER_STOP,))
                    continue
                self.forward.prompts[item.request_id] = prompt
                ids = torch.full((prompt.embeds.shape[0],), self.placeholder, dtype=torch.int64)
                item = EngineItem(item.request_id, "prefill", item.iteration, {"prompt_ids": ids}, params)
            else:
                item = EngineItem(item.request_id, item.op, item.iteration, item.inputs, params, item.chunk)
            runs.append((i, item))
        if runs:
            for (i, _), out in zip(runs, self.engine.run([item for _, item in runs])):
                flags = tuple(TALKER_STOP if flag == "stop" else flag for flag in out.flags)
                outputs[i] = EngineOutput(out.outputs, flags, None, out.preempted)  # the thinker's reason stands
        return outputs  # type: ignore[return-value]

    @torch.inference_mode()
    def _prompt(self, item: EngineItem) -> TalkerPrompt | None:
        ids = item.inputs["thinker_ids"].reshape(-1).tolist()
        prompt_len = int(item.params["prompt_len"])
        talker = self.forward.model
        weight = talker.codec_head.weight
        embeds = item.inputs["thinker_embeds"].to(weight.device, weight.dtype)
        hidden = item.inputs["thinker_hidden"].to(weight.device, weight.dtype)
        try:
            return talker_prompt(talker, self.tokens, int(item.params["speaker_id"]), ids[:prompt_len],
                                 ids[prompt_len:], embeds[:-3], hidden, embeds[-3:])
        except ValueError as err:
            if "too short" in str(err):
                return None
            raise

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()


# ----------------------------------------------------------------------------- code2wav
def code2wav_fn(decoder: Qwen3OmniCode2Wav):
    """The codec node: each chunk's frames (``codes [n, Q]``, its left context first) decoded,
    the context's samples dropped; chunks of the same length decoded as one batch."""
    weight = next(decoder.parameters())
    per_frame = decoder.config.samples_per_frame

    def run(op: str, items: list[EngineItem]) -> list[dict[str, torch.Tensor]]:
        results: list[dict[str, torch.Tensor] | None] = [None] * len(items)
        by_length: dict[int, list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_length[item.inputs["codes"].shape[0]].append(i)
        for length, indices in by_length.items():
            codes = torch.stack([items[i].inputs["codes"].reshape(length, -1).T for i in indices])
            wav = decoder(codes.to(weight.device, torch.int64)).float().cpu()
            for row, i in enumerate(indices):
                results[i] = {"audio": wav[row, items[i].chunk.keep_start * per_frame:].clone()}
        return results  # type: ignore[return-value]

    return run


def thinker_engine(thinker: Qwen3OmniThinker, tokens: ChatTokens, *, keep_layer: int, num_pages: int,
                   page_size: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                   attention_backend: str) -> AutoregressiveEngine:
    forward = ThinkerForward(thinker, keep_layer=keep_layer, audio_id=tokens.audio, image_id=tokens.image,
                             video_id=tokens.video)
    return AutoregressiveEngine(thinker, KVLayout(*thinker.text.cache_shape()), num_pages=num_pages,
                                page_size=page_size, max_seq_len=max_seq_len, device=device, dtype=dtype,
                                forward=forward, attention_backend=attention_backend,
                                rules=ThinkerRules(forward, (tokens.tts_bos, tokens.tts_eos, tokens.tts_pad)))


def talker_engine(talker: Qwen3OmniTalker, tokens: ChatTokens, *, num_pages: int, page_size: int,
                  max_seq_len: int, device: torch.device, dtype: torch.dtype, attention_backend: str) -> TalkerEngine:
    forward = TalkerForward(talker)
    engine = AutoregressiveEngine(talker, KVLayout(*talker.cache_shape()), num_pages=num_pages, page_size=page_size,
                                  max_seq_len=max_seq_len, device=device, dtype=dtype, forward=forward,
                                  rules=TalkerRules(forward), attention_backend=attention_backend)
    return TalkerEngine(engine, tokens, talker.config.codec_pad_id)
