"""LoRA adapters per request, end to end: real daemons on ``tiny`` with LoRAs built in code.

The adapters are built once per session (``lora_files`` in conftest.py): ``ink`` (UNet and text encoder), ``dots``
(UNet only, another seed), ``ink-kohya`` (``ink`` rewritten in the kohya layout, which diffusers
converts on load), ``misfit`` (``ink`` with one matrix of the wrong shape for tiny) and a
safetensors file that holds no LoRA at all. Outputs are compared as raw ``npy`` bytes, so
"equal" means bit for bit.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, get, http, shared_daemon, submit, wait_job, when_idle
from lorakit import build_lora

from conftest import ROOT

SIZE = 64
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7}


def lora_args(files: dict[str, Path], *names: str) -> list[str]:
    return [a for n in names for a in ("--lora", f"{n}={files[n]}")]


@pytest.fixture(scope="module")
def lora_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path,
                lora_files: dict[str, Path]) -> Iterator[Daemon]:
    """One worker (so batch ids are comparable), batches of up to 4 gathered for 400 ms, and
    three adapters against a budget of two loaded at once (so the LRU evicts and reloads)."""
    args = ["--model", "tiny", "--workers", "1", "--max-batch", "4", "--batch-wait-ms", "400",
            "--max-loras", "2", "--job-timeout", "300", *lora_args(lora_files, "ink", "dots", "ink-kohya")]
    with shared_daemon(tmp_path_factory.mktemp("lora-daemon"), args, model_cache) as d:
        yield d


@pytest.fixture
async def sock(lora_daemon: Daemon) -> Path:
    return await when_idle(lora_daemon)


async def run(s: aiohttp.ClientSession, loras: list[dict[str, Any]] | None = None, **extra: Any) -> bytes:
    """One job's raw output (npy bytes) with these adapters."""
    body = {**FAST, "output_format": "npy", **extra}
    if loras is not None:
        body["loras"] = loras
    job = await wait_job(s, (await submit(s, body))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return await r.read()


async def post(s: aiohttp.ClientSession, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with s.post(path, json=body) as r:
        return r.status, await r.json()


# what an adapter does to the output ----------------------------------------------------------


async def test_adapter_changes_output_and_weight_zero_is_the_base_model_bit_for_bit(sock: Path) -> None:
    async with http(sock) as s:
        base = await run(s)
        ink = await run(s, [{"name": "ink", "weight": 1.0}])
        ink_zero = await run(s, [{"name": "ink", "weight": 0.0}])
        dots = await run(s, [{"name": "dots", "weight": 1.0}])
    assert ink != base and dots != base and ink != dots
    assert ink_zero == base


async def test_kohya_layout_file_gives_the_same_output_as_the_diffusers_layout(sock: Path) -> None:
    async with http(sock) as s:
        ink = await run(s, [{"name": "ink", "weight": 0.8}])
        kohya = await run(s, [{"name": "ink-kohya", "weight": 0.8}])
        base = await run(s)
    assert kohya == ink != base


async def test_same_seed_and_adapters_is_deterministic_whatever_the_order_and_eviction(sock: Path) -> None:
    pair = [{"name": "ink", "weight": 0.7}, {"name": "dots", "weight": -0.5}]
    async with http(sock) as s:
        first = await run(s, pair)
        # the third adapter evicts one of the two (--max-loras 2); the pair is then loaded again
        await run(s, [{"name": "ink-kohya", "weight": 1.0}])
        again = await run(s, list(reversed(pair)))
        other_weight = await run(s, [{"name": "ink", "weight": 0.7}, {"name": "dots", "weight": 0.5}])
    assert again == first
    assert other_weight != first


async def test_different_adapter_sets_never_share_a_batch(sock: Path) -> None:
    sets: list[list[dict[str, Any]] | None] = [
        None, [{"name": "ink", "weight": 1.0}], [{"name": "dots", "weight": 1.0}],
        None, [{"name": "ink", "weight": 1.0}], [{"name": "dots", "weight": 1.0}],
    ]
    async with http(sock) as s:
        solo = [await run(s, loras) for loras in sets[:3]]
        bodies = [{**FAST, "output_format": "npy", **({"loras": x} if x else {})} for x in sets]
        jobs = await asyncio.gather(*(submit(s, b) for b in bodies))  # all queued within the batch wait
        done = [await wait_job(s, j["id"]) for j in jobs]
        outputs = []
        for job in done:
            assert job["status"] == "succeeded", job
            async with s.get(job["outputs"][0]["url"]) as r:
                outputs.append(await r.read())
    batch = [job["outputs"][0]["batch"] for job in done]
    for i in range(len(sets)):
        for j in range(i + 1, len(sets)):
            if sets[i] != sets[j]:
                assert batch[i] != batch[j], f"jobs {i} and {j} ({sets[i]} / {sets[j]}) shared batch {batch[i]}"
    assert any(batch[i] == batch[i + 3] for i in range(3)), f"no equal adapter sets batched together: {batch}"
    for k, out in enumerate(outputs):  # and batching changed no output beyond what batched kernels round
        assert_same_but_rounding(out, solo[k % 3], f"job {k} ({sets[k]}) against the same request run alone")


def assert_same_but_rounding(a: bytes, b: bytes, what: str) -> None:
    """Equal up to the README's promise across batch sizes: batched CPU kernels may round a few
    pixels by one 8-bit step (on some CPUs a batch of two differs from one in a byte or two). An
    adapter applied to the wrong request, or not at all, changes far more than that."""
    import numpy as np

    x, y = (np.load(io.BytesIO(v)).astype(np.int16) for v in (a, b))
    assert x.shape == y.shape, what
    diff = np.abs(x - y)
    assert diff.max() <= 1 and np.count_nonzero(diff) <= diff.size // 100, \
        f"{what}: {np.count_nonzero(diff)} of {diff.size} values differ, by up to {diff.max()}"


async def test_no_contamination_between_base_and_adapter_requests(
        daemon_factory: Any, lora_files: dict[str, Path]) -> None:
    """A request without adapters right after one with them (and the reverse) is bit-identical to
    the same request on a fresh daemon that never had an adapter, also after an eviction."""
    plain = daemon_factory("--model", "tiny", "--workers", "1")
    async with http(plain.socket) as s:
        fresh_base = await run(s)
    plain.stop()
    d = daemon_factory("--model", "tiny", "--workers", "1", "--max-loras", "1",
                       *lora_args(lora_files, "ink", "dots"))
    async with http(d.socket) as s:
        ink_first = await run(s, [{"name": "ink", "weight": 1.0}])
        base_after_ink = await run(s)
        dots = await run(s, [{"name": "dots", "weight": 1.0}])  # evicts ink (--max-loras 1)
        ink_after = await run(s, [{"name": "ink", "weight": 1.0}])
        base_after = await run(s)
    assert base_after_ink == fresh_base == base_after
    assert ink_after == ink_first != fresh_base
    assert dots not in (fresh_base, ink_first)


async def test_adapters_apply_to_image_to_image_edits_and_leave_them_clean_after(sock: Path) -> None:
    """Edits run from_pipe pipelines on the same modules: the adapters act there too, and a plain
    edit after one with adapters is the same as before."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), (40, 120, 200)).save(buf, format="PNG")
    edit = {"image": base64.b64encode(buf.getvalue()).decode(), "strength": 0.9}
    async with http(sock) as s:
        plain = await run(s, **edit)
        with_ink = await run(s, [{"name": "ink", "weight": 1.0}], **edit)
        plain_after = await run(s, **edit)
    assert with_ink != plain == plain_after


async def test_multipart_edits_take_loras_in_each_spelling_clients_send(sock: Path) -> None:
    """/v1/images/edits is a form: the official client flattens extra_body's list of objects to
    loras[][name]/loras[][weight]; curl users write JSON text or the CLI's name:weight. All three
    give the adapters' output, the same bytes as the JSON edit on /v1/jobs."""
    import httpx
    import openai
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE), (40, 120, 200)).save(buf, format="PNG")
    image = buf.getvalue()
    common = {"num_inference_steps": 2, "seed": 7, "strength": 0.9}

    def openai_edit(extra: dict[str, Any]) -> Image.Image:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=120) as hc:
            client = openai.OpenAI(base_url="http://diffusiond/v1", api_key="unused", http_client=hc)
            result = client.images.edit(model="tiny", image=("in.png", image, "image/png"), prompt=FAST["prompt"],
                                        size=f"{SIZE}x{SIZE}", response_format="b64_json",
                                        extra_body={**common, **extra})
        assert result.data is not None and result.data[0].b64_json is not None
        return Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))

    async def form_edit(s: aiohttp.ClientSession, loras: str) -> tuple[int, Any]:
        form = aiohttp.FormData(default_to_multipart=True)
        for k, v in {"prompt": FAST["prompt"], "model": "tiny", "size": f"{SIZE}x{SIZE}", "loras": loras,
                     **{k: str(v) for k, v in common.items()}}.items():
            form.add_field(k, v)
        form.add_field("image", image, filename="in.png", content_type="image/png")
        async with s.post("/v1/images/edits", data=form) as r:
            return r.status, await r.json()

    two = [{"name": "ink", "weight": 0.8}, {"name": "dots", "weight": 0.25}]
    flattened = await asyncio.to_thread(openai_edit, {"loras": two})
    plain = await asyncio.to_thread(openai_edit, {})
    assert flattened.text["loras"] == "dots:0.25, ink:0.8"
    assert flattened.tobytes() != plain.tobytes()
    async with http(sock) as s:
        for spelling in (json.dumps(two), "ink:0.8, dots:0.25"):
            status, body = await form_edit(s, spelling)
            assert status == 200, body
            got = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
            assert got.tobytes() == flattened.tobytes(), spelling
        status, body = await form_edit(s, "nope:1")
        assert (status, body["error"]["code"], body["error"]["field"]) == (404, "lora_not_found", "loras")
        status, body = await form_edit(s, "[{")
        assert (status, body["error"]["field"]) == (400, "loras")


