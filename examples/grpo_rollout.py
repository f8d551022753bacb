"""A minimal GRPO loop with diffusiond as its rollout engine: the trainer keeps a PEFT LoRA, the daemon
samples with it, and the two agree on every step's log-probability.

    diffusiond serve --model tiny-flux                 # in one terminal
    python examples/grpo_rollout.py --iterations 5     # in another: reward and step time per iteration

Each iteration:
1. rollouts: for each prompt a group of images with the current adapter (``loras``), sampled with
   Flow-GRPO's stochastic step (``scheduler: flow-sde``, ``noise_level``) on a flow-matching model
   (``tiny-flux``, a FLUX architecture built in code; ``--model tiny`` takes the SD family's DDIM step
   with ``eta`` > 0 instead), each with its trajectory (the latents of every step and their log-probs),
   mapped from the daemon's shared memory without a copy;
2. a toy reward (mean brightness of the image) and group-relative advantages;
3. the policy ratio, recomputed here from the returned latents with the trainer's own copy of the model
   (``flow_sde_mean_std`` or ``ddim_mean_std``, and ``gaussian_log_prob``: the daemon's formulas), and
   the clipped GRPO loss;
4. ``update_lora``: the new adapter weights go to the daemon through the output socket (a memfd, no
   files); the next rollouts run with them and record the version.

The ratio is 1 up to the float noise of another batch shape: rollout and actor compute the same thing
(on-policy), which is what a trainer checks before trusting a rollout engine.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

import diffusiond
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.rollout_schedulers import (
    RolloutDDIMScheduler,
    ddim_mean_std,
    flow_sde_mean_std,
    gaussian_log_prob,
)
from diffusiond.pipelines.tiny_flux import LORA_TARGETS as FLUX_TARGETS

PROMPTS = ("a red cube on a table", "a lighthouse at dusk")
SD_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class FluxActor:
    """The trainer's side of flow-sde on a FLUX model: the transformer's velocity on the returned latents
    (packed the way FluxPipeline packs them), Flow-GRPO's mean and std, the Gaussian log-density."""

    component, targets = "transformer", FLUX_TARGETS

    def __init__(self, pipe: Any, args: argparse.Namespace) -> None:
        self.pipe, self.args = pipe, args
        self.model = pipe.transformer
        with torch.no_grad():
            self.contexts = {p: pipe.encode_prompt(prompt=p, prompt_2=None, device=torch.device("cpu"),
                                                   num_images_per_prompt=1) for p in PROMPTS}

    def params(self) -> dict[str, Any]:
        return {"scheduler": "flow-sde", "noise_level": self.args.noise_level}

    def log_probs(self, sample: dict[str, Any]) -> torch.Tensor:
        """Every step's log-prob under the current weights, all steps in one batched forward."""
        lat = sample["latents"].float()
        steps, (c, h, w) = lat.shape[0] - 1, lat.shape[1:]
        packed = self.pipe._pack_latents(lat, steps + 1, c, h, w)
        embeds, pooled, text_ids = self.contexts[sample["prompt"]]
        img_ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, lat.device, lat.dtype)
        timesteps = sample["timesteps"].float()
        guidance = torch.full((steps,), self.args.guidance, dtype=torch.float32)
        velocity = self.model(hidden_states=packed[:steps], timestep=timesteps / 1000, guidance=guidance,
                              pooled_projections=pooled.expand(steps, -1),
                              encoder_hidden_states=embeds.expand(steps, -1, -1), txt_ids=text_ids,
                              img_ids=img_ids, return_dict=False)[0]
        sigmas = [float(s) for s in sample["sigmas"]] + [0.0]  # a flow schedule ends at sigma 0
        out = []
        for i in range(steps):
            mean, std = flow_sde_mean_std(packed[i], velocity[i].float(), sigmas[i], sigmas[i + 1], sigmas[1],
                                          self.args.noise_level)
            out.append(gaussian_log_prob(packed[i + 1][None], mean[None], std)[0])
        return torch.stack(out)


class DDIMActor:
    """The trainer's side of DDIM with eta on an SD model: the guided UNet prediction, DDPO's step."""

    component, targets = "unet", SD_TARGETS

    def __init__(self, pipe: Any, args: argparse.Namespace) -> None:
        self.pipe, self.args = pipe, args
        self.model = pipe.unet
        self.sched = RolloutDDIMScheduler.from_config(pipe.scheduler.config)
        self.sched.set_timesteps(args.steps)
        with torch.no_grad():
            self.contexts = {}
            for prompt in PROMPTS:
                pos, neg = pipe.encode_prompt(prompt, torch.device("cpu"), 1, True, negative_prompt="")
                self.contexts[prompt] = torch.cat([neg, pos])

    def params(self) -> dict[str, Any]:
        return {"scheduler": "ddim", "eta": self.args.eta}

    def log_probs(self, sample: dict[str, Any]) -> torch.Tensor:
        latents, out = sample["latents"].float(), []
        for i, t in enumerate(self.sched.timesteps):
            x = latents[i][None]
            eps_u, eps_c = self.model(torch.cat([x, x]), t,
                                      encoder_hidden_states=self.contexts[sample["prompt"]]).sample.chunk(2)
            eps = eps_u + self.args.guidance * (eps_c - eps_u)
            mean, std, _, _ = ddim_mean_std(self.sched, eps.float(), int(t), x, self.args.eta)
            out.append(gaussian_log_prob(latents[i + 1][None], mean, std)[0])
        return torch.stack(out)


