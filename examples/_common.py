"""Where the examples find the server: ``MSTAR_BASE_URL`` (default http://127.0.0.1:8000)."""

import os

BASE_URL = os.environ.get("MSTAR_BASE_URL", "http://127.0.0.1:8000").rstrip("/")