# the record of what was applied --------------------------------------------------------------


async def test_job_record_and_png_metadata_carry_adapters_and_weights(sock: Path) -> None:
    from PIL import Image

    loras = [{"name": "ink", "weight": 0.8}, {"name": "dots", "weight": 0.25}]
    async with http(sock) as s:
        job = await wait_job(s, (await submit(s, {**FAST, "loras": loras}))["id"])
        assert job["status"] == "succeeded", job
        async with s.get(job["outputs"][0]["url"]) as r:
            png = await r.read()
    assert job["request"]["loras"] == sorted(loras, key=lambda e: e["name"])
    assert Image.open(io.BytesIO(png)).text["loras"] == "dots:0.25, ink:0.8"


async def test_openai_client_sends_loras_in_extra_body(sock: Path) -> None:
    import httpx
    import openai

    def call(extra: dict[str, Any]) -> bytes:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=120) as hc:
            client = openai.OpenAI(base_url="http://diffusiond/v1", api_key="unused", http_client=hc)
            result = client.images.generate(model="tiny", prompt="a lighthouse at dusk", size=f"{SIZE}x{SIZE}",
                                            response_format="b64_json",
                                            extra_body={"num_inference_steps": 2, "seed": 7, **extra})
        assert result.data is not None and result.data[0].b64_json is not None
        return base64.b64decode(result.data[0].b64_json)

    with_lora = await asyncio.to_thread(call, {"loras": [{"name": "ink", "weight": 1.0}]})
    without = await asyncio.to_thread(call, {})
    from PIL import Image

    assert Image.open(io.BytesIO(with_lora)).text["loras"] == "ink:1"
    assert Image.open(io.BytesIO(with_lora)).tobytes() != Image.open(io.BytesIO(without)).tobytes()


