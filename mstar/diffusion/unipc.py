"""UniPC multistep sampling for flow-matching models, as the Wan pipelines drive diffusers'
``UniPCMultistepScheduler`` (flow sigmas, flow prediction, ``predict_x0``, the ``bh2`` variant),
written as pure functions of a request's state.

The model predicts a velocity ``v``; each step turns it into a clean-sample estimate
``x0 = x - sigma * v`` and advances ``x`` with a predictor that extrapolates from the last
``order`` estimates in log-SNR time (``lambda = log((1 - sigma) / sigma)``). From the second
step on, a corrector first refines the current ``x`` with the new estimate (the "C" of UniPC,
free: it reuses the model call the predictor needs anyway).

The schedule: ``linspace(1, 1/1000, n + 1)[:-1]`` warped by the static ``flow_shift``
(``s * sigma / (1 + (s - 1) * sigma)``), the first sigma nudged below 1, a terminal 0. The
timesteps the DiT sees are ``1000 * sigma`` truncated to integers (diffusers casts them to int64).

A request's solver state is ``UniPCState``: the last ``order`` x0 estimates (newest last) and
the sample the predictor last started from. It is a plain tuple of tensors, so the loop can carry
it between iterations as walk data; ``step`` returns the next latents and the next state and
mutates nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["UniPC", "UniPCState"]

# diffusers options whose non-default values are not implemented (the Wan pipelines use none).
_REQUIRED: dict[str, Any] = {
    "use_flow_sigmas": True, "prediction_type": "flow_prediction", "predict_x0": True, "solver_type": "bh2",
    "timestep_spacing": "linspace", "thresholding": False, "use_dynamic_shifting": False,
    "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
    "shift_terminal": None, "solver_p": None, "final_sigmas_type": "zero",
}


class UniPCState(NamedTuple):
    """``x0``: the recent clean-sample estimates, oldest first (at most ``order``);
    ``last_sample``: the sample the previous predictor step started from (None before step 0)."""

    x0: tuple[torch.Tensor, ...] = ()
    last_sample: torch.Tensor | None = None


@dataclass(frozen=True)
class UniPC:
    num_train_timesteps: int = 1000
    flow_shift: float = 5.0  # Wan2.2-TI2V-5B's scheduler_config.json
    solver_order: int = 2
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> UniPC:
        """Build from a diffusers ``scheduler_config.json`` dict; an option we do not implement
        raises, naming it."""
        for key, want in _REQUIRED.items():
            if key in config and config[key] != want and not (want is None and not config[key]):
                raise ValueError(f"UniPC scheduler option {key}={config[key]!r} is not supported (need {want!r})")
        return cls(num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
                   flow_shift=float(config.get("flow_shift", 1.0)), solver_order=int(config.get("solver_order", 2)),
                   lower_order_final=bool(config.get("lower_order_final", True)),
                   disable_corrector=tuple(config.get("disable_corrector", ())))

    def timesteps(self, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sigmas [num_steps + 1] float32, timesteps [num_steps] int64)`` of one request."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        n = self.num_train_timesteps
        sigmas = np.linspace(1, 1 / n, num_steps + 1)[:-1]
        sigmas = self.flow_shift * sigmas / (1 + (self.flow_shift - 1) * sigmas)
        if abs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6
        timesteps = torch.from_numpy((sigmas * n).astype(np.int64))
        return torch.from_numpy(np.concatenate([sigmas, [0.0]]).astype(np.float32)), timesteps

    def order(self, index: int, num_steps: int) -> int:
        """The predictor's order at step ``index``: warming up from 1, and lowered at the end."""
        order = min(self.solver_order, num_steps - index) if self.lower_order_final else self.solver_order
        return min(order, index + 1)

    def step(self, index: int, sigmas: torch.Tensor, velocity: torch.Tensor, sample: torch.Tensor,
             state: UniPCState) -> tuple[torch.Tensor, UniPCState]:
        """Step ``index`` of the schedule ``sigmas``: ``(next sample, next state)``. ``velocity``
        and ``sample`` may carry a batch of requests at the same step of the same schedule."""
        num_steps = len(sigmas) - 1
        x0 = sample - sigmas[index] * velocity
        if index > 0 and (index - 1) not in self.disable_corrector and state.last_sample is not None:
            sample = self._update(sigmas, index - 1, index, state.x0, state.last_sample,
                                  self.order(index - 1, num_steps), corrector=x0)
        history = (*state.x0, x0)[-self.solver_order:]
        prev = self._update(sigmas, index, index + 1, history, sample, self.order(index, num_steps))
        return prev, UniPCState(history, sample)

    @staticmethod
    def _update(sigmas: torch.Tensor, s: int, t: int, history: tuple[torch.Tensor, ...], x: torch.Tensor,
                order: int, corrector: torch.Tensor | None = None) -> torch.Tensor:
        """The UniPC-bh2 move from sigma ``s`` to sigma ``t`` (``t = s + 1``) from the estimates
        ``history`` (newest last, at sigma ``s``): the predictor, or with ``corrector`` (the new
        estimate at ``t``) the corrector. Scalars in float32, in diffusers' order of operations,
        computed where ``sigmas`` live (the host): a 0-dim host tensor enters a GPU op as a
        plain value, so a step makes no host-device copy and never waits for the GPU."""

        def log_snr(i: int) -> torch.Tensor:
            return torch.log(1 - sigmas[i]) - torch.log(sigmas[i])

        alpha_t, sigma_t, sigma_s = 1 - sigmas[t], sigmas[t], sigmas[s]
        lambda_s = log_snr(s)
        h = log_snr(t) - lambda_s
        m0 = history[-1]
        rks, d1s = [], []
        for i in range(1, order):
            rk = (log_snr(s - i) - lambda_s) / h
            rks.append(rk)
            d1s.append((history[-(i + 1)] - m0) / rk)
        rks.append(torch.ones((), dtype=sigmas.dtype))
        rks = torch.stack(rks)
        hh = -h
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        b_h = torch.expm1(hh)
        factorial = 1
        rows, b = [], []
        for i in range(1, order + 1):
            rows.append(torch.pow(rks, i - 1))
            b.append(h_phi_k * factorial / b_h)
            factorial *= i + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        r, b = torch.stack(rows), torch.stack(b)
        x_t = sigma_t / sigma_s * x - alpha_t * h_phi_1 * m0
        if corrector is None:
            if not d1s:
                return (x_t - alpha_t * b_h * 0).to(x.dtype)
            rhos = torch.full((1,), 0.5, dtype=sigmas.dtype) if order == 2 else torch.linalg.solve(r[:-1, :-1], b[:-1])
            return (x_t - alpha_t * b_h * _weighted(rhos, d1s)).to(x.dtype)
        rhos = torch.full((1,), 0.5, dtype=sigmas.dtype) if order == 1 else torch.linalg.solve(r, b)
        res = _weighted(rhos[:-1], d1s) if d1s else 0
        return (x_t - alpha_t * b_h * (res + rhos[-1] * (corrector - m0))).to(x.dtype)


def _weighted(weights: torch.Tensor, terms: list[torch.Tensor]) -> torch.Tensor:
    """``sum_k weights[k] * terms[k]`` with the weights (host scalars) as plain values."""
    out = weights[0] * terms[0]
    for weight, term in zip(weights[1:], terms[1:]):
        out = out + weight * term
    return out
