"""Stochastic samplers that record each step's log-probability: the rollout side of issue 29.

A policy-gradient trainer (Flow-GRPO, DDPO) needs, for every denoising step of a sampled image, the
log-density of the step it actually took under the Gaussian transition the model defines. These
schedulers are diffusers' own (subclasses, built from the model's scheduler config like every other
name in ``diffusers_pipeline``) with ``step`` replaced by the papers' stochastic step, which also
appends a ``StepRecord`` per step to ``records``. Noise comes from the batch's per-request
generators (the same ones that drew the initial latents), so an output depends on its seed alone,
never on the batch it shared.

Conventions, both papers': the log-probability is the Gaussian log-density of ``x_{t-1}`` under
``N(mean, std^2)`` *averaged* (not summed) over every dimension but the batch one, computed in float32
on ``x_{t-1}`` as it is kept: drawn in float32, cast to the latents' dtype (what the next step and the
trajectory get), then read back as float32. On a bf16/fp16 model the density of the unrounded draw
would be of a point the run never visited, off by ~1e-3 per step at the schedule's end.

``DiffusersPipeline.last_rollout`` keeps the last run's ``Trajectory`` (the hook tests read in
process); ``trajectories.py`` turns it, with the latents, into the arrays a request's output carries.
Log-probs stay on the device until the run ends, so no step waits for one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_ddim import DDIMSchedulerOutput
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput
from diffusers.utils.torch_utils import randn_tensor

NOISE_LEVEL_DEFAULT = 0.7  # Flow-GRPO's default ``noise_level`` (``a`` in the paper)
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class StepRecord:
    """One denoising step: ``timestep`` as the scheduler names it, ``sigma``/``sigma_next`` the
    schedule's noise level before and after (flow: sigma_t; DDIM: sqrt((1 - abar_t) / abar_t)),
    ``std`` the transition's standard deviation and ``log_prob`` one value per batch item (float32,
    CPU). ``sample``/``prev_sample``/``model_output`` are kept only with ``record_latents`` (tests:
    they let a log-prob be recomputed outside the scheduler)."""

    timestep: float
    sigma: float
    sigma_next: float
    std: float
    log_prob: torch.Tensor
    sample: torch.Tensor | None = None
    prev_sample: torch.Tensor | None = None
    model_output: torch.Tensor | None = None


@dataclass
class Trajectory:
    """A run's records: ``log_probs`` is (batch, steps); ``timesteps`` and ``sigmas`` per step (the
    sigmas of step k and, last, the one the final step lands on). ``item(k)`` is request k's share."""

    log_probs: torch.Tensor
    timesteps: list[float]
    sigmas: list[float]
    steps: list[StepRecord] = field(default_factory=list)

    def item(self, k: int) -> dict[str, Any]:
        return {"log_probs": self.log_probs[k].tolist(), "timesteps": list(self.timesteps), "sigmas": list(self.sigmas)}


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """log N(x; mean, std^2) per element, averaged over all dims but the first (the papers' convention)."""
    std_t = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    lp = -((x - mean) ** 2) / (2 * std_t**2) - torch.log(std_t) - _LOG_SQRT_2PI
    return lp.mean(dim=tuple(range(1, lp.ndim)))


