"""Issue 29, first slice: the stochastic samplers with per-step log-probabilities (flow-sde, ddim+eta).

In process on CPU: a tiny FLUX (tests/fluxkit.py) for flow-sde, ``tiny`` (SD 1.5 classes) for DDIM.
The log-probs are recomputed here from the latents each step recorded, with the papers' formulas
written out again (not by calling the scheduler's helpers), so a slip in either shows up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from fluxkit import build_flux
from hypothesis import given, settings
from hypothesis import strategies as st

from diffusiond.daemon.core.jobs import JobRequest
from diffusiond.ipc.messages import BatchParams, RequestSpec
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.rollout_schedulers import FlowSDEScheduler, Trajectory, flow_sde_mean_std

FLOW = BatchParams(width=64, height=64, steps=3, guidance=3.5, scheduler="flow-sde")
DDIM = BatchParams(width=64, height=64, steps=3, guidance=5.0, scheduler="ddim", eta=1.0)
LOG_PROB_TOL = 1e-4  # float32 recomputation of a mean of ~1e3 terms of order 1


def req(seed: int, prompt: str = "a red fox") -> RequestSpec:
    return RequestSpec(request_id=f"r{seed}-{prompt}", prompt=prompt, seed=seed)


def run(pipe: DiffusersPipeline, requests: Sequence[RequestSpec], params: BatchParams) -> list[torch.Tensor]:
    return pipe.run(params, requests, lambda _s, _t: True)


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> DiffusersPipeline:
    pipe = load_pipeline(str(build_flux(tmp_path_factory.mktemp("flux") / "flux")))
    assert isinstance(pipe, DiffusersPipeline) and pipe.capabilities.flow_scheduler
    return pipe


@pytest.fixture(scope="module")
def tiny(model_cache: Path) -> DiffusersPipeline:
    pipe = load_pipeline("tiny")
    assert isinstance(pipe, DiffusersPipeline)
    return pipe


def recorded(pipe: DiffusersPipeline, requests: Sequence[RequestSpec], params: BatchParams) -> Trajectory:
    pipe.record_latents = True
    try:
        run(pipe, requests, params)
    finally:
        pipe.record_latents = False
    traj = pipe.last_rollout
    assert isinstance(traj, Trajectory) and traj.log_probs.shape == (len(requests), params.steps)
    return traj


def normal_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    lp = -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(1)


def test_flow_sde_tends_to_the_euler_step_as_noise_level_goes_to_0() -> None:
    """(a) the SDE's mean is Euler's x + v dt plus terms in a^2, and its std is a times a constant."""
    x, v = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(0)), torch.randn(2, 16, 8)
    euler = x + v * (0.6 - 0.8)
    for a, tol in ((1e-1, 1e-2), (1e-3, 1e-6)):
        mean, std = flow_sde_mean_std(x, v, 0.8, 0.6, 0.9, a)
        assert (mean - euler).abs().max().item() < tol * 10 and std < a * 2
    sde = FlowSDEScheduler()
    sde.set_timesteps(4)
    sde.begin([torch.Generator().manual_seed(k) for k in range(2)], 1e-6)
    from diffusers import FlowMatchEulerDiscreteScheduler

    ode = FlowMatchEulerDiscreteScheduler()
    ode.set_timesteps(4)
    for t in sde.timesteps:
        a, b = sde.step(v, t, x, return_dict=False)[0], ode.step(v, t, x, return_dict=False)[0]
        assert torch.allclose(a, b, atol=1e-5)


def test_flow_sde_with_a_tiny_noise_level_makes_the_flow_match_image(flux: DiffusersPipeline) -> None:
    ode = run(flux, [req(3)], msgspec_replace(FLOW, scheduler="flow-match"))[0]
    near = run(flux, [req(3)], msgspec_replace(FLOW, noise_level=1e-6))[0]
    far = run(flux, [req(3)], FLOW)[0]
    assert (near - ode).abs().max().item() < 1e-3 < (far - ode).abs().max().item()


def msgspec_replace(params: BatchParams, **changes: object) -> BatchParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)


def test_flow_sde_log_probs_recomputed_from_the_recorded_latents(flux: DiffusersPipeline) -> None:
    """(b) Flow-GRPO's sde_step_with_logprob, written out: std_dev_t = a sqrt(s / (1 - s')) where s'
    is s but sigma_max (the second sigma) at s = 1; mean from x and v; N(mean, (std_dev_t sqrt(-dt))^2)."""
    a = 0.9
    traj = recorded(flux, [req(1), req(2)], msgspec_replace(FLOW, noise_level=a))
    sigma_max = traj.sigmas[1]
    assert traj.sigmas[0] == 1.0 and traj.sigmas[-1] == 0.0 and len(traj.sigmas) == FLOW.steps + 1
    for k, step in enumerate(traj.steps):
        s, s_next = traj.sigmas[k], traj.sigmas[k + 1]
        assert (step.sigma, step.sigma_next) == (s, s_next)
        assert step.sample is not None and step.prev_sample is not None and step.model_output is not None
        dt = s_next - s
        std_dev_t = a * math.sqrt(s / (1 - (sigma_max if s == 1 else s)))
        x, v = step.sample, step.model_output
        mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        mine = normal_log_prob(step.prev_sample, mean, std_dev_t * math.sqrt(-dt))
        assert torch.allclose(mine, traj.log_probs[:, k], atol=LOG_PROB_TOL), (k, mine, traj.log_probs[:, k])
        if k + 1 < len(traj.steps):  # the next step starts where this one landed
            nxt = traj.steps[k + 1].sample
            assert nxt is not None and torch.equal(nxt, step.prev_sample)


def test_ddim_eta_log_probs_recomputed_from_the_recorded_latents(tiny: DiffusersPipeline) -> None:
    """(b) DDPO's ddim_step_with_logprob, written out (epsilon prediction, as tiny's config has it)."""
    traj = recorded(tiny, [req(1), req(2)], DDIM)
    sched = tiny.pipe.scheduler
    abar = sched.alphas_cumprod
    stride = sched.config.num_train_timesteps // DDIM.steps
    for k, step in enumerate(traj.steps):
        t = int(traj.timesteps[k])
        a_t, a_prev = float(abar[t]), float(abar[max(t - stride, 0)])
        x, eps = step.sample, step.model_output
        assert x is not None and eps is not None and step.prev_sample is not None
        x0 = (x - (1 - a_t) ** 0.5 * eps) / a_t**0.5
        if sched.config.clip_sample:  # DDIM's default, which a config made for another scheduler keeps
            x0 = x0.clamp(-sched.config.clip_sample_range, sched.config.clip_sample_range)
        std = DDIM.eta * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)) ** 0.5  # type: ignore[operator]
        mean = a_prev**0.5 * x0 + (1 - a_prev - std**2) ** 0.5 * eps
        mine = normal_log_prob(step.prev_sample, mean, std)
        assert std > 0 and torch.allclose(mine, traj.log_probs[:, k], atol=LOG_PROB_TOL), (k, mine)


@pytest.mark.parametrize("which", ["flow", "ddim"])
def test_same_seed_same_rollout_and_other_seeds_differ(flux: DiffusersPipeline, tiny: DiffusersPipeline,
                                                       which: str) -> None:
    """(c) the noise of every step comes from the request's seed."""
    pipe, params = (flux, FLOW) if which == "flow" else (tiny, DDIM)
    first = run(pipe, [req(7)], params)[0]
    lp = pipe.last_rollout.log_probs.clone()
    again = run(pipe, [req(7)], params)[0]
    assert torch.equal(first, again) and torch.equal(lp, pipe.last_rollout.log_probs)
    other = run(pipe, [req(8)], params)[0]
    assert not torch.allclose(first, other, atol=1e-3)


