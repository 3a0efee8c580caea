"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT): one Qwen2 mixture-of-transformers LLM that reads text and
images (SigLIP) and generates and edits images by flow matching over FLUX.1 VAE latents."""
