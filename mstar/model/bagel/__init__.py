"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT): one mixture-of-transformers Qwen2 LLM that reads
images (a SigLIP NaViT tower) and text, and generates images by flow matching over a FLUX
VAE's latents. See ``docs/bagel.md``."""