@pytest.mark.parametrize("which", ["flow", "ddim"])
def test_a_request_rolls_out_the_same_alone_or_in_a_batch(flux: DiffusersPipeline, tiny: DiffusersPipeline,
                                                          which: str) -> None:
    """(d) per-request generators: item 1 of a batch of 2 is the request alone, up to float rounding
    (CPU kernels sum in another order per batch size, see test_pipelines)."""
    pipe, params = (flux, FLOW) if which == "flow" else (tiny, DDIM)
    alone = run(pipe, [req(42)], params)[0]
    lp_alone = pipe.last_rollout.log_probs[0].clone()
    batched = run(pipe, [req(5, "another"), req(42)], params)[1]
    assert (alone - batched).abs().max().item() < 1e-3
    assert torch.allclose(lp_alone, pipe.last_rollout.log_probs[1], atol=1e-4)
    assert pipe.last_rollout.item(1)["timesteps"] == pipe.last_rollout.timesteps


def test_ddim_without_eta_is_plain_ddim_and_records_nothing(tiny: DiffusersPipeline) -> None:
    from diffusers import DDIMScheduler

    params = msgspec_replace(DDIM, eta=None)
    ours = run(tiny, [req(4)], params)[0]
    assert tiny.last_rollout is None
    mine = tiny.pipe.scheduler
    plain = DDIMScheduler.from_config(mine.config)
    try:
        tiny.pipe.scheduler = plain
        out = tiny.pipe(prompt=["a red fox"], height=64, width=64, num_inference_steps=3, guidance_scale=5.0,
                        generator=[torch.Generator().manual_seed(4)], output_type="pt", return_dict=False)[0]
    finally:
        tiny.pipe.scheduler = mine
    assert torch.equal(ours, out[0])


