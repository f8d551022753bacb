"""A minimal GRPO loop with diffusiond as its rollout engine: the trainer keeps a PEFT LoRA, the daemon
samples with it, and the two agree on every step's log-probability.

    diffusiond serve --model tiny                      # in one terminal
    python examples/grpo_rollout.py --iterations 5     # in another: reward and step time per iteration

Each iteration:
1. rollouts: for each prompt a group of images with the current adapter (``loras``), sampled with the
   stochastic DDIM step (``scheduler: ddim``, ``eta`` > 0; a flow-matching model takes ``flow-sde``),
   each with its trajectory (the latents of every step and their log-probs), mapped from the daemon's
   shared memory without a copy;
2. a toy reward (mean brightness of the image) and group-relative advantages;
3. the policy ratio, recomputed here from the returned latents with the trainer's own copy of the model
   (``ddim_mean_std``, ``gaussian_log_prob``: the daemon's formulas), and the clipped GRPO loss;
4. ``update_lora``: the new adapter weights go to the daemon through the output socket (a memfd, no
   files); the next rollouts run with them and record the version.

Before the first update the ratio is 1 up to the float noise of another batch shape: rollout and actor
compute the same thing, which is what a trainer checks before trusting a rollout engine.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

import diffusiond
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.rollout_schedulers import RolloutDDIMScheduler, ddim_mean_std, gaussian_log_prob

PROMPTS = ("a red cube on a table", "a lighthouse at dusk")
ADAPTER = "policy"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def lora_state(unet: Any) -> dict[str, torch.Tensor]:
    """The adapter in diffusers/PEFT naming, prefixed with its component, as ``update_lora`` takes it."""
    from peft import get_peft_model_state_dict

    return {f"unet.{k}": v.detach() for k, v in get_peft_model_state_dict(unet).items()}


def rollouts(client: diffusiond.Client, args: argparse.Namespace, it: int) -> list[dict[str, Any]]:
    """A group of samples per prompt: image, latents, log-probs; all submitted before any is read."""
    params: dict[str, Any] = {
        "n": args.group, "size": (args.size, args.size), "steps": args.steps,
        "guidance_scale": args.guidance, "scheduler": "ddim", "eta": args.eta,
        "loras": [(ADAPTER, 1.0)], "trajectory": {"latents": True, "log_probs": True},
    }  # fmt: skip
    jobs = [(p, client.submit(p, seed=1000 * it + 10 * i, **params)) for i, p in enumerate(PROMPTS)]
    samples = []
    for prompt, job in jobs:
        images = job.outputs("array")
        for k, image in enumerate(images):
            traj = job.trajectory(k, as_torch=True)
            samples.append({"prompt": prompt, "group": prompt, "image": image,
                            "latents": traj["latents"], "log_probs": traj["log_probs"],
                            "timesteps": traj["timesteps"]})
    return samples


def reward(image: np.ndarray) -> float:
    """Toy reward: brighter is better (a real loop would score with a model)."""
    return float(np.asarray(image, dtype=np.float64).mean() / 255.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", help="the daemon's socket (default: where `diffusiond socket` says)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO's group)")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--eta", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=0.2, help="PPO/GRPO ratio clip")
    args = ap.parse_args()

    from peft import LoraConfig

    torch.manual_seed(0)
    pipe = load_pipeline("tiny").pipe  # type: ignore[attr-defined]  # the trainer's copy of the weights
    unet = pipe.unet
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights="gaussian"))
    trainable = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr)
    sched = RolloutDDIMScheduler.from_config(pipe.scheduler.config)
    sched.set_timesteps(args.steps)
    with torch.no_grad():
        contexts = {}
        for prompt in PROMPTS:
            pos, neg = pipe.encode_prompt(prompt, torch.device("cpu"), 1, True, negative_prompt="")
            contexts[prompt] = torch.cat([neg, pos])

    with diffusiond.Client(args.socket) as client:
        version = client.update_lora(ADAPTER, lora_state(unet))
        print(f"adapter {ADAPTER!r} version {version}: {sum(p.numel() for p in trainable)} trainable parameters")
        t_start = time.perf_counter()
        for it in range(1, args.iterations + 1):
            t0 = time.perf_counter()
            samples = rollouts(client, args, it)
            t_roll = time.perf_counter() - t0
            rewards = torch.tensor([reward(s["image"]) for s in samples])
            advantages = torch.zeros_like(rewards)
            for prompt in PROMPTS:
                idx = [i for i, s in enumerate(samples) if s["group"] == prompt]
                r = rewards[idx]
                advantages[idx] = (r - r.mean()) / (r.std() + 1e-4)
            opt.zero_grad()
            losses, deviation = [], 0.0
            for s, adv in zip(samples, advantages, strict=True):
                latents = s["latents"].float()
                for i, t in enumerate(sched.timesteps):
                    x = latents[i][None]
                    context = contexts[s["prompt"]]
                    eps_u, eps_c = unet(torch.cat([x, x]), t, encoder_hidden_states=context).sample.chunk(2)
                    eps = eps_u + args.guidance * (eps_c - eps_u)
                    mean, std, _, _ = ddim_mean_std(sched, eps.float(), int(t), x, args.eta)
                    logp = gaussian_log_prob(latents[i + 1][None], mean, std)[0]
                    ratio = torch.exp(logp - s["log_probs"][i].float())
                    deviation = max(deviation, abs(float(ratio.detach()) - 1.0))
                    clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
                    losses.append(-torch.minimum(ratio * adv, clipped * adv))
            loss = torch.stack(losses).mean()
            loss.backward()
            opt.step()
            version = client.update_lora(ADAPTER, lora_state(unet))
            print(f"iteration {it}  reward {rewards.mean():.4f}  max |ratio-1| {deviation:.2e}  "
                  f"loss {loss.item():+.4f}  version {version}  rollout {t_roll:.2f} s  "
                  f"step {time.perf_counter() - t0:.2f} s")
        print(f"{args.iterations} iterations in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
