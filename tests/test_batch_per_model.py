"""Each model batches up to its own ``max_batch`` in its own ``batch_sizes`` (a ``[[models]]`` table's keys,
over the top-level ones): one daemon serving a small model in batches of 16 and a large one in batches of 1."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemonkit import Daemon, http, shared_daemon, submit, wait_job
from test_batch_sizes import BODY, batches, job

from diffusiond.daemon.config import ConfigError, build_config, load_toml
from diffusiond.daemon.core.scheduler import Scheduler

TABLES = ('max_batch = 4\n'
          '[[models]]\nname = "small"\nspec = "tiny"\nmax_batch = 16\n'
          '[[models]]\nname = "large"\nspec = "tiny"\nmax_batch = 1\n'
          '[[models]]\nname = "odd"\nspec = "tiny"\nmax_batch = 6\nbatch_sizes = "pow2"\n'
          '[[models]]\nname = "padded"\nspec = "tiny"\ncompile = true\nbatch_sizes = "any"\n'
          '[[models]]\nname = "plain"\nspec = "tiny"\n')


def config_of(tmp_path: Path, text: str) -> Any:
    toml = tmp_path / "d.toml"
    toml.write_text(text)
    return build_config(load_toml(toml), {})


def test_a_table_s_own_max_batch_and_batch_sizes_win_over_the_top_level(tmp_path: Path) -> None:
    config = config_of(tmp_path, TABLES)
    got = {m.name: (config.max_batch_of(m), config.batch_sizes_of(m)) for m in config.models}
    assert got == {"small": (16, tuple(range(1, 17))), "large": (1, (1,)), "odd": (6, (1, 2, 4, 6)),
                   "padded": (4, (1, 2, 3, 4)), "plain": (4, (1, 2, 3, 4))}


def test_warmup_is_checked_against_the_model_s_own_max(tmp_path: Path) -> None:
    config = config_of(tmp_path, 'max_batch = 2\n[[models]]\nname = "c"\nspec = "tiny"\ncompile = true\n'
                                 'max_batch = 8\nwarmup = "64x64:all"\n')
    assert config.models[0].warmup == tuple((64, 64, b) for b in (1, 2, 4, 8))  # its powers of two, to its 8
    with pytest.raises(ConfigError) as exc:
        config_of(tmp_path, 'max_batch = 8\n[[models]]\nname = "flux"\nspec = "tiny"\nmax_batch = 1\n'
                            'warmup = "64x64:4"\n')
    assert all(w in str(exc.value) for w in ("model 'flux'", "64x64:4", "max_batch 1")), str(exc.value)


@pytest.mark.parametrize(("line", "words"), [
    ("max_batch = 0", ["max_batch", "at least 1", "got 0"]),
    ("max_batch = -3", ["max_batch", "got -3"]),
    ('max_batch = "16"', ["max_batch", "got '16'", "whole number"]),
    ("max_batch = true", ["max_batch", "got True"]),
    ("max_batch = 2.5", ["max_batch", "got 2.5"]),
    ('batch_sizes = "odd"', ["batch_sizes 'odd'", "auto, pow2, any"]),
    ("batch_sizes = 4", ["batch_sizes 4", "auto, pow2, any"]),
])  # fmt: skip
def test_a_bad_value_in_a_table_refuses_the_start_naming_the_model(tmp_path: Path, line: str,
                                                                   words: list[str]) -> None:
    with pytest.raises(ConfigError) as exc:
        config_of(tmp_path, f'[[models]]\nname = "sd15"\nspec = "tiny"\n{line}\n')
    assert all(w in str(exc.value) for w in ["model 'sd15'", "[[models]] table", *words]), str(exc.value)


def test_the_top_level_value_is_refused_in_the_same_words(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^max_batch must be a whole number of at least 1, got '4'"):
        config_of(tmp_path, 'max_batch = "4"\n')


def test_a_model_s_batch_is_full_at_its_own_max() -> None:
    s = Scheduler(queue_size=100, max_batch=4, batch_wait_s=0, sizes={"m": tuple(range(1, 9)), "big": (1,)})
    for _ in range(3):
        s.admit(job())
    assert s.next_batch("m", now=0.0, partial_ok=False) is None  # 3 of its 8: a busy worker waits for more
    for _ in range(6):
        s.admit(job())
    got = s.next_batch("m", now=0.0, partial_ok=False)
    assert isinstance(got, list) and len(got) == 8  # past the daemon's 4
    assert (s.full_batch("m"), s.full_batch("big"), s.full_batch("unknown")) == (8, 1, 4)


# a daemon serving two models with batches of their own ----------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("permodel")
    toml = root / "d.toml"
    toml.write_text('max_batch = 4\njob_timeout_s = 300\n'
                    '[[models]]\nname = "small"\nspec = "tiny"\nmax_batch = 6\nbatch_sizes = "pow2"\n'
                    '[[models]]\nname = "large"\nspec = "tiny"\nmax_batch = 2\n')
    with shared_daemon(root, ["--config", str(toml)], model_cache) as d:
        yield d


SIZES = {"small": (1, 2, 4, 6), "large": (1, 2)}


async def test_the_start_log_and_the_models_list_say_each_model_s_own_sizes(daemon: Daemon) -> None:
    async with http(daemon.socket) as s, s.get("/v1/models") as r:
        entries = {m["id"]: m for m in (await r.json())["data"]}
    assert {name: tuple(entries[name]["batch_sizes"]) for name in SIZES} == SIZES
    log = daemon.log_path.read_text(errors="replace")
    assert "model small: batches of up to 6 (its max_batch; the daemon's is 4)" in log, log[-3000:]
    assert "model small: batches of 1, 2, 4, 6 only (its batch_sizes pow2)" in log
    assert "model large: batches of up to 2 (its max_batch; the daemon's is 4)" in log
    assert "model large: batches of 1" not in log  # every size up to its own max: nothing to say


async def test_each_model_s_batches_respect_its_own_max(daemon: Daemon) -> None:
    async with http(daemon.socket) as s:
        small = await wait_job(s, (await submit(s, {**BODY, "model": "small", "n": 7}))["id"], timeout=300)
        large = await wait_job(s, (await submit(s, {**BODY, "model": "large", "n": 5}))["id"], timeout=300)
        # both models' clients at once, of 1 to 3 outputs each
        ids = await asyncio.gather(*(submit(s, {**BODY, "model": name, "n": 1 + k % 3, "seed": k})
                                     for k in range(8) for name in SIZES))
        crowd = [await wait_job(s, j["id"], timeout=300) for j in ids]
    assert all(j["status"] == "succeeded" for j in [small, large, *crowd]), [small, large, *crowd]
    assert batches([small]) == [6, 1]  # past the daemon's max_batch 4: its own 6
    assert batches([large]) == [2, 2, 1]  # below it: its own 2
    for name, sizes in SIZES.items():
        mine = batches([j for j in crowd if j["model"] == name])
        assert sum(mine) == sum(1 + k % 3 for k in range(8)) and set(mine) <= set(sizes), (name, mine)
