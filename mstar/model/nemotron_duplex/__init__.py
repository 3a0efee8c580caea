"""Nemotron VoiceChat (``nemotron_duplex``): full-duplex speech, the user's audio a client
stream into a streamed FastConformer encoder and a frame-synchronous Nemotron-H decode."""
