"""Configuration of Canary-Qwen, read from the released NeMo ``SALM`` ``config.json``: the
speech side from ``perception`` (the FastConformer ``encoder``, the ``modality_adapter``, a
projection to the LLM's width, the mel ``preprocessor``), the LLM named by ``pretrained_llm``
(its own ``config.json``), the LoRA settings (``lora``), the prompt format and the audio
locator tag. A setting this port does not implement is refused naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mstar.model.fastconformer.config import FastConformerConfig
from mstar.model.fastconformer.features import MelSettings
from mstar.model.qwen3.config import Qwen3Config


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA adapters of the LLM (PEFT's ``LoraConfig``): merged at load as
    ``W + alpha / r * B @ A`` (``alpha / sqrt(r)`` with ``use_rslora``)."""

    r: int
    alpha: float
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (self.r ** 0.5 if self.use_rslora else self.r)

    @classmethod
    def from_nemo(cls, d: dict[str, Any]) -> LoraSettings:
        for name, allowed in {"bias": ("none", None), "use_dora": (False, None)}.items():
            if d.get(name) not in allowed:
                raise NotImplementedError(f"lora.{name}: {d.get(name)!r} is not supported (merged adapters only)")
        if d.get("rank_pattern") or d.get("alpha_pattern"):
            raise NotImplementedError("lora.rank_pattern / alpha_pattern: per-module ranks are not supported")
        r = int(d.get("r", 8))
        return cls(r=r, alpha=float(d.get("lora_alpha", 8)), use_rslora=bool(d.get("use_rslora", False)))


def mel_from_nemo(d: dict[str, Any]) -> MelSettings:
    """The front end of NeMo's ``AudioToMelSpectrogramPreprocessor`` section."""
    for name, allowed in {"normalize": ("per_feature",), "window": ("hann", None), "log": (True, None),
                          "frame_splicing": (1, None), "mag_power": (2.0, 2, None),
                          "log_zero_guard_type": ("add", None)}.items():
        if d.get(name, allowed[0]) not in allowed:
            raise NotImplementedError(f"perception.preprocessor.{name}: {d.get(name)!r} is not supported")
    rate = int(d.get("sample_rate", 16000))
    return MelSettings(n_mels=int(d.get("features", 128)), sample_rate=rate, n_fft=int(d.get("n_fft", 512)),
                       hop_length=int(round(float(d.get("window_stride", 0.01)) * rate)),
                       win_length=int(round(float(d.get("window_size", 0.025)) * rate)),
                       preemphasis=d.get("preemph", 0.97), normalize=True)


@dataclass
class CanaryQwenConfig:
    encoder: FastConformerConfig
    adapter: FastConformerConfig
    llm: Qwen3Config
    lora: LoraSettings | None
    mel: MelSettings
    audio_locator_tag: str = "<|audioplaceholder|>"
    pretrained_llm: str = "Qwen/Qwen3-1.7B"

    def __post_init__(self) -> None:
        if self.adapter.subsampling_factor != 1:
            raise NotImplementedError("perception.modality_adapter.subsampling_factor: only 1 is supported")
        if self.adapter.num_mel_bins != self.encoder.hidden_size:
            raise ValueError(f"perception.modality_adapter.feat_in ({self.adapter.num_mel_bins}) is not the "
                             f"encoder's d_model ({self.encoder.hidden_size})")
        if self.mel.n_mels != self.encoder.num_mel_bins:
            raise ValueError(f"perception.preprocessor.features ({self.mel.n_mels}) is not the encoder's feat_in "
                             f"({self.encoder.num_mel_bins})")

    def frames(self, mel_frames: int) -> int:
        """Audio embeddings (LLM positions) of ``mel_frames`` log-mel frames."""
        return self.encoder.frames(mel_frames)

    @classmethod
    def from_nemo(cls, d: dict[str, Any], llm: dict[str, Any]) -> CanaryQwenConfig:
        """From the SALM ``config.json`` ``d`` and the LLM's Hugging Face ``config.json``."""
        if d.get("prompt_format", "qwen") != "qwen":
            raise NotImplementedError(f"prompt_format: {d.get('prompt_format')!r} (only 'qwen' is supported)")
        if llm.get("model_type") != "qwen3":
            raise NotImplementedError(f"pretrained_llm: model_type {llm.get('model_type')!r} (expected 'qwen3')")
        perception = d.get("perception") or {}
        adapter = perception.get("modality_adapter") or {}
        llm_config = Qwen3Config.from_hf_dict(llm)
        output_dim = perception.get("output_dim", llm_config.hidden_size)
        if int(output_dim) != llm_config.hidden_size:
            raise ValueError(f"perception.output_dim ({output_dim}) is not the LLM's hidden_size "
                             f"({llm_config.hidden_size})")
        if "output_dim" in adapter or "d_model" not in adapter:
            raise NotImplementedError("perception.modality_adapter: expected a ConformerEncoder section with "
                                      "d_model and no output_dim (projected by perception.proj)")
        return cls(encoder=FastConformerConfig.from_nemo(perception.get("encoder") or {}, key="perception.encoder"),
                   adapter=FastConformerConfig.from_nemo(adapter, key="perception.modality_adapter"),
                   llm=llm_config, lora=LoraSettings.from_nemo(d["lora"]) if d.get("lora") else None,
                   mel=mel_from_nemo(perception.get("preprocessor") or {}),
                   audio_locator_tag=d.get("audio_locator_tag", "<|audioplaceholder|>"),
                   pretrained_llm=d.get("pretrained_llm", "Qwen/Qwen3-1.7B"))
