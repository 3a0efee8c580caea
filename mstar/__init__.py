"""M*: a serving system for composite multimodal models, built on the Walk Graph."""

__version__ = "0.1.0"


def __getattr__(name):
    # The SDK is imported lazily so that `import mstar` stays light (no httpx, no torch).
    if name == "MStarClient":
        from mstar.client.sdk import MStarClient

        return MStarClient
    raise AttributeError(name)
