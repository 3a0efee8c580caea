"""LTX-2.5 text-to-audio+video (Lightricks/LTX-2.5-Diffusers): the declaration.

Four nodes: ``text_encoder`` (Gemma 4 + the text connectors: the video and audio prompt
features), ``dit`` (the joint audio-video DiT as a denoise engine: a ``Loop`` of the distilled
recipe's eight Euler steps over the video and audio tokens together, no guidance),
``vae_decoder`` (video tokens -> uint8 frames ``[F, H, W, 3]``, emitted as ``video``) and
``audio_decoder`` (audio tokens -> mel -> 48 kHz stereo waveform ``[2, samples]``, emitted as
``audio``). The walk follows the requested output modalities: ``t2av`` decodes both,
``t2v`` skips the audio decode (the DiT still denoises both streams: they attend to each other).

Sizes are checked before queueing: width and height multiples of 32 (the video VAE's), at
least 32; ``num_frames`` of the form 8k + 1 (the VAE codes the first frame alone, then eight at
a time); the area and video caps of ``LtxKnobs``. The two-stage recipe, image-to-video and the
duration head are not ported.
"""

from __future__ import annotations

import torch
from pydantic import Field

from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.graph import Emit, Graph, Loop, Node, Sequential, Step, Walk
from mstar.model.knobs import RequestKnobs
from mstar.model.ltx2_5.checkpoint import LtxCheckpoint
from mstar.model.ltx2_5.denoise import DISTILLED_SIGMAS, audio_frame_count, frame_count, pack_video
from mstar.model.ltx2_5.knobs import LtxKnobs
from mstar.model.ltx2_5.text import tokenize
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest

SIZE_MULTIPLE = 32
FRAME_STEP = 8
SAMPLE_RATE = 48000


class LtxVideoKnobs(RequestKnobs):
    """``/generate``'s ``model_kwargs`` for an LTX-2.5 request."""

    height: int = Field(544, ge=1)
    width: int = Field(960, ge=1)
    num_frames: int = Field(121, ge=1)
    fps: float = Field(24.0, gt=0, le=240)
    seed: int | None = None


def check_ltx_size(width: int, height: int, num_frames: int, knobs: LtxKnobs) -> None:
    """``RequestError`` naming the field for a size the model cannot make or the caps refuse."""
    for field, side in (("width", width), ("height", height)):
        if side % SIZE_MULTIPLE or side < SIZE_MULTIPLE:
            raise RequestError(field, f"must be a positive multiple of {SIZE_MULTIPLE}, got {side}")
    if width * height > knobs.max_image_area:
        raise RequestError("width", f"{width}x{height} is over max_image_area ({knobs.max_image_area} pixels)")
    if (num_frames - 1) % FRAME_STEP:
        low = (num_frames - 1) // FRAME_STEP * FRAME_STEP + 1
        raise RequestError("num_frames", f"must be {FRAME_STEP}k + 1 (1, 9, 17, ..., 121), got {num_frames} "
                                         f"(nearest: {low} or {low + FRAME_STEP})")
    if width * height * num_frames > knobs.max_video_pixels:
        raise RequestError("num_frames", f"{width}x{height}x{num_frames} is over max_video_pixels "
                                         f"({knobs.max_video_pixels} pixels)")


