"""Fish Audio S2-Pro: a dual-AR text-to-speech model (slow AR over text and frames, fast
AR over a frame's codebooks) with a 44.1 kHz causal DAC codec."""