def lora_state(actor: FluxActor | DDIMActor) -> dict[str, torch.Tensor]:
    """The adapter in diffusers/PEFT naming, prefixed with its component, as ``update_lora`` takes it."""
    from peft import get_peft_model_state_dict

    return {f"{actor.component}.{k}": v.detach() for k, v in get_peft_model_state_dict(actor.model).items()}


def rollouts(client: diffusiond.Client, actor: FluxActor | DDIMActor, args: argparse.Namespace,
             it: int) -> tuple[list[dict[str, Any]], set[int]]:
    """A group of samples per prompt: image, latents, log-probs; all submitted before any is read.
    Also the adapter versions the samples ran with (each output's: a group may span batches either side
    of an update)."""
    params: dict[str, Any] = {
        "model": args.model, "n": args.group, "size": (args.size, args.size), "steps": args.steps,
        "guidance_scale": args.guidance, **actor.params(),
        "loras": [(args.adapter, 1.0)], "trajectory": {"latents": True, "log_probs": True},
    }  # fmt: skip
    jobs = [(p, client.submit(p, seed=1000 * it + 10 * i, **params)) for i, p in enumerate(PROMPTS)]
    samples, versions = [], set()
    for prompt, job in jobs:
        images = job.outputs("array")
        versions |= {int((o.get("lora_versions") or {}).get(args.adapter, 0)) for o in client.job(job.id)["outputs"]}
        for k, image in enumerate(images):
            traj = job.trajectory(k, as_torch=True)
            samples.append({"prompt": prompt, "image": image, **traj})
    return samples, versions


def reward(image: np.ndarray) -> float:
    """Toy reward: brighter is better (a real loop would score with a model)."""
    return float(np.asarray(image, dtype=np.float64).mean() / 255.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="the daemon's socket (default: where `diffusiond socket` says)")
    ap.add_argument("--model", default="tiny-flux", help="tiny-flux (flow-sde) or tiny (ddim with eta)")
    ap.add_argument("--adapter", default="policy", help="the live LoRA's name in the daemon")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO's group)")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guidance", type=float, default=None, help="default: 3.5 on tiny-flux, 5 on tiny")
    ap.add_argument("--noise-level", type=float, default=0.7, help="flow-sde's noise (Flow-GRPO's a)")
    ap.add_argument("--eta", type=float, default=1.0, help="ddim's eta (SD family)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=0.2, help="PPO/GRPO ratio clip")
    args = ap.parse_args()
    if args.model not in ("tiny-flux", "tiny"):
        ap.error(f"--model {args.model}: this example builds its trainer's copy of tiny-flux or tiny")
    flow = args.model == "tiny-flux"
    if args.guidance is None:
        args.guidance = 3.5 if flow else 5.0

    from peft import LoraConfig

    torch.manual_seed(0)
    pipe = load_pipeline(args.model).pipe  # type: ignore[attr-defined]  # the trainer's copy of the weights
    actor: FluxActor | DDIMActor = FluxActor(pipe, args) if flow else DDIMActor(pipe, args)
    actor.model.requires_grad_(False)
    actor.model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=actor.targets,
                                       init_lora_weights="gaussian"))
    trainable = [p for p in actor.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)

    with diffusiond.Client(args.socket) as client:
        version = client.update_lora(args.adapter, lora_state(actor))
        print(f"adapter {args.adapter!r} version {version} on {args.model}: {sum(p.numel() for p in trainable)} "
              "trainable parameters")
        t_start = time.perf_counter()
        for it in range(1, args.iterations + 1):
            t0 = time.perf_counter()
            samples, ran_with = rollouts(client, actor, args, it)
            t_roll = time.perf_counter() - t0
            rewards = torch.tensor([reward(s["image"]) for s in samples])
            advantages = torch.zeros_like(rewards)
            for prompt in PROMPTS:
                idx = [i for i, s in enumerate(samples) if s["prompt"] == prompt]
                r = rewards[idx]
                advantages[idx] = (r - r.mean()) / (r.std() + 1e-4)
            opt.zero_grad()
            losses, deviation = [], 0.0
            for s, adv in zip(samples, advantages, strict=True):
                ratio = torch.exp(actor.log_probs(s) - s["log_probs"].float())
                deviation = max(deviation, float((ratio.detach() - 1).abs().max()))
                clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
                losses.append(-torch.minimum(ratio * adv, clipped * adv))
            loss = torch.cat(losses).mean()
            loss.backward()
            opt.step()
            version = client.update_lora(args.adapter, lora_state(actor))
            print(f"iteration {it}  reward {rewards.mean():.4f}  max |ratio-1| {deviation:.2e}  "
                  f"loss {loss.item():+.4f}  ran with {','.join(map(str, sorted(ran_with)))}  version {version}  "
                  f"rollout {t_roll:.2f} s  step {time.perf_counter() - t0:.2f} s")
        print(f"{args.iterations} iterations in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