def initial_noise(seed: int, video_shape: tuple[int, ...], audio_shape: tuple[int, ...]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's starting noise from one CPU generator: video ``[C, F, H, W]`` then audio
    ``[C, T, bins]``, as tokens ``[F * H * W, C]`` and ``[T, C * bins]``."""
    gen = torch.Generator().manual_seed(seed)
    video = torch.randn((1, *video_shape), generator=gen)
    audio = torch.randn((1, *audio_shape), generator=gen)
    return pack_video(video)[0], audio.transpose(1, 2).flatten(2)[0]


class AudioVideoStream(OutputStream):
    """Emitted frames -> one ``video`` event (raw frame-major RGB bytes); the waveform -> one
    ``audio`` event (48 kHz stereo, interleaved 16-bit little-endian PCM)."""

    def __init__(self, fps: float) -> None:
        self.fps, self.frames, self.samples = fps, 0, 0

    @property
    def generated(self) -> int:
        return self.frames

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        if modality == "audio":
            pcm = (value.float().clamp(-1, 1) * 32767).round().to(torch.int16).T.contiguous()
            self.samples += pcm.shape[0]
            return OutputEvent(modality="audio", data=pcm.numpy().astype("<i2").tobytes())
        self.frames += int(value.shape[0])
        return OutputEvent(modality="video", data=value.contiguous().numpy().tobytes())


@register
class Ltx25(ModelSpec):
    key = "ltx2_5"
    tasks = frozenset({"video_generation"})
    video_frame_step = FRAME_STEP
    video_knobs = LtxVideoKnobs
    video_soundtrack = (SAMPLE_RATE, 2)  # the routes' mp4 carries it as AAC
    input_modalities = frozenset({"text"})
    default_weights = "Lightricks/LTX-2.5-Diffusers"
    Knobs = LtxKnobs
    knobs: LtxKnobs

    def graph(self) -> Graph:
        nodes = [
            Node("text_encoder", "stateless", inputs=("prompt_ids", "prompt_mask"), outputs=("text", "audio_text")),
            Node("dit", "denoise", inputs=("video", "audio", "text", "audio_text"), outputs=("video", "audio"),
                 ops=("step",)),
            Node("vae_decoder", "stateless", inputs=("video",), outputs=("frames",)),
            Node("audio_decoder", "stateless", inputs=("audio",), outputs=("waveform",)),
        ]
        return Graph.build(nodes, [self._walk(audio) for audio in (True, False)])

    @staticmethod
    def _walk(audio: bool) -> Walk:
        decode = [Step("vae_decoder", reads="video", writes="frames", emit=Emit("frames", "video"))]
        if audio:
            decode.append(Step("audio_decoder", reads="audio", writes="waveform", emit=Emit("waveform", "audio")))
        return Walk("t2av" if audio else "t2v", Sequential(
            Step("text_encoder", reads=("prompt_ids", "prompt_mask"), writes=("text", "audio_text")),
            Loop(Step("dit", "step", reads=("video", "audio", "text", "audio_text"), writes=("video", "audio")),
                 max_iters="num_steps", progress=True),
            *decode,
        ), inputs=("prompt_ids", "prompt_mask", "video", "audio"))

    # -------------------------------------------------------------- frontend
    def checkpoint(self) -> LtxCheckpoint:
        return LtxCheckpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        ckpt = self.checkpoint()
        ckpt.check_variant()
        self.tokenizer = ckpt.tokenizer()
        dit = ckpt.transformer_config()
        self.video_channels, self.audio_channels = dit.in_channels, ckpt.audio_vae_config().latent_channels
        self.audio_bins = ckpt.audio_vae_config().mel_bins // 4

    def check_video(self, spec: GenerateSpec) -> LtxVideoKnobs:
        """The request's checks, each a ``RequestError`` naming the field, without queueing
        anything (the job route runs them before it answers): its knobs."""
        wanted = set(spec.output_modalities)
        if not wanted or not wanted <= {"video", "audio"} or "video" not in wanted:
            raise RequestError("output_modalities", f"model {self.key!r} outputs video, or video and audio")
        if spec.files:
            raise RequestError("files", f"model {self.key!r} takes text only (image-to-video is not ported)")
        knobs = LtxVideoKnobs.parse(spec.model_kwargs)
        if not spec.text.strip():
            raise RequestError("prompt", "must not be empty")
        check_ltx_size(knobs.width, knobs.height, knobs.num_frames, self.knobs)
        return knobs

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        wanted = set(spec.output_modalities)
        knobs = self.check_video(spec)
        ids, mask = tokenize(self.tokenizer, [spec.text], self.knobs.max_prompt_tokens)
        grid = (frame_count(knobs.num_frames), knobs.height // SIZE_MULTIPLE, knobs.width // SIZE_MULTIPLE)
        audio_frames = audio_frame_count(knobs.num_frames, knobs.fps)
        seed = knobs.seed if knobs.seed is not None else torch.seed() % (1 << 31)
        video, audio = initial_noise(seed, (self.video_channels, *grid),
                                     (self.audio_channels, audio_frames, self.audio_bins))
        params = {"num_steps": len(DISTILLED_SIGMAS), "grid": grid, "fps": knobs.fps, "num_frames": knobs.num_frames}
        inputs = {"prompt_ids": ids[0], "prompt_mask": mask[0], "video": video, "audio": audio}
        walk = "t2av" if "audio" in wanted else "t2v"
        return WalkRequest(walk, inputs, params, prompt_tokens=int(mask.sum()))

    def output_stream(self, request: WalkRequest, stop: list[str]) -> AudioVideoStream:
        return AudioVideoStream(request.params["fps"])

    def parallel_dims(self) -> dict:
        """The ``dit`` node splits every attention's heads (video and audio) and both FFN widths
        over ``tp_size``; Ulysses splits the video tokens, so the video heads must also divide by
        ``tp_size x sp_size`` (the audio stream stays whole on every SP rank). The text encoder
        and the decoders run whole. Token counts need no check: the shards may be uneven."""
        from mstar.distributed.dims import ParallelDims

        c = self.checkpoint().transformer_config()
        tensor = {"num_attention_heads": c.num_attention_heads,
                  "audio_num_attention_heads": c.audio_num_attention_heads,
                  "ffn_dim": 4 * c.dim, "audio_ffn_dim": 4 * c.audio_dim}
        return {"dit": ParallelDims(tensor=tensor, sequence={"num_attention_heads": c.num_attention_heads})}

    # ---------------------------------------------------------------- worker
    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.ltx2_5.engine import ltx_engines

        ckpt = self.checkpoint()
        ckpt.check_variant()
        return ltx_engines(ckpt, self.config, self.knobs.seed, set(nodes), device)
