"""Tiled upscaling (pipelines/tiles.py), its out-of-memory retry (worker/finish.py) and the serve flag
that sets it (``--upscaler NAME=PATH,tile=N,overlap=N``), on the CPU with the tiny ESRGAN of
upscalekit.py (8 features, 1 block, x2, random weights).

Why tiled and whole outputs can be compared at all: an ESRGAN output pixel sees only the input
within its receptive field, so a tile's output differs from the whole picture's only near the tile's
inner edges (zero padding there instead of the neighbour), and the feathered blend gives those
pixels the least weight. Measured on a 96x80 noise picture in tiles of 32 with an overlap of 8
(4 x 3 tiles): the whole output spreads over [0, 0.13] (std 0.035); the tiled one differs from it by
at most 0.0095, 0.0002 on average. The same tiles blended wrongly differ by far more: no ramp
(a plain average) 0.031, the ramp the wrong way round (a tile's edge weighted most) 0.057, no
overlap at all 0.063; so the bounds below (0.015 at most, 0.0005 on average) fail when the blend is
wrong. Constant and smooth pictures agree to 0.005 and 0.008.
"""

from __future__ import annotations

import io
import itertools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from upscalekit import build_upscaler, require_spandrel

from diffusiond.daemon.config import ConfigError, build_config
from diffusiond.daemon.values import parse_upscalers
from diffusiond.ipc.upscale import MAX_TILE, MIN_TILE, UpscalerSetting
from diffusiond.pipelines import tiles
from diffusiond.worker.failures import is_oom

TILE, OVERLAP, SCALE = 32, 8, 2


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_spandrel()
    return build_upscaler(tmp_path_factory.mktemp("tiles") / "esr.safetensors", seed=1)


@pytest.fixture(scope="module")
def model(model_file: Path) -> Any:
    from diffusiond.pipelines.upscalers import load

    return load(str(model_file)).eval()


def upscalers(model_file: Path, tile: int = TILE, overlap: int = OVERLAP) -> Any:
    from diffusiond.pipelines.upscalers import Upscalers

    return Upscalers({"esr": UpscalerSetting(path=str(model_file), tile=tile, overlap=overlap)}, torch.device("cpu"))