# admission ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("loras", "status", "code", "words", "field"), [
    ([{"name": "nope"}], 404, "lora_not_found", "no LoRA named 'nope'", "loras"),
    ([{"name": "ink", "weight": 4.5}], 400, "invalid_request", "between -4 and 4, got 4.5", "loras"),
    ([{"name": "ink", "weight": -9}], 400, "invalid_request", "between -4 and 4", "loras"),
    ([{"name": "ink"}, {"name": "ink", "weight": 0.5}], 400, "invalid_request", "named twice", "loras"),
    ([{"name": "ink"}, {"name": "dots"}, {"name": "ink-kohya"}], 400, "invalid_request", "the limit is 2", "loras"),
    # the entry and its key, where the shape is wrong
    ([{"name": 3}], 400, "invalid_request", "Expected `str`", "loras[0].name"),
    ([{"name": "ink", "scale": 1}], 400, "invalid_request", "unknown field", "loras[0]"),
    ("ink", 400, "invalid_request", "Expected `array", "loras"),
])
async def test_bad_loras_are_refused_naming_the_field(sock: Path, loras: Any, status: int, code: str,
                                                      words: str, field: str) -> None:
    async with http(sock) as s:
        for path, body in (("/v1/jobs", {**FAST, "loras": loras}),
                           ("/v1/images/generations", {"prompt": "x", "size": "64x64", "loras": loras})):
            got, answer = await post(s, path, body)
            assert got == status, (path, answer)
            assert answer["error"]["code"] == code
            assert answer["error"]["field"] == field
            assert words in answer["error"]["message"]


