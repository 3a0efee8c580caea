"""Where a Cosmos3 checkpoint's parts come from: the diffusers layout ``Cosmos3OmniPipeline``
saves (``model_index.json``, ``transformer/`` (the tower, flat keys: ``layers.N...``,
``embed_tokens``, ``proj_in`` ...), ``text_tokenizer/``, ``vae/`` (the Wan2.2 VAE),
``scheduler/`` (UniPC), and ``sound_tokenizer/`` (the AVAE, weight-norm pairs folded on load) on
sound-capable checkpoints). The 4-step distilled checkpoints list ``distilled_sigmas`` in
``modular_model_index.json`` and a stochastic flow-match Euler scheduler: they get the
fixed-sigma sampler (``mstar.model.cosmos3.sampler``)."""

from __future__ import annotations

from mstar.diffusion.unipc import UniPC
from mstar.model.cosmos3.config import Cosmos3Config
from mstar.model.cosmos3.prompt import Cosmos3Prompt
from mstar.model.cosmos3.sampler import FixedSigmas
from mstar.model.cosmos3.sound_tokenizer import Cosmos3SoundTokenizer, SoundTokenizerConfig
from mstar.model.diffusers_checkpoint import DiffusersCheckpoint
from mstar.model.wan22.vae import WanVAEConfig


class Cosmos3Checkpoint(DiffusersCheckpoint):
    def check_variant(self) -> None:
        """Refuse what this slice cannot serve, naming what gives it away."""
        index = self.read_json("model_index.json")
        if index.get("use_native_flow_schedule"):
            raise ValueError("model_index.json: use_native_flow_schedule is set; only the scheduler's own UniPC "
                             "schedule is served")

    def use_system_prompt(self) -> bool:
        return bool(self.read_json("model_index.json").get("default_use_system_prompt", True))

    def prompt(self) -> Cosmos3Prompt:
        return Cosmos3Prompt.from_directory(self.root, self.use_system_prompt())

    def transformer_config(self) -> Cosmos3Config:
        return Cosmos3Config.from_dict(self.read_json("transformer", "config.json"))

    def vae_config(self) -> WanVAEConfig:
        config = WanVAEConfig.from_dict(self.read_json("vae", "config.json"))
        if not config.residual:
            raise ValueError("vae config: is_residual is false (the Wan2.1 VAE); Cosmos3 uses the Wan2.2 VAE")
        return config

    def distilled_sigmas(self) -> list[float] | None:
        """The fixed schedule of a distilled checkpoint, None for a base one."""
        if not (self.root / "modular_model_index.json").exists():
            return None
        sigmas = self.read_json("modular_model_index.json").get("distilled_sigmas")
        return [float(s) for s in sigmas] if sigmas else None

    def schedule(self) -> UniPC | FixedSigmas:
        config = self.read_json("scheduler", "scheduler_config.json")
        sigmas = self.distilled_sigmas()
        return UniPC.from_config(config) if sigmas is None else FixedSigmas.from_config(config, sigmas)

    # ----------------------------------------------------------------- sound
    def has_sound(self) -> bool:
        """Whether the checkpoint ships the sound pathway: a ``sound_tokenizer/`` folder and a
        tower trained with ``sound_gen``."""
        return (self.root / "sound_tokenizer" / "config.json").exists() and self.transformer_config().sound_gen

    def sound_tokenizer_config(self) -> SoundTokenizerConfig:
        return SoundTokenizerConfig.from_dict(self.read_json("sound_tokenizer", "config.json"))

    def load_sound_tokenizer(self, *, device, dtype, dummy: bool, seed: int, encoder: bool = False
                             ) -> Cosmos3SoundTokenizer:
        """The AVAE with the checkpoint's weights (weight norm folded; coverage checked both
        ways), or seeded random ones when ``dummy``. ``encoder``: build and load the encoder too
        (serving only decodes, so by default its ``encoder.*`` tensors are left unread)."""
        from mstar.model.vocoder.weight_norm import fold_weight_norm
        from mstar.model.weights import building, fill_weights, iter_safetensors

        config = self.sound_tokenizer_config()
        with building(device, dtype):
            module = Cosmos3SoundTokenizer(config, encoder=encoder)

        def tensors():
            state = {k: v for k, v in iter_safetensors(self.root / "sound_tokenizer")
                     if encoder or not k.startswith("encoder.")}
            return fold_weight_norm(state).items()

        return fill_weights(module, tensors, dummy=dummy, seed=seed, dtype=dtype)