def noise(h: int = 96, w: int = 80, n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def smooth(h: int = 96, w: int = 80) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    return torch.stack([0.5 + 0.4 * torch.sin(3 * xx + yy), 0.5 + 0.4 * torch.cos(2 * yy), (xx + yy) / 2])[None]


def both(model: Any, picture: torch.Tensor, overlap: int = OVERLAP) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        return tiles.upscale_tiled(model, picture, TILE, overlap), model(picture)


def edges(side: int, overlap: int = OVERLAP) -> list[int]:
    """The output rows or columns where some tile begins or ends (the picture's own edges left out)."""
    return sorted({e * SCALE for s in tiles.starts(side, TILE, overlap) for e in (s, s + TILE)} - {0, side * SCALE})


def test_tile_starts_cover_the_side_with_at_least_the_overlap_and_one_size() -> None:
    assert tiles.starts(32, 32, 8) == [0] and tiles.starts(20, 32, 8) == [0]
    assert tiles.starts(96, 32, 8) == [0, 24, 48, 64] and tiles.starts(80, 32, 8) == [0, 24, 48]
    for size in range(33, 300, 7):
        s = tiles.starts(size, 32, 8)
        assert s[0] == 0 and s[-1] + 32 == size and s == sorted(set(s))
        assert all(8 <= a + 32 - b < 32 for a, b in itertools.pairwise(s)), (size, s)


def test_ramps_cross_fade_to_one_and_leave_the_pictures_edges_alone() -> None:
    a, b = tiles.ramp(16, 4, before=False, after=True), tiles.ramp(16, 4, before=True, after=False)
    assert torch.allclose(a[-4:] + b[:4], torch.ones(4))  # two neighbours over a band of exactly the width
    assert a[0] == 1 and b[-1] == 1 and (a > 0).all() and (b > 0).all()
    assert torch.equal(tiles.ramp(16, 4, before=False, after=False), torch.ones(16))


def test_tiled_matches_whole_within_the_receptive_fields_reach(model: Any) -> None:
    tiled, full = both(model, noise())
    assert tiled.shape == full.shape == (1, 3, 96 * SCALE, 80 * SCALE)
    diff = (tiled - full).abs()
    assert diff.max() < 0.015 and diff.mean() < 0.0005, (diff.max(), diff.mean())
    # where tiles cannot be wrong (farther than the overlap from any inner tile edge) they are nearly exact
    rows, cols = torch.ones(96 * SCALE, dtype=torch.bool), torch.ones(80 * SCALE, dtype=torch.bool)
    for mask, side in ((rows, 96), (cols, 80)):
        for e in edges(side):
            mask[max(0, e - 2 * OVERLAP * SCALE):e + 2 * OVERLAP * SCALE] = False
    inner = diff[..., rows, :][..., cols]
    assert inner.numel() and inner.max() < 0.002, inner.max()


@pytest.mark.parametrize(("picture", "bound"), [(torch.full((1, 3, 96, 80), 0.4), 0.008), (smooth(), 0.012)])
def test_constant_and_smooth_pictures_tile_to_the_whole_picture(model: Any, picture: torch.Tensor,
                                                                bound: float) -> None:
    tiled, full = both(model, picture)
    assert (tiled - full).abs().max() < bound


def seam(tiled: torch.Tensor, full: torch.Tensor, overlap: int) -> float:
    """The largest jump of (tiled - whole) across a tile's edge, in either direction, averaged along it."""
    d = tiled - full
    across_cols = (d[..., 1:] - d[..., :-1]).abs().mean(dim=(0, 1, 2))
    across_rows = (d[..., 1:, :] - d[..., :-1, :]).abs().mean(dim=(0, 1, 3))
    return max([across_cols[c - 1].item() for c in edges(80, overlap)]
               + [across_rows[r - 1].item() for r in edges(96, overlap)])


def test_no_seam_line_where_tiles_meet(model: Any) -> None:
    """The step of (tiled - whole) across each tile edge is no larger than elsewhere (measured 0.0003
    against 0.0002 over all columns); tiles put side by side with no overlap make a seam there
    (0.007), which this bound catches."""
    tiled, full = both(model, noise())
    d = tiled - full
    everywhere = (d[..., 1:] - d[..., :-1]).abs().mean().item()
    assert seam(tiled, full, OVERLAP) < max(0.001, 3 * everywhere)
    butted, _ = both(model, noise(), overlap=0)
    assert seam(butted, full, 0) > 0.003


def test_a_picture_no_larger_than_a_tile_is_the_whole_path_to_the_byte(model_file: Path, model: Any) -> None:
    picture = noise(32, 24)
    with torch.inference_mode():
        before = model(picture.float()).clamp_(0, 1)  # what Upscalers.upscale returned before tiles
    for tile in (32, 512, 0):
        assert torch.equal(upscalers(model_file, tile=tile, overlap=8).upscale("esr", picture), before)


def test_tiles_go_through_the_model_four_at_a_time_and_each_picture_alone(model: Any) -> None:
    sizes: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        assert x.shape[-2:] == (TILE, TILE)  # every tile one size: the last of a row moved back, not padded
        return model(x)

    pictures = noise(n=2)
    with torch.inference_mode():
        two = tiles.upscale_tiled(counted, pictures, TILE, OVERLAP)
        assert sizes == [4] * 6  # 4 x 3 tiles per picture, two pictures
        for i in range(2):
            alone = tiles.upscale_tiled(model, pictures[i:i + 1], TILE, OVERLAP)
            assert torch.allclose(two[i:i + 1], alone, atol=1e-5)


def test_a_wide_picture_tiles_along_its_long_side_only(model: Any) -> None:
    picture = noise(24, 100)
    with torch.inference_mode():
        tiled, full = tiles.upscale_tiled(model, picture, TILE, OVERLAP), model(picture)
    assert tiled.shape == full.shape and (tiled - full).abs().max() < 0.015


class Failing:
    """The model, running out of memory on tiles larger than ``limit`` (as CUDA would)."""

    def __init__(self, model: Any, limit: int) -> None:
        self.model, self.limit, self.seen = model, limit, []
        self.scale = model.scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(tuple(x.shape[-2:]))
        if max(x.shape[-2:]) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB\nallocator advice")
        return self.model(x)


def finisher(model_file: Path, tile: int, limit: int) -> tuple[Any, Failing]:
    from diffusiond.worker.finish import Finisher

    ups = upscalers(model_file, tile=tile, overlap=OVERLAP)
    failing = Failing(ups.models["esr"], limit)
    ups.models["esr"] = failing
    return Finisher(None, ups), failing  # type: ignore[arg-type]  # the pipeline is for hires passes only


def test_out_of_memory_retries_once_with_half_the_tile_and_logs_it(model_file: Path, model: Any,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    f, failing = finisher(model_file, tile=64, limit=32)
    picture = noise()
    with caplog.at_level(logging.WARNING, logger="diffusiond.worker.finish"):
        out = f._model("esr", picture)
    assert failing.seen[0] == (64, 64) and set(failing.seen[1:]) == {(32, 32)}
    assert f.oom_retries == 1  # the compute thread then keeps this forward's peak out of the working-memory record
    assert torch.equal(out, upscalers(model_file).upscale("esr", picture))  # tiles of 32, overlap 8
    assert "upscaler 'esr' ran out of memory on a 80x96 picture in tiles of 64; retrying in tiles of 32" in caplog.text


def test_a_whole_picture_out_of_memory_retries_in_tiles_of_half_its_side(model_file: Path) -> None:
    f, failing = finisher(model_file, tile=0, limit=48)
    out = f._model("esr", noise())
    assert failing.seen[0] == (96, 80) and set(failing.seen[1:]) == {(48, 48)}
    assert out.shape == (1, 3, 96 * SCALE, 80 * SCALE)


def test_out_of_memory_twice_is_an_out_of_memory_naming_the_upscaler_and_its_tiles(model_file: Path) -> None:
    f, failing = finisher(model_file, tile=64, limit=16)
    with pytest.raises(torch.OutOfMemoryError) as info:
        f._model("esr", noise())
    assert is_oom(info.value)  # so the compute thread's path fails the job with out_of_memory
    text = str(info.value)
    assert "\n" not in text and "upscaler 'esr' ran out of memory on a 80x96 picture in tiles of 64, and again " \
        "in tiles of 32: CUDA out of memory. Tried to allocate 4.00 GiB" in text
    assert "--upscaler esr=PATH,tile=N" in text
    assert {s for s in failing.seen} == {(64, 64), (32, 32)}  # once each: the first tile of each try


def test_other_errors_are_not_retried(model_file: Path) -> None:
    f, failing = finisher(model_file, tile=64, limit=1000)

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("not memory")

    f.upscalers.models["esr"] = broken
    with pytest.raises(RuntimeError, match="not memory"):
        f._model("esr", noise())
    assert f.oom_retries == 0 and failing.seen == []


def test_smaller_halves_the_side_that_ran_and_keeps_the_overlap_under_half() -> None:
    assert tiles.smaller(512, 32, 1024, 1024) == (256, 32)
    assert tiles.smaller(0, 32, 1024, 768) == (512, 32)  # whole: half the longer side
    assert tiles.smaller(512, 32, 300, 200) == (150, 32)  # ran whole (no side over a tile)
    assert tiles.smaller(40, 16, 100, 100) == (20, 9)
    assert tiles.smaller(16, 4, 100, 100) is None


# --- tiles chosen up front from the free memory (tiles.planned), with a fake free-memory figure

GiB = 2**30


def test_plenty_of_free_memory_keeps_serves_tiles_and_whole_pictures_whole() -> None:
    assert tiles.planned(512, 32, 1, 2048, 2048, 4, 12_000, 80 * GiB) == (512, 32)
    assert tiles.planned(0, 32, 1, 300, 200, 4, 12_000, 80 * GiB) == (0, 32)  # whole, and it fits
    assert tiles.planned(512, 32, 1, 300, 200, 4, 12_000, 80 * GiB) == (512, 32)


def test_a_short_card_gets_the_largest_tile_that_fits_never_above_serves_nor_below_the_floor() -> None:
    per_pixel, h, w, s = 12_000, 2048, 1536, 4  # about a 4x ESRGAN's, float32

    def need(t: int) -> float:
        return tiles.TILE_BATCH * t * t * per_pixel * tiles.PLAN_MARGIN + tiles.blend_bytes(1, h, w, s)

    for free in (2 * GiB, 6 * GiB, 10 * GiB):
        side, overlap = tiles.planned(512, 32, 1, h, w, s, per_pixel, free)
        assert MIN_TILE <= side < 512 and need(side) <= free * tiles.FREE_SHARE < need(side + 1), (free, side)
        assert overlap == 32
    assert tiles.planned(512, 32, 1, h, w, s, per_pixel, GiB) == (MIN_TILE, 7)  # nothing fits: the floor
    assert tiles.planned(512, 32, 1, h, w, s, per_pixel, 32 * GiB) == (512, 32)  # never above serve's


def test_whole_pictures_that_do_not_fit_at_once_are_tiled() -> None:
    side, overlap = tiles.planned(0, 32, 2, 1024, 1024, 4, 12_000, 16 * GiB)
    assert MIN_TILE <= side < 1024 and overlap == 32
    assert tiles.planned(0, 32, 2, 1024, 1024, 4, 12_000, 80 * GiB) == (0, 32)


def test_a_run_takes_the_planned_tiles_and_running_out_halves_those(model_file: Path, caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU nothing is measured, so the probe's figure and the free memory are set by hand: serve's
    tiles of 64 do not fit, 32 do; the model then runs out of memory above 16, so the retry is in tiles
    of 16 (half of what ran, not of serve's 64)."""
    import diffusiond.pipelines.upscalers as upscalers_module

    f, failing = finisher(model_file, tile=64, limit=16)
    per_pixel = 1000.0
    free = (tiles.TILE_BATCH * 32.5**2 * per_pixel * tiles.PLAN_MARGIN + tiles.blend_bytes(1, 96, 80, SCALE)) \
        / tiles.FREE_SHARE
    f.upscalers.per_pixel["esr"] = per_pixel
    monkeypatch.setattr(upscalers_module, "free_bytes", lambda _device: int(free))
    with caplog.at_level(logging.INFO):
        out = f._model("esr", noise())
    assert failing.seen[0] == (32, 32) and set(failing.seen[1:]) == {(16, 16)}
    assert "upscaler 'esr': 1 80x96 picture(s) in tiles of 32 (overlap 8) rather than tiles of 64" in caplog.text
    assert "ran out of memory on a 80x96 picture in tiles of 32; retrying in tiles of 16" in caplog.text
    assert out.shape == (1, 3, 96 * SCALE, 80 * SCALE)


# --- the serve flag and the TOML table


def test_upscaler_flag_takes_tile_and_overlap_and_keeps_the_old_form(tmp_path: Path) -> None:
    f = tmp_path / "x.pth"
    f.write_bytes(b"")
    comma = tmp_path / "4x,sharp.pth"  # a comma in the path, not followed by an option
    comma.write_bytes(b"")
    equals = tmp_path / "a,v=2.safetensors"  # and one whose last part looks like an option, but is the file
    equals.write_bytes(b"")
    got = build_config({}, {"upscaler": [f"a={f}", f"b={f},tile=256", f"c={f},tile=0,overlap=4",
                                         f"d={f},overlap=16,tile=64", f"e={comma}", f"g={equals},tile=64"]}).upscalers
    assert got == {"a": UpscalerSetting(path=str(f), tile=512, overlap=32),
                   "b": UpscalerSetting(path=str(f), tile=256, overlap=32),
                   "c": UpscalerSetting(path=str(f), tile=0, overlap=4),
                   "d": UpscalerSetting(path=str(f), tile=64, overlap=16),
                   "e": UpscalerSetting(path=str(comma), tile=512, overlap=32),
                   "g": UpscalerSetting(path=str(equals), tile=64, overlap=16)}


def test_upscalers_table_takes_strings_and_tables(tmp_path: Path) -> None:
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"")
    got = build_config({"upscalers": {"a": str(f), "b": f"{f},tile=128,overlap=8",
                                      "c": {"path": str(f), "tile": 64}}}, {}).upscalers
    assert [(s.tile, s.overlap) for s in got.values()] == [(512, 32), (128, 8), (64, 16)]  # a quarter of 64
    flags = build_config({"upscalers": {"a": str(f)}}, {"upscaler": [f"z={f},tile=32,overlap=0"]}).upscalers
    assert list(flags) == ["z"]  # the flags replace the table


@pytest.mark.parametrize(("value", "words"), [
    (["a=/m/x.pth,tile=abc"], "--upscaler a=/m/x.pth,tile=abc: tile 'abc' is not a whole number"),
    (["a=/m/x.pth,tile=8"], "--upscaler a=/m/x.pth,tile=8: tile 8 is not 0 (the whole picture at once) or a "
                            "side of 16 to 16384"),
    (["a=/m/x.pth,tile=-512"], "tile -512 is not 0"),
    (["a=/m/x.pth,tile=1.5"], "tile '1.5' is not a whole number"),
    (["a=/m/x.pth,overlap=-1"], "--upscaler a=/m/x.pth,overlap=-1: overlap -1 is negative"),
    (["a=/m/x.pth,tile=64,overlap=32"], "--upscaler a=/m/x.pth,tile=64,overlap=32: overlap 32 must be under half "
                                        "the tile (64)"),
    (["a=/m/x.pth,overlap=256"], "overlap 256 must be under half the tile (512)"),
    (["a=/m/x.pth,tiles=64"], "--upscaler a=/m/x.pth,tiles=64: unknown option 'tiles'"),
    (["a=/m/x.pth,tile=64,tile=32"], "tile is given twice"),
    (["a=,tile=64"], "--upscaler a=,tile=64: no path"),
    (["a"], "--upscaler wants NAME=PATH, NAME=PATH,tile=N or NAME=PATH,tile=N,overlap=N, got 'a'"),
    (["a=/m/x.pth", "a=/m/y.pth"], "upscaler name 'a' is given twice"),
    ({"a": {"path": "/m/x.pth", "tile": True}}, "[upscalers] a: tile true is not a whole number"),
    ({"a": {"path": "/m/x.pth", "size": 3}}, "[upscalers] a: a table takes path (a string), tile and overlap; "
                                             "unknown: size"),
    ({"a": {"tile": 64}}, "[upscalers] a: a table takes path"),
    ({"a": "/m/x.pth,overlap=40,tile=64"}, "[upscalers] a: overlap 40 must be under half the tile (64)"),
])
def test_bad_tiles_are_refused_naming_the_flag(value: Any, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_upscalers(value)
    assert words in str(info.value)


OPTION = st.sampled_from(["tile", "overlap", "tiles", "Tile", " tile ", "x", ""])
VALUE = st.integers(-(2**40), 2**40).map(str) | st.sampled_from(["", "0", "16", "32", "512", "1.5", "1e3", " 8 ",
                                                                "+64", "-0", "0x20", "٣٢"]) | st.text(max_size=6)
PIECE = st.tuples(OPTION, VALUE).map(lambda kv: f"{kv[0]}={kv[1]}") | st.text(max_size=8)
TOML_VALUE = st.one_of(st.integers(-(2**70), 2**70), st.booleans(), st.floats(), st.text(max_size=6),
                       st.lists(st.integers(), max_size=2), st.none())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "", " "]), st.sampled_from(["/m/x.pth", "", "/m/4x,y.pth"]),
                          st.lists(PIECE, max_size=3)), max_size=3)
       | st.dictionaries(st.sampled_from(["a", "b"]),
                         st.fixed_dictionaries({}, optional={"path": st.sampled_from(["/m/x.pth", ""]) | TOML_VALUE,
                                                             "tile": TOML_VALUE, "overlap": TOML_VALUE,
                                                             "other": TOML_VALUE})
                         | st.sampled_from(["/m/x.pth", "/m/x.pth,tile=64", "/m/x.pth,overlap=-1", ""])))
