"""T3's tokens as handed to S3Gen, per variant. The English / multilingual cases are the
reference's ``drop_invalid_tokens`` outputs (printed once with chatterbox-tts 0.1.7), then the
English generate's ``< 6561`` filter; Turbo's follow ``tts_turbo.generate``."""

from __future__ import annotations

import pytest

from mstar.model.chatterbox.config import T3Config
from mstar.model.chatterbox.t3_decode import S3GEN_SILENCE, speech_tokens_for_s3gen


@pytest.mark.parametrize("tokens, multilingual, english", [
    ([5, 6561, 7, 8000, 9, 6562], [7, 8000, 9], [7, 9]),
    ([1, 2, 6562], [1, 2], [1, 2]),
    ([3, 6561, 4], [4], [4]),
    ([1, 2], [1, 2], [1, 2]),
])
def test_guided_variants(tokens, multilingual, english):
    assert speech_tokens_for_s3gen(tokens, T3Config.multilingual()) == multilingual
    assert speech_tokens_for_s3gen(tokens, T3Config.english()) == english


def test_turbo_trims_the_stop_drops_control_ids_and_appends_silence():
    silence = [S3GEN_SILENCE] * 3
    assert speech_tokens_for_s3gen([4, 6561, 5, 6562], T3Config.turbo()) == [4, 5, *silence]
    assert speech_tokens_for_s3gen([6562, 4, 6562, 6], T3Config.turbo()) == [4, 6, *silence]