class _Recording:
    """What both schedulers share: the run's generators, its noise parameter, its records."""

    records: list[StepRecord]
    _generators: list[torch.Generator] | None
    record_latents: bool
    first_sample: torch.Tensor | None = None  # the latents the run's first step started from

    def begin(self, generators: Sequence[torch.Generator], level: float | None, *,
              record_latents: bool = False) -> None:
        """Called by the pipeline wrapper before each run (the scheduler object is reused across runs)."""
        self._generators = list(generators)
        self.records = []
        self.record_latents = record_latents
        self.first_sample = None
        self._set_level(level)

    def _set_level(self, level: float | None) -> None:
        raise NotImplementedError

    def trajectory(self) -> Trajectory | None:
        """The last run's records, or None when it took no stochastic step (DDIM with eta 0)."""
        recs = getattr(self, "records", [])
        if not recs:
            return None
        return Trajectory(log_probs=torch.stack([r.log_prob for r in recs], dim=1),
                          timesteps=[r.timestep for r in recs],
                          sigmas=[r.sigma for r in recs] + [recs[-1].sigma_next], steps=list(recs))

    def _noise(self, like: torch.Tensor, generator: Any) -> torch.Tensor:
        gens = getattr(self, "_generators", None) or generator
        return randn_tensor(like.shape, generator=gens, device=like.device, dtype=torch.float32)

    def _record(self, timestep: Any, sigma: float, sigma_next: float, std: float, log_prob: torch.Tensor,
                sample: torch.Tensor, prev: torch.Tensor, model_output: torch.Tensor) -> None:
        keep = getattr(self, "record_latents", False)
        if self.first_sample is None:
            self.first_sample = sample
        if not hasattr(self, "records"):  # stepped without begin() (used on its own, outside the pipeline)
            self.records = []
        self.records.append(StepRecord(
            timestep=float(timestep), sigma=sigma, sigma_next=sigma_next, std=std, log_prob=log_prob.detach(),
            sample=sample.detach().cpu().clone() if keep else None,
            prev_sample=prev.detach().cpu().clone() if keep else None,
            model_output=model_output.detach().cpu().clone() if keep else None))


def flow_sde_mean_std(sample: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float,
                      sigma_max: float, noise_level: float) -> tuple[torch.Tensor, float]:
    """Flow-GRPO's reverse-SDE transition (``sde_step_with_logprob``, sde_type 'sde', in
    github.com/yifan123/flow_grpo, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py): its mean and the
    std of ``x_{t-1}``. ``std_dev_t = a * sqrt(sigma / (1 - sigma))`` with the denominator's sigma
    replaced by ``sigma_max`` (the schedule's second sigma) where sigma is 1, as Flow-GRPO does, so
    the first step of a schedule starting at pure noise is finite; the step's std is
    ``std_dev_t * sqrt(-dt)``. As ``a -> 0`` the mean becomes the Euler (ODE) step ``x + v dt``."""
    dt = sigma_next - sigma
    std_dev_t = noise_level * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
    mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + velocity * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    return mean, std_dev_t * math.sqrt(-dt)


class FlowSDEScheduler(_Recording, FlowMatchEulerDiscreteScheduler):
    """``flow-sde``: Flow-GRPO's stochastic step for flow-matching models (SD3, Flux, Wan), with the
    model's own sigma schedule (shift, dynamic shifting) from ``FlowMatchEulerDiscreteScheduler``."""

    noise_level: float = NOISE_LEVEL_DEFAULT

    def _set_level(self, level: float | None) -> None:
        self.noise_level = NOISE_LEVEL_DEFAULT if level is None else float(level)

    def step(self, model_output: torch.Tensor, timestep: Any, sample: torch.Tensor, *args: Any,
             generator: Any = None, return_dict: bool = True, **kwargs: Any) -> Any:
        if self.step_index is None:
            self._init_step_index(timestep)
        i = self.step_index
        sigma, sigma_next = float(self.sigmas[i]), float(self.sigmas[i + 1])
        sigma_max = float(self.sigmas[1]) if len(self.sigmas) > 1 else sigma_next
        x, v = sample.float(), model_output.float()  # bf16 overflows in the mean (Flow-GRPO's note)
        mean, std = flow_sde_mean_std(x, v, sigma, sigma_next, sigma_max, self.noise_level)
        prev = (mean + std * self._noise(x, generator)).to(sample.dtype)  # what the next step is given
        self._record(timestep.flatten()[0] if torch.is_tensor(timestep) else timestep, sigma, sigma_next, std,
                     gaussian_log_prob(prev.float(), mean, std), x, prev, v)
        self._step_index += 1
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev) if return_dict else (prev,)