def test_fuzz_upscaler_settings_parse_to_valid_tiles_or_are_refused_naming_the_setting(value: Any) -> None:
    """Any flag list or table: a ConfigError naming ``--upscaler`` or ``[upscalers]`` (never another
    exception), or settings whose tiles the worker can run."""
    if isinstance(value, list):
        value = [f"{name}={path}" + "".join("," + p for p in pieces) for name, path, pieces in value]
    try:
        got = parse_upscalers(value)
    except ConfigError as exc:
        assert str(exc).startswith(("--upscaler", "[upscalers]", "upscaler name")), exc
        return
    for s in got.values():
        assert s.path.strip() and s.path.startswith("/")
        assert s.tile == 0 or MIN_TILE <= s.tile <= MAX_TILE, s
        assert s.overlap >= 0 and (s.tile == 0 or 2 * s.overlap < s.tile), s


async def test_a_daemon_upscaler_out_of_memory_retries_in_half_tiles_then_fails_only_its_job(
        daemon_factory: Any, model_file: Path) -> None:
    """The worker's fault ``upscale_oom=16``: an upscaler input with a side over 16 runs out of memory.
    ``small`` (tiles of 32) runs out, is retried in tiles of 16 and succeeds; ``big`` (tiles of 64, so
    a 64x64 picture runs whole) runs out in one piece and in tiles of 32, and its job fails with
    ``out_of_memory`` naming the upscaler, while the worker goes on."""
    from daemonkit import health, http, submit, wait_job

    d = daemon_factory("--model", "tiny", "--test-fault", "upscale_oom=16", "--job-timeout", "120",
                       "--upscaler", f"small={model_file},tile=32,overlap=8", "--upscaler", f"big={model_file},tile=64")
    body = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2, "seed": 7, "output_format": "npy"}
    async with http(d.socket) as s:
        pid = (await health(s))["workers"][0]["pid"]
        ok = await wait_job(s, (await submit(s, {**body, "upscale": {"name": "small"}}))["id"])
        async with s.get(ok["outputs"][0]["url"]) as r:
            picture = np.load(io.BytesIO(await r.read()))
        failed = await wait_job(s, (await submit(s, {**body, "upscale": {"name": "big"}}))["id"])
        after = await wait_job(s, (await submit(s, body))["id"])
        assert (await health(s))["workers"][0]["pid"] == pid, "no worker was replaced"
    assert ok["status"] == "succeeded", ok
    assert picture.shape == (128, 128, 3)
    assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory", failed
    assert "upscaler 'big' ran out of memory on a 64x64 picture in one piece, and again in tiles of 32" \
        in failed["error"]["message"], failed["error"]
    assert after["status"] == "succeeded", after
    log = d.log_path.read_text(errors="replace")
    assert "upscaler 'small' ran out of memory on a 64x64 picture in tiles of 32; retrying in tiles of 16" in log
