"""V-JEPA 2 (``vjepa2``) and V-JEPA 2-AC (``vjepa2_ac``): a video clip -> its embeddings, and
optionally predicted embeddings, through ``/generate``.

Two nodes each (``mstar.model.vjepa2.engine``) and two walks::

    encode:  encoder [frames -> embeddings]                                    emitted
    predict: encoder [frames -> embeddings], then                              emitted
             predictor [embeddings, context, target -> predicted]              (vjepa2) emitted
             predictor [embeddings, actions, states, extrinsics -> predicted]  (vjepa2_ac) emitted

Frames come as ``files``: one image per frame, or one video file (every frame decoded). All
frames of a clip share one size. ``vjepa2`` prepares them as Hugging Face's
``VJEPA2VideoProcessor`` does (shortest edge to ``crop * 256 / 224``, centre crop, ImageNet
normalisation); ``vjepa2_ac`` takes the official repo's central square crop (the largest centred
square, resized to the crop size) instead.

``output_modalities=["latent"]`` answers one ``latent`` event: an ``.npz`` archive of float32
arrays, ``embeddings`` ``[tokens, dim]`` and, when the predictor ran, ``predicted``
``[targets, dim]``; ``/generate``'s JSON names each array's shape beside it.
"""

from __future__ import annotations

import io

import numpy as np
import torch
import torch.nn.functional as F

from mstar.contract import GenerateSpec, OutputEvent, RequestError
from mstar.graph import Emit, Graph, Node, Sequential, Step, Walk
from mstar.model.registry import register
from mstar.model.spec import ModelSpec, OutputStream, WalkRequest
from mstar.model.vjepa2.checkpoint import VJEPA2ACCheckpoint, VJEPA2Checkpoint
from mstar.model.vjepa2.knobs import VJEPA2ACKnobs, VJEPA2ACRequest, VJEPA2Knobs, VJEPA2Request

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def decode_clip(files: list[tuple[str, bytes]], max_frames: int) -> torch.Tensor:
    """The request's frames as ``uint8 [T, H, W, 3]``: one image per file, or one video file."""
    from mstar.media.images import ImageError, decode_image

    if not files:
        raise RequestError("files", "send the clip: one image per frame, or one video file")
    frames: list[np.ndarray] = []
    for i, (_, data) in enumerate(files):
        try:
            frames.append(np.asarray(decode_image(data, field=f"files.{i}")))
        except ImageError as err:
            if len(files) == 1 and err.status == 400:
                return decode_video(data, max_frames)
            raise RequestError(err.field, err.message, err.status) from None
        if frames[-1].shape != frames[0].shape:
            raise RequestError(f"files.{i}", f"frame is {frames[-1].shape[1]}x{frames[-1].shape[0]}; the clip's "
                                             f"first frame is {frames[0].shape[1]}x{frames[0].shape[0]}")
    if len(frames) > max_frames:
        raise RequestError("files", f"{len(frames)} frames; at most {max_frames}")
    return torch.from_numpy(np.stack(frames))


def decode_video(data: bytes, max_frames: int) -> torch.Tensor:
    from mstar.media.video import VideoDecodeError, decode_frames, probe_video

    try:
        count = probe_video(data)[0]
        if count > max_frames:
            raise RequestError("files.0", f"the video has {count} frames; at most {max_frames}")
        if count < 1:
            raise RequestError("files.0", "the video has no frames")
        return torch.from_numpy(decode_frames(data, list(range(count))))
    except (VideoDecodeError, ModuleNotFoundError) as err:
        raise RequestError("files.0", f"neither an image nor a readable video ({err})") from None