def ddim_mean_std(sched: DDIMScheduler, model_output: torch.Tensor, timestep: int, sample: torch.Tensor,
                  eta: float) -> tuple[torch.Tensor, float, float, float]:
    """DDPO's ``ddim_step_with_logprob`` (github.com/kvablack/ddpo-pytorch,
    ddpo_pytorch/diffusers_patch/ddim_with_logprob.py), DDIM paper eqs. 12 and 16: the mean and std of
    ``x_{t-1}`` and the schedule sigmas before and after. As in DDPO the previous timestep is clamped
    at 0 (so the last step lands on ``alphas_cumprod[0]``, not on ``final_alpha_cumprod``): that keeps
    its variance, and so its log-prob, finite for configs with ``set_alpha_to_one``."""
    cfg = sched.config
    assert sched.num_inference_steps is not None
    prev_t = max(timestep - cfg.num_train_timesteps // sched.num_inference_steps, 0)
    a_t = float(sched.alphas_cumprod[timestep])
    a_prev = float(sched.alphas_cumprod[prev_t])
    b_t = 1 - a_t
    if cfg.prediction_type == "epsilon":
        x0, eps = (sample - b_t**0.5 * model_output) / a_t**0.5, model_output
    elif cfg.prediction_type == "sample":
        x0 = model_output
        eps = (sample - a_t**0.5 * x0) / b_t**0.5
    elif cfg.prediction_type == "v_prediction":
        x0 = a_t**0.5 * sample - b_t**0.5 * model_output
        eps = a_t**0.5 * model_output + b_t**0.5 * sample
    else:
        raise ValueError(f"prediction_type {cfg.prediction_type!r} is not epsilon, sample or v_prediction")
    if cfg.thresholding:
        x0 = sched._threshold_sample(x0)
    elif cfg.clip_sample:
        x0 = x0.clamp(-cfg.clip_sample_range, cfg.clip_sample_range)
    variance = ((1 - a_prev) / b_t) * (1 - a_t / a_prev)
    std = eta * variance**0.5
    mean = a_prev**0.5 * x0 + max(1 - a_prev - std**2, 0.0) ** 0.5 * eps
    return mean, std, (b_t / a_t) ** 0.5, ((1 - a_prev) / a_prev) ** 0.5


class RolloutDDIMScheduler(_Recording, DDIMScheduler):
    """``ddim``: diffusers' DDIM as before with ``eta`` 0 (deterministic, nothing recorded, the same
    outputs as plain ``DDIMScheduler``); with ``eta`` > 0 DDPO's stochastic step with its log-prob."""

    eta: float = 0.0

    def _set_level(self, level: float | None) -> None:
        self.eta = 0.0 if level is None else float(level)

    def step(self, model_output: torch.Tensor, timestep: Any, sample: torch.Tensor, eta: float = 0.0,
             use_clipped_model_output: bool = False, generator: Any = None, variance_noise: Any = None,
             return_dict: bool = True) -> Any:
        if self.eta <= 0:  # the request's eta, set by begin(); the pipeline's own eta argument is not used
            return super().step(model_output, timestep, sample, eta=0.0,
                                use_clipped_model_output=use_clipped_model_output, generator=generator,
                                variance_noise=variance_noise, return_dict=return_dict)
        t = int(timestep)
        x, out = sample.float(), model_output.float()
        mean, std, sigma, sigma_next = ddim_mean_std(self, out, t, x, self.eta)
        prev = (mean + std * self._noise(x, generator)).to(sample.dtype)  # what the next step is given
        # A step onto its own timestep (t = 0 of a 'leading' schedule) has no variance: it is deterministic,
        # and a deterministic step adds nothing to a trajectory's log-prob (0, where DDPO's formula gives NaN).
        lp = gaussian_log_prob(prev.float(), mean, std) if std > 0 else torch.zeros(x.shape[0], device=x.device)
        self._record(t, sigma, sigma_next, std, lp, x, prev, out)
        return DDIMSchedulerOutput(prev_sample=prev, pred_original_sample=None) if return_dict else (prev,)
