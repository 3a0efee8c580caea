"""Speech front ends shared by the voice-cloning TTS families: what a reference clip at 16 kHz
becomes before a model conditions on it.

- ``S3Tokenizer``: S3 speech tokens (25 a second, 6561 codes; v2 for CosyVoice2 and
  Chatterbox's S3Gen, ``S3TokenizerConfig.v3()`` for CosyVoice3);
- ``CampPlus``: the CAM++ speaker x-vector (192-d) on Kaldi fbank (``kaldi_fbank``);
- ``VoiceEncoder``: Chatterbox's LSTM speaker embedding (256-d, L2-normalised).

Each takes a list of mono 16 kHz clips (``[num_samples]`` tensors); resample first with
``mstar.audio.io.resample``. The modules know nothing of any family's graph; the name maps
load them from the released checkpoints with coverage checked both ways.
"""

from mstar.model.speech_front.campplus import CampPlus, CampPlusConfig, campplus_name_map
from mstar.model.speech_front.fbank import kaldi_fbank, kaldi_mel_banks
from mstar.model.speech_front.s3_tokenizer import (
    S3Encoder,
    S3Tokenizer,
    S3TokenizerConfig,
    log_mel,
    pad_mels,
    s3_tokenizer_name_map,
)
from mstar.model.speech_front.voice_encoder import (
    VoiceEncoder,
    VoiceEncoderConfig,
    mel_power,
    partial_windows,
    trim_silence,
    voice_encoder_name_map,
)

__all__ = [
    "CampPlus",
    "CampPlusConfig",
    "S3Encoder",
    "S3Tokenizer",
    "S3TokenizerConfig",
    "VoiceEncoder",
    "VoiceEncoderConfig",
    "campplus_name_map",
    "kaldi_fbank",
    "kaldi_mel_banks",
    "log_mel",
    "mel_power",
    "pad_mels",
    "partial_windows",
    "s3_tokenizer_name_map",
    "trim_silence",
    "voice_encoder_name_map",
]