# admission: the fields, checked before a job exists ---------------------------------------------


class _Model:
    def __init__(self, flow: bool) -> None:
        from diffusiond.ipc.messages import Capabilities

        self.name = "flowy" if flow else "sdish"
        self.capabilities = Capabilities(width=64, height=64, steps=2, flow_scheduler=flow)


def admit(flow: bool, **fields: object) -> JobRequest:
    from diffusiond.daemon.config import Limits
    from diffusiond.daemon.edge.requests import check

    return check({"prompt": "x", "n": 1, **fields}, Limits(), _Model(flow))


def test_noise_level_and_eta_reach_the_batch_params() -> None:
    job = admit(True, scheduler="flow-sde", noise_level=1.2)
    assert job.batch_params().noise_level == 1.2 and job.batch_params().eta is None
    job = admit(False, scheduler="ddim", eta=0.5)
    assert job.batch_params().eta == 0.5
    # eta 0 is plain DDIM: it batches with requests that leave eta out
    assert admit(False, scheduler="ddim", eta=0).batch_params() == admit(False, scheduler="ddim").batch_params()


@pytest.mark.parametrize(("flow", "fields", "field", "words"), [
    (True, {"scheduler": "flow-match", "noise_level": 0.7}, "noise_level", "only to scheduler 'flow-sde'"),
    (True, {"noise_level": 0.7}, "noise_level", "the model's default"),
    (True, {"scheduler": "flow-sde", "noise_level": 0}, "noise_level", "above 0"),
    (True, {"scheduler": "flow-sde", "noise_level": 2.5}, "noise_level", "at most 2"),
    (True, {"scheduler": "flow-sde", "noise_level": math.nan}, "noise_level", "nan"),
    (True, {"scheduler": "flow-sde", "eta": 0.5}, "eta", "only to scheduler 'ddim'"),
    (False, {"scheduler": "euler", "eta": 0.5}, "eta", "only to scheduler 'ddim'"),
    (False, {"scheduler": "ddim", "eta": 1.5}, "eta", "between 0 and 1"),
    (False, {"scheduler": "ddim", "eta": -0.1}, "eta", "between 0 and 1"),
    (False, {"scheduler": "ddim", "eta": math.inf}, "eta", "inf"),
    (False, {"scheduler": "flow-sde"}, "scheduler", "noise-prediction"),
])
def test_noise_fields_are_refused_naming_them(flow: bool, fields: dict[str, object], field: str, words: str) -> None:
    from diffusiond.daemon.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as info:
        admit(flow, **fields)
    assert info.value.field == field and words in str(info.value), str(info.value)


# a real daemon (e) -------------------------------------------------------------------------------


