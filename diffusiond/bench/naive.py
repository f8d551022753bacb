"""The baseline: the inference server a user writes by hand in an afternoon.

One aiohttp handler, a lock around the pipeline, PIL output, PNG encoded inline on the event
loop. It is what ``diffusiond bench`` compares the daemon against (mode ``naive``); it is not
part of the daemon and is kept deliberately plain.

    python -m diffusiond.bench.naive --socket PATH --model SPEC [--device cuda:0] [--dtype float16]
"""

from __future__ import annotations

import argparse
import asyncio
import io

import numpy as np
import torch
from aiohttp import web
from PIL import Image

from diffusiond.daemon.outputs.encoders import EncodeOptions, encode
from diffusiond.ipc.messages import BatchParams
from diffusiond.pipelines import load_pipeline
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline
from diffusiond.pipelines.ltx2 import as_served
from diffusiond.worker.copier import to_output_layout


def make_app(spec: str, device: str, dtype: str) -> web.Application:
    pipe = load_pipeline(spec, device=device, dtype=dtype)
    lock = asyncio.Lock()

    def generate(body: dict) -> Image.Image | np.ndarray:
        seed = int(body.get("seed", 0))
        if isinstance(pipe, DiffusersPipeline) and body.get("num_frames") is None:
            out = pipe.pipe(
                prompt=body["prompt"], height=body["height"], width=body["width"],
                num_inference_steps=body["steps"], guidance_scale=body["guidance_scale"],
                generator=torch.Generator("cpu").manual_seed(seed), output_type="pil",
            )
            return out.images[0]
        params = BatchParams(width=body["width"], height=body["height"], steps=body["steps"],
                             guidance=body["guidance_scale"], num_frames=body.get("num_frames"))
        (x,) = pipe.run(params, as_served(pipe.capabilities, body["prompt"], [seed], "r"), lambda s, t: True)
        arr = to_output_layout(x, "uint8").cpu().numpy()
        return Image.fromarray(arr) if arr.ndim == 3 else arr

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        async with lock:
            result = await asyncio.get_running_loop().run_in_executor(None, generate, body)
        fmt = body.get("output_format", "png")
        if fmt == "npy":
            buf = io.BytesIO()
            np.save(buf, np.asarray(result))
            return web.Response(body=buf.getvalue(), content_type="application/x-npy")
        if isinstance(result, Image.Image) and fmt in ("png", "jpeg"):
            buf = io.BytesIO()
            result.save(buf, format=fmt.upper())  # inline, on the event loop: as written by hand
            return web.Response(body=buf.getvalue(), content_type=f"image/{fmt}")
        return web.Response(body=encode(np.asarray(result), fmt, EncodeOptions(fps=int(body.get("fps", 16)))),
                            content_type="application/octet-stream")

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/generate", handler)
    app.router.add_get("/ready", ready)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description="hand-written baseline server (benchmark only)")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    web.run_app(make_app(args.model, args.device, args.dtype), path=args.socket, print=None)


if __name__ == "__main__":
    main()
