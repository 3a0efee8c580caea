"""Diffusion sampling utilities (schedulers kept as pure, per-request functions)."""

from mstar.diffusion.flow_match import FlowMatchEuler, empirical_mu

__all__ = ["FlowMatchEuler", "empirical_mu"]
