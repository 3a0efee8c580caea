"""The runtime backend's own guard: a clip for a model that does not clone is refused naming
``ref_audio`` before anything is prepared or scheduled (for callers that skip the HTTP route),
on speech and /generate alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mstar.contract import GenerateSpec, RequestError, SpeechSpec, VoiceClip
from mstar.runtime.backend import RuntimeBackend

CLIP = VoiceClip(b"\0" * 4000, 16000, "hi")


def backend(clones: bool) -> RuntimeBackend:
    prepared = []
    spec = SimpleNamespace(config=SimpleNamespace(model="tts"), tasks=frozenset({"speech"}), max_model_len=0,
                           prepare_speech=prepared.append, prepare_generate=prepared.append, prepared=prepared)
    if clones:
        spec.clones_voices = True
    return RuntimeBackend(spec, runtime=None)  # type: ignore[arg-type]


def test_a_clip_for_a_model_that_does_not_clone_is_refused_at_once():
    plain = backend(clones=False)
    assert not plain.clones_voices and backend(clones=True).clones_voices
    for call in (lambda: plain.speech(SpeechSpec("s", "hi", reference=CLIP)),
                 lambda: plain.generate(GenerateSpec("g", "hi", [], ["audio"], {}, reference=CLIP))):
        with pytest.raises(RequestError) as err:
            call()
        assert err.value.field == "ref_audio" and "does not support voice cloning" in err.value.message
    assert plain.spec.prepared == []