def _resize(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``float [T, 3, H, W]`` on the 0..255 scale, bilinear with antialiasing, rounded as an
    8-bit resize is."""
    if frames.shape[-2:] == (height, width):
        return frames
    out = F.interpolate(frames, size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return out.round().clamp(0, 255)


def _normalize(frames: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (frames / 255.0 - mean) / std


def _crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    top = int(round((frames.shape[-2] - height) / 2.0))
    left = int(round((frames.shape[-1] - width) / 2.0))
    return frames[..., top:top + height, left:left + width]


def processor_frames(clip: torch.Tensor, crop: int) -> torch.Tensor:
    """``uint8 [T, H, W, 3]`` -> ``float [T, 3, crop, crop]`` as ``VJEPA2VideoProcessor``: the
    shortest edge resized to ``int(crop * 256 / 224)``, the centre ``crop`` square cut."""
    frames = clip.permute(0, 3, 1, 2).float()
    height, width = frames.shape[-2:]
    short = int(crop * 256 / 224)
    if height <= width:
        size = (short, int(short * width / height))
    else:
        size = (int(short * height / width), short)
    return _normalize(_crop(_resize(frames, *size), crop, crop))


def square_crop_frames(clip: torch.Tensor, crop: int) -> torch.Tensor:
    """``uint8 [T, H, W, 3]`` -> ``float [T, 3, crop, crop]`` as the official 2-AC code: the
    largest centred square, resized to ``crop``."""
    frames = clip.permute(0, 3, 1, 2).float()
    side = min(frames.shape[-2:])
    return _normalize(_resize(_crop(frames, side, side), crop, crop))


def latent_payload(arrays: dict[str, torch.Tensor]) -> bytes:
    """Named float32 arrays as one ``.npz`` archive (shapes and dtypes travel with them)."""
    buffer = io.BytesIO()
    np.savez(buffer, **{name: value.to(torch.float32).contiguous().numpy() for name, value in arrays.items()})
    return buffer.getvalue()


class LatentStream(OutputStream):
    """The walk's emitted arrays, in the order ``names`` lists them, -> one ``latent`` event once
    the last has come."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.arrays: dict[str, torch.Tensor] = {}

    @property
    def generated(self) -> int:
        return len(self.arrays)

    def feed(self, modality: str, value: torch.Tensor) -> OutputEvent | None:
        self.arrays[self.names[len(self.arrays)]] = value.detach().cpu()
        if len(self.arrays) < len(self.names):
            return None
        return OutputEvent(modality="latent", data=latent_payload(self.arrays))


def _check_modalities(spec: GenerateSpec, key: str) -> None:
    if list(spec.output_modalities) != ["latent"]:
        raise RequestError("output_modalities", f"model {key!r} outputs [\"latent\"] only")


def _walks(predictor: Node) -> Graph:
    encoder = Node("encoder", "stateless", inputs=("frames",), outputs=("embeddings",))
    encode_step = Step("encoder", reads="frames", writes="embeddings", emit=Emit("embeddings", "latent"))
    encode = Walk("encode", Sequential(encode_step), inputs=("frames",))
    predict = Walk("predict", Sequential(
        Step("encoder", reads="frames", writes="embeddings", emit=Emit("embeddings", "latent")),
        Step("predictor", reads=predictor.inputs, writes="predicted", emit=Emit("predicted", "latent")),
    ), inputs=("frames", *predictor.inputs[1:]))
    return Graph.build([encoder, predictor], [encode, predict])


def _stream(request: WalkRequest) -> LatentStream:
    return LatentStream(("embeddings", "predicted") if request.walk == "predict" else ("embeddings",))


@register
class VJEPA2(ModelSpec):
    key = "vjepa2"
    tasks = frozenset()  # /generate only
    generate_modalities = (frozenset({"image", "video"}), frozenset({"latent"}))
    default_weights = "facebook/vjepa2-vitl-fpc64-256"
    Knobs = VJEPA2Knobs
    knobs: VJEPA2Knobs

    def graph(self) -> Graph:
        return _walks(Node("predictor", "stateless", inputs=("embeddings", "context", "target"),
                           outputs=("predicted",)))

    def checkpoint(self) -> VJEPA2Checkpoint:
        return VJEPA2Checkpoint.locate(self.config.model_path or self.default_weights, self.config.cache_dir)

    def load_frontend(self) -> None:
        self.model_config = self.checkpoint().config()
        encoder = self.model_config.encoder
        self.max_frames = self.knobs.max_frames or encoder.frames_per_clip

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        _check_modalities(spec, self.key)
        options = VJEPA2Request.parse(spec.model_kwargs)
        encoder = self.model_config.encoder
        clip = decode_clip(spec.files, self.max_frames)
        count = len(clip)
        if count != 1 and count % encoder.tubelet_size:
            raise RequestError("files", f"{count} frames: send one frame or a multiple of {encoder.tubelet_size} "
                                        "(frames pair into tubelets)")
        frames = processor_frames(clip, encoder.crop_size)
        tokens = max(1, count // encoder.tubelet_size) * encoder.tokens_per_frame
        masks = options.masks(tokens)
        if masks is None:
            return WalkRequest("encode", {"frames": frames}, {}, prompt_tokens=tokens)
        context, target = (torch.tensor(ids, dtype=torch.int64) for ids in masks)
        return WalkRequest("predict", {"frames": frames, "context": context, "target": target}, {},
                           prompt_tokens=tokens)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return _stream(request)

    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.vjepa2.engine import vjepa2_engines

        model = self.checkpoint().load_model(device, self.config.torch_dtype(),
                                             dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        engines = vjepa2_engines(model, device, self.config.torch_dtype())
        return {name: engine for name, engine in engines.items() if name in nodes}


@register
class VJEPA2AC(ModelSpec):
    key = "vjepa2_ac"
    tasks = frozenset()  # /generate only
    generate_modalities = (frozenset({"image", "video"}), frozenset({"latent"}))
    default_weights = None  # the release is a file on Meta's CDN, not a hub repo (checkpoint.AC_URL)
    Knobs = VJEPA2ACKnobs
    knobs: VJEPA2ACKnobs

    def graph(self) -> Graph:
        return _walks(Node("predictor", "stateless", inputs=("embeddings", "actions", "states", "extrinsics"),
                           outputs=("predicted",)))

    def checkpoint(self) -> VJEPA2ACCheckpoint:
        return VJEPA2ACCheckpoint.locate(self.config.model_path or "vjepa2-ac-vitg", self.config.cache_dir)

    def load_frontend(self) -> None:
        self.model_config = self.checkpoint().config()

    def prepare_generate(self, spec: GenerateSpec) -> WalkRequest:
        _check_modalities(spec, self.key)
        options = VJEPA2ACRequest.parse(spec.model_kwargs)
        encoder, predictor = self.model_config.encoder, self.model_config.predictor
        clip = decode_clip(spec.files, self.knobs.max_frames)
        count = len(clip)
        frames = square_crop_frames(clip, encoder.crop_size)
        tokens = count * encoder.tokens_per_frame
        if not options.check_against(count, predictor.action_dim, predictor.use_extrinsics):
            return WalkRequest("encode", {"frames": frames}, {}, prompt_tokens=tokens)
        width = predictor.action_dim
        extrinsics = options.extrinsics if predictor.use_extrinsics else [[0.0] * (width - 1)] * count
        inputs = {"frames": frames, **{name: torch.tensor(rows, dtype=torch.float32) for name, rows in
                                       (("actions", options.actions), ("states", options.states),
                                        ("extrinsics", extrinsics))}}
        return WalkRequest("predict", inputs, {}, prompt_tokens=tokens)

    def output_stream(self, request: WalkRequest, stop: list[str]) -> OutputStream:
        return _stream(request)

    def build_engines(self, nodes: set[str], device: torch.device):
        from mstar.model.vjepa2.engine import vjepa2_ac_engines

        model = self.checkpoint().load_model(device, self.config.torch_dtype(),
                                             dummy=self.config.load_format == "dummy", seed=self.knobs.seed)
        engines = vjepa2_ac_engines(model, device, self.config.torch_dtype(), self.knobs.normalize_reps)
        return {name: engine for name, engine in engines.items() if name in nodes}
