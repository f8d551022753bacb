"""IP-Adapters per request, end to end: a real daemon on ``tiny`` with an IP-Adapter built in code.

``style`` is ipadapterkit.py's adapter (a weights file, ``image_encoder/`` beside it) served with
``--ip-adapter NAME=PATH``; ``mono`` is the same weights with an encoder named by
``,image_encoder=DIR`` whose embedding width does not match, so no model takes it; a synthetic
model has no IP-Adapter family. With ControlNets and edits: test_ip_adapter_combos.py.
Outputs are compared as raw float32 ``npy`` bytes, so "equal" means bit for bit.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemonkit import Daemon, get, http, shared_daemon, submit, wait_job
from ipadapterkit import build_ip_adapter, png

SIZE = 64
FAST = {"model": "tiny", "width": SIZE, "height": SIZE, "steps": 2, "prompt": "a lighthouse at dusk", "seed": 7,
        "output_format": "npy", "output_dtype": "float32"}  # float: tiny's uint8 pictures saturate


@pytest.fixture(scope="module")
def ip_daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path, ip_adapter_file: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ip-daemon")
    other = build_ip_adapter(root / "mono", seed=2, projection_dim=8)  # its own encoder: 8 wide, not 16
    args = ["--model", "tiny", "--model", "plain=synthetic:compute_ms=5", "--workers", "1", "--max-batch", "4",
            "--batch-wait-ms", "400", "--job-timeout", "300", "--ip-adapter", f"style={ip_adapter_file}",
            "--ip-adapter", f"mono={ip_adapter_file},image_encoder={other.parent / 'image_encoder'}"]
    with shared_daemon(root, args, model_cache) as d:
        yield d


@pytest.fixture(scope="module")
def sock(ip_daemon: Daemon) -> Path:
    return ip_daemon.socket


async def run(s: aiohttp.ClientSession, ip_adapter: list[dict[str, Any]] | None = None, **extra: Any) -> bytes:
    body = {**FAST, **extra}
    if ip_adapter is not None:
        body["ip_adapter"] = ip_adapter
    job = await wait_job(s, (await submit(s, body))["id"])
    assert job["status"] == "succeeded", job
    async with s.get(job["outputs"][0]["url"]) as r:
        assert r.status == 200
        return await r.read()


async def test_the_reference_steers_the_output_and_scale_zero_is_the_plain_output_bit_for_bit(sock: Path) -> None:
    async with http(sock) as s:
        plain = await run(s)
        styled = await run(s, [{"name": "style", "image": png(1)}])
        other_image = await run(s, [{"name": "style", "image": png(2)}])
        half = await run(s, [{"name": "style", "image": png(1), "scale": 0.5}])
        zero = await run(s, [{"name": "style", "image": png(1), "scale": 0.0}])
        after = await run(s)  # the adapter came out of the UNet: plain again, bit for bit
    assert styled != plain, "the IP-Adapter changed nothing"
    assert other_image != styled, "another reference image gave the same output"
    assert half not in (plain, styled), "the scale changed nothing"
    assert zero == plain  # the IP processors add scale * their attention: 0 adds exact zeros
    assert after == plain


async def test_the_job_and_its_output_record_the_adapter_and_a_digest_not_the_image(sock: Path) -> None:
    image = png(3)
    async with http(sock) as s:
        bodies = [{**FAST, "output_format": "png", "output_dtype": "uint8",
                   "ip_adapter": [{"name": "style", "image": f"data:image/png;base64,{image}", "scale": 0.75}]},
                  {**FAST, "n": 2, "ip_adapter": [{"name": "style", "image": image, "scale": 0.75}]}]
        jobs = [await wait_job(s, (await submit(s, b))["id"]) for b in bodies]
        assert [j["status"] for j in jobs] == ["succeeded", "succeeded"], jobs
        assert len({o["batch"] for o in jobs[1]["outputs"]}) == 1  # one forward of two, one reference
        async with s.get(jobs[0]["outputs"][0]["url"]) as r:
            from PIL import Image

            with Image.open(io.BytesIO(await r.read())) as img:
                meta = dict(img.info)
        _, history = await get(s, f"/v1/jobs/{jobs[0]['id']}")
    entry = jobs[0]["request"]["ip_adapter"]
    assert [{k: v for k, v in e.items() if k != "image_digest"} for e in entry] == [{"name": "style", "scale": 0.75}]
    assert len(entry[0]["image_digest"]) == 24
    assert jobs[1]["request"]["ip_adapter"] == entry  # a data URL and bare base64 are the same picture
    assert history["request"]["ip_adapter"] == entry
    assert meta["ip_adapter"] == f"style:0.75 {entry[0]['image_digest']}"
    assert image not in json.dumps(history)


async def test_different_references_at_once_are_not_batched_together(sock: Path) -> None:
    """Sent in the same moment to a worker that batches for 400 ms: each output equals its solo run."""
    refs = [[{"name": "style", "image": png(1)}], [{"name": "style", "image": png(2)}],
            [{"name": "style", "image": png(1), "scale": 0.5}], None]
    async with http(sock) as s:
        solo = [await run(s, r) for r in refs]
        together = await asyncio.gather(*(run(s, r) for r in refs))
    assert list(together) == solo
    assert len(set(solo)) == 4


async def test_ip_adapters_endpoint_lists_each_with_the_models_it_fits(sock: Path, ip_adapter_file: Path) -> None:
    async with http(sock) as s:
        status, body = await get(s, "/v1/ip-adapters")
    assert status == 200
    entries = {e["name"]: e for e in body["data"]}
    assert set(entries) == {"style", "mono"}
    style = entries["style"]
    assert style["path"] == str(ip_adapter_file)
    assert style["image_encoder"] == str(ip_adapter_file.parent / "image_encoder")
    assert style["models"] == ["tiny"] and "plain" in style["unfit"]
    assert entries["mono"]["models"] == [] and "another adapter's" in entries["mono"]["unfit"]["tiny"]


async def refused(s: aiohttp.ClientSession, ip_adapter: Any, **extra: Any) -> tuple[int, dict[str, Any]]:
    async with s.post("/v1/jobs", json={**FAST, "ip_adapter": ip_adapter, **extra}) as r:
        return r.status, (await r.json())["error"]


@pytest.mark.parametrize(("ip_adapter", "extra", "field", "words"), [
    ([{"name": "face", "image": "x"}], {}, "ip_adapter[0].name", "known: mono, style"),
    ([{"name": "mono", "image": png(1)}], {}, "ip_adapter[0].name", "does not fit model 'tiny'"),
    ([{"name": "style", "image": png(1)}], {"model": "plain"}, "ip_adapter[0].name", "does not fit model 'plain'"),
    ([{"name": "style", "image": "bm90IGFuIGltYWdl"}], {}, "ip_adapter[0].image", "not an image"),
    ([{"name": "style", "image": "%%%"}], {}, "ip_adapter[0].image", "base64"),
    ([{"name": "style"}], {}, "ip_adapter[0].image", "exactly one"),
    ([{"name": "style", "image_path": "ref.png"}], {}, "ip_adapter[0].image_path", "input-dir"),
    ([{"name": "style", "image": "x", "scale": 9}], {}, "ip_adapter[0].scale", "from 0 to"),
    ([{"name": "style", "image": "x", "scale": -0.5}], {}, "ip_adapter[0].scale", "from 0 to"),
    ([{"name": "style", "image": "x"}] * 5, {}, "ip_adapter", "at most 4 IP-Adapters"),
    # several entries (tests/test_ip_adapter_multi.py): the message names the bad one's index
    ([{"name": "style", "image": png(1)}, {"name": "face", "image": "x"}], {}, "ip_adapter[1].name", "known: mono"),
    ([{"name": "style", "image": png(1)}, {"name": "mono", "image": png(1)}], {}, "ip_adapter[1].name",
     "does not fit model 'tiny'"),
    ([{"name": "style", "image": png(1)}, {"name": "style", "image": "x", "scale": 5}], {}, "ip_adapter[1].scale",
     "from 0 to"),
    ([{"name": "style", "image": "x", "weight": 1}], {}, "ip_adapter[0]", "unknown field `weight`"),
])
async def test_bad_ip_adapter_entries_are_400s_naming_the_field(sock: Path, ip_adapter: Any, extra: dict[str, Any],
                                                                field: str, words: str) -> None:
    async with http(sock) as s:
        status, error = await refused(s, ip_adapter, **extra)
    assert (status, error.get("field")) == (400, field), error
    assert words in error["message"], error


async def test_a_model_put_to_sleep_with_its_adapter_loaded_wakes_and_serves_both_ways(sock: Path) -> None:
    """Sleep takes the adapter out of the UNet (and the encoder off the device) before the weights move."""
    async with http(sock) as s:
        plain = await run(s)
        styled = await run(s, [{"name": "style", "image": png(1)}])  # the adapter is in the UNet now
        async with s.post("/v1/admin/sleep") as r:
            assert r.status == 200, await r.text()
        async with s.post("/v1/admin/wake") as r:
            assert r.status == 200, await r.text()
        assert await run(s) == plain
        assert await run(s, [{"name": "style", "image": png(1)}]) == styled


@pytest.mark.parametrize(("arg", "why"), [
    ("style=/nonexistent/ip-adapter.safetensors", "does not exist"),
    ("style=/etc/hostname", "not a .safetensors file"),
    ("bad name=/tmp/x.safetensors", "must be 1-64 characters"),
    ("style", "NAME=PATH"),
    ("style=/tmp/x.safetensors,encoder=/tmp", "image_encoder=DIR"),
])
def test_serve_refuses_an_ip_adapter_it_cannot_serve_with_one_line(arg: str, why: str) -> None:
    from diffusiond.daemon.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=why):
        build_config({}, {"ip_adapter": [arg]})


def test_serve_reads_ip_adapters_from_flags_and_toml_and_finds_the_encoder(ip_adapter_file: Path,
                                                                          tmp_path: Path) -> None:
    from diffusiond.daemon.config import ConfigError, build_config

    encoder = str(ip_adapter_file.parent / "image_encoder")
    by_folder = build_config({}, {"ip_adapter": [f"style={ip_adapter_file.parent}"]})
    assert by_folder.ip_adapters == {"style": (str(ip_adapter_file), encoder)}
    by_toml = build_config({"ip_adapters": {"style": f"{ip_adapter_file},image_encoder={encoder}"}}, {})
    assert by_toml.ip_adapters == by_folder.ip_adapters
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "b.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"holds 2 \.safetensors files"):
        build_config({}, {"ip_adapter": [f"style={tmp_path}"]})
    with pytest.raises(ConfigError, match="image encoder"):
        build_config({}, {"ip_adapter": [f"style={tmp_path / 'a.safetensors'}"]})


def test_generate_ip_adapter_flag_and_the_client_send_the_image_as_base64(tmp_path: Path) -> None:
    from diffusiond.cli import build_parser
    from diffusiond.client.params import job_body

    picture = tmp_path / "ref.png"
    picture.write_bytes(b"\x89PNG")
    args = build_parser().parse_args(["generate", "x", "--ip-adapter", f"style:{picture}:0.5"])
    assert args.ip_adapter == [{"name": "style", "image": str(picture), "scale": 0.5}]
    body = job_body("x", {"ip_adapter": [{"name": "style", "image": b"\x89PNG", "scale": 0.5}]})
    assert body["ip_adapter"] == [{"name": "style", "image": base64.b64encode(b"\x89PNG").decode(), "scale": 0.5}]