async def test_a_daemon_serves_flow_sde_and_ddim_with_eta_jobs(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One job each through the whole path: the fields pass admission, reach the worker in the batch
    params and run there; the job's request echoes them."""
    from daemonkit import http, submit, wait_job

    folder = build_flux(tmp_path / "flux")
    (tmp_path / "d.toml").write_text(f'[[models]]\nname = "tiny"\nspec = "tiny"\n\n'
                                     f'[[models]]\nname = "flux"\nspec = "{folder}"\n')
    d = daemon_factory("--config", str(tmp_path / "d.toml"), "--job-timeout", "120")
    async with http(d.socket) as s:
        for body in ({"model": "flux", "scheduler": "flow-sde", "noise_level": 0.9, "guidance_scale": 3.5},
                     {"model": "tiny", "scheduler": "ddim", "eta": 1.0}):
            job = await submit(s, {"prompt": "a fox", "width": 64, "height": 64, "steps": 2, "seed": 3, **body})
            done = await wait_job(s, job["id"])
            assert done["status"] == "succeeded", done
            assert {k: done["request"][k] for k in body if k != "model"} == {k: v for k, v in body.items()
                                                                           if k != "model"}
            async with s.get(done["outputs"][0]["url"]) as r:
                assert r.status == 200 and (await r.read()).startswith(b"\x89PNG")


NOISE_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70), st.booleans(),
                         st.text(max_size=5), st.none(), st.lists(st.integers(), max_size=2))


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["noise_level", "eta"]), value=NOISE_VALUES,
       scheduler=st.sampled_from([None, "flow-sde", "ddim", "flow-match", "euler"]), flow=st.booleans())
def test_any_noise_value_is_a_job_or_a_400_naming_a_field(field: str, value: object, scheduler: str | None,
                                                         flow: bool) -> None:
    """In process, the path a body takes (decode, then check): never anything but a 400 (fuzz family)."""
    import json

    import msgspec

    from diffusiond.daemon.config import Limits
    from diffusiond.daemon.edge.requests import JobBody, check, decode
    from diffusiond.daemon.edge.sizes import sized
    from diffusiond.daemon.errors import InvalidRequest

    body = {"prompt": "x", "n": 1, field: value, **({"scheduler": scheduler} if scheduler else {})}
    try:
        if isinstance(value, float) and not math.isfinite(value):  # JSON has no NaN: a caller in process could
            job = check(body, Limits(), _Model(flow))
        else:
            job = check(sized(msgspec.structs.asdict(decode(json.dumps(body).encode(), JobBody))), Limits(),
                        _Model(flow))
    except InvalidRequest as exc:
        assert exc.field in (field, "scheduler"), (exc.field, str(exc))
        return
    got = getattr(job, field)
    assert got is None or (isinstance(got, float) and math.isfinite(got) and got >= 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_steps_log_prob_is_of_the_latents_it_hands_on_in_their_dtype(dtype: torch.dtype) -> None:
    """On a half-precision model the next step (and the trajectory) gets x_{t-1} rounded to the latents'
    dtype: the log-prob is that point's density, bit for bit, not the unrounded draw's."""
    from diffusers import DDIMScheduler

    from diffusiond.pipelines.rollout_schedulers import RolloutDDIMScheduler, ddim_mean_std, gaussian_log_prob

    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(1, 16, 64, generator=gen).to(dtype), torch.randn(1, 16, 64, generator=gen).to(dtype)
    flow = FlowSDEScheduler()
    flow.set_timesteps(20)
    ddim = RolloutDDIMScheduler.from_config(DDIMScheduler().config)
    ddim.set_timesteps(20)
    for sched in (flow, ddim):
        sched.begin([torch.Generator().manual_seed(1)], 1.0 if sched is ddim else None, record_latents=True)
        for t in sched.timesteps[-2:] if sched is ddim else sched.timesteps:
            prev = sched.step(v, t, x, return_dict=False)[0]
            step = sched.records[-1]
            if sched is flow:
                s, s_next = step.sigma, step.sigma_next
                mean, std = flow_sde_mean_std(x.float(), v.float(), s, s_next, float(flow.sigmas[1]), 0.7)
            else:
                mean, std, _, _ = ddim_mean_std(ddim, v.float(), int(t), x.float(), 1.0)
            if std > 0:
                assert torch.equal(step.log_prob, gaussian_log_prob(prev.float(), mean, std)), (sched, t)
            assert prev.dtype == dtype and step.prev_sample is not None and torch.equal(step.prev_sample, prev)
