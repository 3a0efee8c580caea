"""Cosmos3: one packed mixture-of-transformers over text, video latents, sound and actions."""