# the registry ----------------------------------------------------------------------------------


async def test_get_loras_lists_each_with_rank_layout_models_and_the_lru_of_loaded_ones(sock: Path,
                                                                        lora_files: dict[str, Path]) -> None:
    async with http(sock) as s:
        for name in ("ink", "dots", "ink-kohya"):  # three adapters, two kept loaded (--max-loras 2)
            await run(s, [{"name": name, "weight": 1.0}])
        await asyncio.sleep(2.5)  # the loaded list comes with the workers' heartbeat answers (each second)
        status, body = await get(s, "/v1/loras")
    assert status == 200
    by_name = {e["name"]: e for e in body["data"]}
    assert {"ink", "dots", "ink-kohya"} <= set(by_name)
    assert by_name["ink"]["path"] == str(lora_files["ink"])
    assert by_name["ink"]["layout"] == "diffusers" and by_name["ink-kohya"]["layout"] == "kohya"
    assert by_name["ink"]["rank"] == 4
    assert by_name["ink"]["targets"] == ["text_encoder", "unet"] and by_name["dots"]["targets"] == ["unet"]
    assert by_name["ink-kohya"]["targets"] == ["text_encoder", "unet"]
    assert all(e["models"] == ["tiny"] and e["unfit"] == {} for e in by_name.values())
    # the least recently used one was unloaded to make room; the two used last stay loaded
    assert {n for n, e in by_name.items() if e["loaded"]} == {"dots", "ink-kohya"}


async def test_post_lora_adds_one_at_run_time_and_a_bad_one_fails_alone(
        sock: Path, lora_files: dict[str, Path], tmp_path: Path) -> None:
    late = build_lora(tmp_path / "late", seed=5)
    (tmp_path / "late.bin").write_bytes((late / "pytorch_lora_weights.safetensors").read_bytes())
    async with http(sock) as s:
        status, body = await post(s, "/v1/loras", {"name": "late", "path": str(late)})
        assert status == 201, body
        assert body["name"] == "late" and body["models"] == ["tiny"] and body["rank"] == 4
        assert await run(s, [{"name": "late", "weight": 1.0}]) != await run(s)
        for request, code, field, words in (
            ({"name": "late", "path": str(late)}, 409, "name", "already registered"),
            ({"name": "gone", "path": str(tmp_path / "missing")}, 400, "path", "does not exist"),
            ({"name": "txt", "path": str(lora_files["text"])}, 400, "path", "not a safetensors file"),
            ({"name": "nolora", "path": str(lora_files["not-a-lora"])}, 400, "path", "holds no LoRA weights"),
            ({"name": "misfit", "path": str(lora_files["misfit"])}, 400, "path", "fits no model served here"),
            ({"name": "bad name!", "path": str(late)}, 400, "name", "must be 1-64 characters"),
            ({"name": "rel", "path": "late"}, 400, "path", "is relative"),
            ({"name": "pickle", "path": str(tmp_path / "late.bin")}, 400, "path", "not a .safetensors file"),
            ({"name": "x"}, 400, "path", "missing required field"),
        ):
            got, answer = await post(s, "/v1/loras", request)
            assert got == code, (request, answer)
            assert answer["error"]["field"] == field, answer
            assert words in answer["error"]["message"], answer
        names = {e["name"] for e in (await get(s, "/v1/loras"))[1]["data"]}
        assert "misfit" not in names and "late" in names
        got, answer = await post(s, "/v1/jobs", {**FAST, "loras": [{"name": "misfit"}]})
        assert got == 404 and answer["error"]["code"] == "lora_not_found"
        assert await run(s, [{"name": "ink", "weight": 1.0}]) != await run(s)  # the daemon goes on


