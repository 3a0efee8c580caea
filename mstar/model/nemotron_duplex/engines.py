"""The duplex model's engines: the streamed speech encoder and the frame-synchronous nano LLM.

``EncoderEngine`` (node ``conformer_encoder``, a stream consumer of the client's audio; the
calls of a plan share one pass of the conformer blocks):
each call holds one slot of the ``encoder_state`` pool from its first chunk until it is
released, however it ends; the slot holds its front end (``MelStream``) and encoder state
(``EncoderStream``). A chunk is one append: its samples run through the front end, the new
mel frames through the encoder, and the encoder frames no later audio can change leave,
projected to LLM embeddings. The stream's last chunk (the client's end of input) flushes the
frames that read the clip's end. A chunk that finalises no frame writes nothing (no item for
the LLM's stream).

``NanoEngine`` (node ``nano_llm``): the Nemotron-H autoregressive engine (paged KV for the
attention layers, a ``mamba_state`` slot per call) behind two ops. ``prime`` prefills the
system prompt; ``frame`` takes the call's new encoder frames and, for each, runs one decode
step whose input embedding is the frame plus the embedding of the agent's previous text
token (``agent_pad_token_id`` before its first), then samples the next one: one agent text
token per 80 ms frame. That is the text channel of NeMo's duplex inference loop
(``DuplexS2SModel.offline_inference``: the first frame with the pad's embedding, each later
one with its predecessor's token), with the speech channel left to the talker. The
end-of-sequence token is an ordinary token here: the loop ends when the audio does, not on
it. The frames of every call in a plan run as one batched step per frame position.
"""

from __future__ import annotations

import torch

from mstar.engine.autoregressive import AutoregressiveEngine
from mstar.engine.base import Engine, EngineItem, EngineOutput
from mstar.engine.state_pool import StatePool
from mstar.model.fastconformer.features import MelSettings
from mstar.model.fastconformer.stream import EncoderStream, push_many
from mstar.model.nemotron_duplex.features import MIN_SAMPLES, MelStream, _Bank
from mstar.model.nemotron_duplex.modeling import SpeechEncoder


class EncoderEngine(Engine):
    def __init__(self, model: SpeechEncoder, settings: MelSettings, *, max_slots: int) -> None:
        self.model = model
        self.settings = settings
        self.bank = _Bank(settings)
        self.pool = StatePool(max_slots)
        self.calls: dict[str, tuple[MelStream, EncoderStream]] = {}

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        """Every call's front end on its own, then the conformer blocks once over all their
        new frames (``push_many``), then the projection."""
        for item in items:  # before any call's state moves: the worker then retries each alone
            if item.chunk is not None and item.chunk.last:
                front = self.calls.get(item.request_id)
                heard = (front[0].received if front else 0) + item.inputs["audio"].numel()
                if heard < MIN_SAMPLES:
                    raise ValueError(f"the call ended with {heard} samples, too short to featurize "
                                     f"(at least {MIN_SAMPLES}, about 16 ms)")
        with torch.inference_mode():
            calls, mels, lasts = [], [], []
            for item in items:
                call = self.calls.get(item.request_id)
                if call is None:
                    self.pool.allocate(item.request_id)  # OutOfSlots fails the item: admission prevents it
                    call = self.calls[item.request_id] = (MelStream(self.settings, self.bank),
                                                          EncoderStream(self.model.encoder))
                front, _ = call
                mel = front.push(item.inputs["audio"].reshape(-1).to(torch.float32))
                last = item.chunk is not None and item.chunk.last
                if last:
                    mel = torch.cat([mel, front.end()])
                calls.append(call[1])
                mels.append(mel)
                lasts.append(last)
            frames = push_many(calls, mels, lasts)
            return [EngineOutput({"frames": self.model.project(f)}) if f.shape[0] else EngineOutput({})
                    for f in frames]

    def release(self, request_id: str) -> None:
        self.calls.pop(request_id, None)
        self.pool.free(request_id)

    def stats(self) -> dict[str, float]:
        return {"encoder_slots_used": float(self.pool.num_used)}


class NanoEngine(Engine):
    def __init__(self, inner: AutoregressiveEngine, model, *, pad_token_id: int) -> None:
        self.inner = inner
        self.model = model
        self.pad = pad_token_id
        self.last: dict[str, int] = {}  # the agent's previous text token, per call

    def run(self, items: list[EngineItem]) -> list[EngineOutput]:
        primes = [i for i in items if i.op == "prime"]
        frames = [i for i in items if i.op == "frame"]
        done: dict[int, EngineOutput] = {}
        if primes:
            self.inner.run([EngineItem(i.request_id, "prefill", 0, {"prompt_ids": i.inputs["prompt_ids"]},
                                       i.params) for i in primes])
            for item in primes:
                self.last[item.request_id] = self.pad
                done[id(item)] = EngineOutput({"primed": torch.ones(1)})
        if frames:
            done |= self._frames(frames)
        return [done[id(item)] for item in items]

    def _frames(self, items: list[EngineItem]) -> dict[int, EngineOutput]:
        tokens: dict[int, list[int]] = {id(item): [] for item in items}
        longest = max(item.inputs["frame"].shape[0] for item in items)
        for j in range(longest):
            step = [item for item in items if item.inputs["frame"].shape[0] > j]
            batch = []
            with torch.inference_mode():
                for item in step:
                    previous = torch.tensor([self.last[item.request_id]])
                    # the engine checks a decode's token against its history: the prime's
                    # sampled token the first time, then each frame's
                    history = self.inner.seqs[item.request_id].tokens[-1]
                    embed = self.model.embed_input_ids(previous.to(self._device()))
                    fused = item.inputs["frame"][j:j + 1].to(embed.dtype) + embed
                    batch.append(EngineItem(item.request_id, "decode", j, {
                        "token": torch.tensor([history]), "input_embeds": fused}, item.params))
            results = self.inner.run(batch)
            for item, result in zip(step, results):
                token = int(result.outputs["token"].reshape(-1)[0])
                self.last[item.request_id] = token
                tokens[id(item)].append(token)
        return {key: EngineOutput({"token": torch.tensor(ids, dtype=torch.int64)}) for key, ids in tokens.items()}

    def _device(self) -> torch.device:
        return self.model.backbone.embeddings.weight.device

    def release(self, request_id: str) -> None:
        self.last.pop(request_id, None)
        self.inner.release(request_id)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()
