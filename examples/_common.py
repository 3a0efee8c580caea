"""Where the examples find the server: ``MSTAR_BASE_URL`` (default http://127.0.0.1:8000),
and which served model they name: ``MSTAR_MODEL`` (default: the script's own family key)."""

import os

BASE_URL = os.environ.get("MSTAR_BASE_URL", "http://127.0.0.1:8000").rstrip("/")


def model_name(default: str) -> str:
    """The model to put in requests: ``MSTAR_MODEL`` when set (another key of the same
    family, say ``flux2_klein_9b``), else the family's usual key."""
    return os.environ.get("MSTAR_MODEL") or default