def test_a_lora_cut_short_is_refused_from_its_header_naming_the_bytes(lora_files: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """Found by the engine as it registers the file, before any worker loads it (and fails at a job's first use)."""
    from diffusiond.daemon.core.loras import LoraFileError, read_lora

    whole = (lora_files["ink"] / "pytorch_lora_weights.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) - 100])  # a download cut short
    assert read_lora("whole", str(lora_files["ink"])).rank == 4
    with pytest.raises(LoraFileError, match=r"cut.safetensors\) is truncated: its header describes \d+ bytes"):
        read_lora("cut", str(tmp_path / "cut.safetensors"))


# start-up ---------------------------------------------------------------------------------------


def serve(tmp_path: Path, model_cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    import os

    env = dict(os.environ, DIFFUSIOND_CACHE=str(model_cache))
    return subprocess.run([sys.executable, "-m", "diffusiond", "serve", "--socket", str(tmp_path / "d.sock"),
                           "--model", "tiny", *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.mark.parametrize(("which", "words"), [
    ("not-a-lora", "holds no LoRA weights"),
    ("text", "is not a safetensors file"),
])
def test_a_lora_file_that_is_not_one_stops_serve_naming_the_file(
        tmp_path: Path, model_cache: Path, lora_files: dict[str, Path], which: str, words: str) -> None:
    done = serve(tmp_path, model_cache, "--lora", f"bad={lora_files[which]}")
    assert done.returncode == 2
    assert str(lora_files[which]) in done.stderr and words in done.stderr and "'bad'" in done.stderr


def test_a_lora_that_does_not_fit_the_model_stops_the_daemon_naming_the_file(
        tmp_path: Path, model_cache: Path, lora_files: dict[str, Path]) -> None:
    done = serve(tmp_path, model_cache, "--lora", f"misfit={lora_files['misfit']}", "--job-timeout", "60")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "LoRA 'misfit'" in done.stderr and str(lora_files["misfit"]) in done.stderr
    assert "fits no model served here: tiny:" in done.stderr and "size mismatch" in done.stderr.lower()


def test_loras_from_a_toml_table_and_flags(tmp_path: Path, lora_files: dict[str, Path]) -> None:
    from diffusiond.daemon.config import ConfigError, build_config, load_toml

    toml = tmp_path / "d.toml"
    toml.write_text(f'max_loras = 3\n[loras]\nink = "{lora_files["ink"]}"\ndots = "{lora_files["dots"]}"\n')
    config = build_config(load_toml(toml), {})
    assert config.loras == {"ink": str(lora_files["ink"]), "dots": str(lora_files["dots"])}
    assert config.max_loras == 3
    flags = build_config(load_toml(toml), {"lora": [f"k={lora_files['ink-kohya']}"]})
    assert flags.loras == {"k": str(lora_files["ink-kohya"])}  # flags replace the table
    for bad, words in ((["ink"], "NAME=PATH"), ([f"a={tmp_path}/none"], "does not exist"),
                       ([f"a={lora_files['ink']}", f"a={lora_files['dots']}"], "given twice")):
        with pytest.raises(ConfigError, match=words):
            build_config({}, {"lora": bad})
    with pytest.raises(ConfigError, match="max_loras must be at least 1"):
        build_config({}, {"max_loras": 0})


# the client side -------------------------------------------------------------------------------


def test_cli_generate_lora_flag(sock: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.png"
    done = subprocess.run([sys.executable, "-m", "diffusiond", "generate", "--socket", str(sock), "a lighthouse",
                           "--size", "64x64", "--steps", "2", "--seed", "7", "--lora", "ink:0.5", "--lora", "dots",
                           "-o", str(out), "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)["job"]
    assert job["request"]["loras"] == [{"name": "dots", "weight": 1.0}, {"name": "ink", "weight": 0.5}]
    bad = subprocess.run([sys.executable, "-m", "diffusiond", "generate", "--socket", str(sock), "x",
                          "--lora", "ink:lots"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "not a number" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "diffusiond", "generate", "--socket", str(sock), "x",
                              "--size", "64x64", "--lora", "nope"], capture_output=True, text=True, timeout=60,
                             cwd=ROOT)
    assert missing.returncode == 1 and "no LoRA named 'nope'" in missing.stderr


async def test_python_client_loras_parameter(sock: Path) -> None:
    from diffusiond.client import AsyncClient

    client = AsyncClient(str(sock), 120)
    params: dict[str, Any] = {"size": (SIZE, SIZE), "steps": 2, "seed": 7}
    with_map = await client.generate("a lighthouse at dusk", output="array", loras={"ink": 1.0}, **params)
    with_pairs = await client.generate("a lighthouse at dusk", output="array", loras=[("ink", 1.0)], **params)
    base = await client.generate("a lighthouse at dusk", output="array", **params)
    assert (with_map[0] == with_pairs[0]).all()
    assert not (with_map[0] == base[0]).all()
