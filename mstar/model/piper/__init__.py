"""Piper voices (VITS, weights read from the voice's ONNX file): see docs/piper.md."""
