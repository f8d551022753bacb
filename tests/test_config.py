"""Configuration: TOML file, flag overrides, validation messages that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusiond.daemon.config import ConfigError, build_config, default_socket_path, load_toml, parse_model_arg


def test_config_file_models_and_flag_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        'max_batch = 8\nbatch_wait_ms = 5\nsocket_mode = "0660"\n[limits]\nmax_n = 4\n'
        '[[models]]\nname = "a"\nspec = "tiny"\nworkers = 2\n'
        '[[models]]\nspec = "synthetic:compute_ms=5"\n[models.options]\nmatrix = 64\n'
    )
    cfg = build_config(load_toml(f), {"max_batch": 2})
    assert cfg.max_batch == 2 and cfg.batch_wait_ms == 5 and cfg.socket_mode == 0o660
    assert cfg.limits.max_n == 4 and cfg.limits.max_steps == 500
    assert [(m.name, m.devices) for m in cfg.models] == [("a", ("cpu", "cpu")), ("synthetic", ("cpu",))]
    assert cfg.models[1].options == {"matrix": "64"}
    # --model on the command line replaces the file's list
    assert [m.name for m in build_config(load_toml(f), {"model": ["x=tiny"]}).models] == ["x"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"output_mode": "fast"}, "output_mode"),
        ({"log_level": "loud"}, "log_level"),
        ({"socket_mode": "rw-"}, "socket_mode"),
        ({"tcp": "127.0.0.1:9"}, "token"),
        ({"max_batch": 0}, "max_batch"),
        ({"model": ["a=tiny", "a=tiny"]}, "unique"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "tpu"),
        ({"bogus": 1}, "bogus"),
        # what a TOML file can hold that the flags never give: each refused naming the setting, not with a traceback
        # from the arithmetic after (or at the first worker start, or the first crash)
        ({"arena_mb": 1.5}, r"arena_mb must be a whole number, got 1\.5"),
        ({"encode_threads": 2.5}, "encode_threads must be a whole number"),
        ({"png_compress_level": 4.5}, "png_compress_level must be a whole number"),
        ({"queue_size": "10"}, "queue_size must be a whole number, got '10'"),
        ({"persist": "no"}, "persist must be true or false"),
        ({"allow_uid": 1000}, r"allow_uid must be a list, like allow_uid = \[1000\], got 1000 \(int\)"),
        ({"allow_uid": ["me"]}, "allow_uid must be a list, each item a whole number"),
        ({"restart_backoff_s": 5}, "restart_backoff_s must be a list"),
        ({"restart_backoff_s": []}, r"restart_backoff_s must list one or more waits .* got \[\]"),
        ({"restart_backoff_s": ["a"]}, "restart_backoff_s must be a list, each item a number"),
        ({"restart_backoff_s": [1.0, -1.0]}, "restart_backoff_s must list one or more waits in seconds, none negative"),
        ({"restart_backoff_s": [float("nan")]}, "restart_backoff_s must be a finite number"),
        ({"limits": {"bogus": 1}}, r"unknown \[limits\] setting\(s\): bogus; fix or remove them \(known: max_prom"),
        ({"limits": {"max_stpes": 1}},
         r"max_stpes \(did you mean max_steps or max_size\?\); .* \(known: max_steps, max_size, max_prom"),
        ({"max_bach": 1}, r"unknown setting\(s\): max_bach \(did you mean max_batch\?\); fix or remove them"),
        ({"device_memory": True}, r"device_memory must be a string or a number, got True \(bool\)"),
        ({"host_memory": 0.5}, "host_memory 0.5: a share is for --device-memory only"),
        ({"models": {"spec": "tiny"}}, r"models must be an array of tables, got \{'spec': 'tiny'\}: .* \[\[models\]\]"),
        ({"models": [{"name": "sd", "spec": "tiny", "workers": "two"}]}, "model 'sd': workers must be a whole number"),
        ({"limits": {"max_n": "4"}}, "limits.max_n must be a whole number"),
        ({"limits": {"max_timeout_s": float("nan")}}, "limits.max_timeout_s must be a finite number"),
        ({"workers": "two"}, "workers must be a whole number, like 2; got 'two'"),
        ({"worker_start_timeout_s": 0}, "worker_start_timeout_s must be positive"),
        ({"worker_start_timeout_s": -5.0}, "worker_start_timeout_s must be positive"),
        ({"socket_mode": 600}, r"socket_mode 600 \(octal 1130\) is not a permission mode .* \"0600\", or as 0o600"),
        ({"tcp": "localhost:http", "token_file": "/dev/null"}, "--tcp wants HOST:PORT with a port of 0-65535"),
        ({"tcp": "::1:8080", "token_file": "/dev/null"}, "--tcp: put an IPv6 address in brackets"),
    ],
)
def test_config_errors_name_the_setting(overrides: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_config({}, overrides)


def test_a_config_files_nan_or_inf_is_refused_naming_the_setting(tmp_path: Path) -> None:
    """TOML has nan and inf, which the flags refuse: a grace of nan made a stop wait forever."""
    for text, name in (("drain_grace_s = nan", "drain_grace_s"), ("orphan_grace_s = inf", "orphan_grace_s"),
                       ("job_timeout_s = -inf", "job_timeout_s")):
        f = tmp_path / "c.toml"
        f.write_text(text + "\n")
        with pytest.raises(ConfigError, match=f"{name} must be a finite number"):
            build_config(load_toml(f), {"model": ["tiny"], "device": "cpu"})


def test_config_bad_toml_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("max_batch = = 3")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_toml(f)


def test_config_model_names() -> None:
    assert parse_model_arg("tiny") == ("tiny", "tiny")
    assert parse_model_arg("sd=/models/sd15") == ("sd", "/models/sd15")
    assert parse_model_arg("org/model") == ("org/model", "org/model")
    assert parse_model_arg("/ckpt/dreamshaper.safetensors") == ("dreamshaper", "/ckpt/dreamshaper.safetensors")


def test_config_socket_path_order() -> None:
    assert default_socket_path({"DIFFUSIOND_SOCKET": "/a", "XDG_RUNTIME_DIR": "/x"}) == "/a"
    assert default_socket_path({"XDG_RUNTIME_DIR": "/x"}) == "/x/diffusiond/diffusiond.sock"
    assert default_socket_path({}).startswith("/tmp/diffusiond-")


def test_device_cuda_without_a_gpu_is_a_config_error_naming_the_flag() -> None:
    import torch

    from diffusiond.daemon.devices import parse_devices

    if torch.cuda.is_available():
        assert parse_devices("cuda", 1) == tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    else:
        with pytest.raises(ConfigError, match="--device cuda, but no CUDA device is visible"):
            parse_devices("cuda", 1)


@pytest.mark.parametrize(("visible", "expected"), [
    (None, 4), ("", 0), ("2", 1), ("0,3", 2), ("1,7,2", 1), ("-1", 0), ("0,-1,1", 1), ("GPU-5d1a", None),
])
def test_devices_counted_by_nvml_as_cuda_will_show_them(monkeypatch: pytest.MonkeyPatch, visible: str | None,
                                                        expected: int | None) -> None:
    """``--device cuda`` counts its GPUs through NVML (no torch child before the socket listens), and a
    CUDA_VISIBLE_DEVICES list counts as CUDA reads it: up to its first entry that is no device; a
    UUID list is left to torch (None)."""
    import sys
    import types

    from diffusiond.daemon.devices import _nvml_count

    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 4)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert _nvml_count(visible) == expected


def test_device_count_without_nvml_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from diffusiond.daemon.devices import _nvml_count

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    assert _nvml_count(None) is None


def test_preload_flag_toml_and_tables_in_their_order_of_precedence(tmp_path: Path) -> None:
    from diffusiond.daemon.residency.preload import choose

    f = tmp_path / "c.toml"
    f.write_text('preload = "b"\n[[models]]\nname = "a"\nspec = "tiny"\npreload = true\n'
                 '[[models]]\nname = "b"\nspec = "tiny"\n[[models]]\nname = "c"\nspec = "tiny"\npreload = false\n')
    cfg = build_config(load_toml(f), {})
    assert cfg.preload == ("b",) and [m.preload for m in cfg.models] == [True, None, False]
    # a table's own word wins over the file's top level; the top level decides for the rest
    assert {n: w for n, (w, _) in choose([(m.name, m.preload) for m in cfg.models], cfg.preload, False).items()} \
        == {"a": True, "b": True, "c": False}
    # --preload replaces every word of the file, the tables' own included
    flag = build_config(load_toml(f), {"preload": ["c"]})
    assert flag.preload == ("c",) and all(m.preload is None for m in flag.models)
    assert [w for w, _ in choose([(m.name, m.preload) for m in flag.models], flag.preload, False).values()] \
        == [False, False, True]
    # repeatable and comma lists, in the order given, each name once
    assert build_config({}, {"model": ["a=tiny", "b=tiny"], "preload": ["b,a", "b"]}).preload == ("b", "a")
    assert build_config({"preload": False}, {}).preload == ("none",)
    assert build_config({"preload": ["all"]}, {}).preload == ("all",)


def test_preload_default_is_what_fits_and_none_when_socket_activated() -> None:
    from diffusiond.daemon.residency.preload import choose

    models = [("a", None), ("b", True)]
    assert {n: w for n, (w, _) in choose(models, None, False).items()} == {"a": True, "b": True}
    # socket-activated: nothing the configuration did not ask for; an explicit word still counts
    assert {n: w for n, (w, _) in choose(models, None, True).items()} == {"a": False, "b": True}
    assert {n: w for n, (w, _) in choose([("a", None)], ("all",), True).items()} == {"a": True}
    assert "socket-activated" in choose(models, None, True)["a"][1]


@pytest.mark.parametrize(
    ("values", "overrides", "words"),
    [
        ({}, {"model": ["a=tiny", "b=tiny"], "preload": ["c"]}, r"--preload c: no such model \(models: a, b"),
        ({}, {"preload": ["tiny,all"]}, "'all' stands alone"),
        ({}, {"preload": [" , "]}, "preload is empty; give model names"),
        ({"preload": 3}, {}, "preload 3 is not a model name"),
        ({"models": [{"name": "a", "spec": "tiny", "preload": "no"}]}, {},
         "model 'a': preload 'no' is not true or false"),
    ],
)
def test_preload_errors_name_the_value_and_what_is_accepted(values: dict[str, object], overrides: dict[str, object],
                                                            words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_config(values, overrides)


def test_the_default_device_is_every_gpu_only_where_torch_can_use_them(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """No ``--device``: the CPU on a machine without an NVIDIA driver, and on one whose torch is a CPU build (its
    workers could not use a GPU), each saying why for the start's log; every GPU where both are there."""
    import importlib.machinery

    import diffusiond.daemon.devices as devices

    real_isdir, real_listdir = devices.os.path.isdir, devices.os.listdir
    gpus = "/proc/driver/nvidia/gpus"
    if not real_isdir(gpus):  # this machine: no driver
        cfg = build_config({}, {"model": ["x=tiny"]})
        assert cfg.models[0].devices == ("cpu",) and cfg.device_auto == "cpu (no NVIDIA GPU on this machine)"
    monkeypatch.setattr(devices.os.path, "isdir", lambda p: p == gpus or real_isdir(p))
    monkeypatch.setattr(devices.os, "listdir", lambda p: ["0000:01:00.0"] if p == gpus else real_listdir(p))
    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(torch_dir)]
    monkeypatch.setattr(devices.importlib.util, "find_spec", lambda name: spec if name == "torch" else None)
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)
    (torch_dir / "version.py").write_text("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\n")
    cfg = build_config({}, {"model": ["x=tiny"]})
    assert cfg.models[0].devices == ("cpu",) and "torch here is a CPU build" in cfg.device_auto
    (torch_dir / "version.py").write_text("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\n")
    cfg = build_config({}, {"model": ["x=tiny"]})
    assert cfg.models[0].devices == ("cuda:0", "cuda:1"), cfg.models[0].devices
    assert cfg.device_auto == "cuda:0,cuda:1 (2 GPU(s) visible, torch built for CUDA 13.0)"
    assert build_config({}, {"model": ["x=tiny"], "device": "cpu"}).device_auto == ""  # asked for: nothing to say


def test_a_models_dtype_defaults_to_bfloat16_on_a_gpu_and_float32_on_the_cpu(tmp_path: Path) -> None:
    """Float32 on a GPU doubled every model's memory for nothing its pictures show; a given
    dtype, top level or per table, wins."""
    assert build_config({}, {"model": ["x=tiny"], "device": "cpu"}).models[0].dtype == "float32"
    assert build_config({}, {"model": ["x=tiny"], "device": "cuda:0"}).models[0].dtype == "bfloat16"
    assert build_config({}, {"model": ["x=tiny"], "device": "cuda:0", "dtype": "float16"}).models[0].dtype == "float16"
    f = tmp_path / "d.toml"
    f.write_text('[[models]]\nname = "g"\nspec = "tiny"\ndevice = "cuda:1"\n\n'
                 '[[models]]\nname = "c"\nspec = "tiny"\n\n'
                 '[[models]]\nname = "h"\nspec = "tiny"\ndevice = "cuda:0"\ndtype = "float16"\n')
    cfg = build_config(load_toml(f), {"device": "cpu"})
    assert {m.name: m.dtype for m in cfg.models} == {"g": "bfloat16", "c": "float32", "h": "float16"}


def test_a_misspelled_key_in_a_models_table_refuses_the_start_naming_the_model_the_key_and_the_right_one(
        tmp_path: Path) -> None:
    """A key a [[models]] table does not take was dropped without a word: ``max_bach = 16`` served the model at the
    daemon's batch and ``pinned = true`` left it unpinned. Refused like an unknown top-level setting, with the key
    it was likely meant to be and every key a table takes."""
    f = tmp_path / "d.toml"
    f.write_text('[[models]]\nname = "sd"\nspec = "tiny"\nmax_bach = 16\npinned = true\n')
    with pytest.raises(ConfigError) as caught:
        build_config(load_toml(f), {"device": "cpu"})
    message = str(caught.value)
    assert message.startswith("unknown key(s) in the [[models]] table of model 'sd': max_bach (did you mean "
                              "max_batch?), pinned (did you mean pin?); fix or remove them"), message
    assert "(known: max_batch, pin, name, spec, device," in message and "batch_sizes" in message
    with pytest.raises(ConfigError, match=r"^\[\[models\]\] entry 1 is 'tiny', not a table"):
        build_config({"models": ["tiny"]}, {"device": "cpu"})
    # every key it takes still goes through
    f.write_text('[[models]]\nname = "sd"\nspec = "tiny"\nmax_batch = 16\npin = true\nworkers = 1\ndtype = "float32"\n'
                 'keep_alive = "5m"\npreload = false\nbatch_sizes = "any"\ncompile = false\nwarmup = ""\n'
                 'offload = "none"\n[models.options]\n')
    (m,) = build_config(load_toml(f), {"device": "cpu"}).models
    assert (m.name, m.max_batch, m.pinned, m.keep_alive_s, m.preload) == ("sd", 16, True, 300.0, False)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # sizes as parse_size reads them: a TOML int is bytes, a float a share of the device (docs/api.md's 0.8)
        ("device_memory = 0.8", {"device_memory": 0.8}),
        ("device_memory = 8000000000", {"device_memory": 8_000_000_000}),
        ('device_memory = "8GiB"', {"device_memory": "8GiB"}),
        ("host_memory = 16000000000", {"host_memory_bytes": 16_000_000_000}),
        ("reserve_memory = 2000000000", {"reserve_memory_bytes": 2_000_000_000}),
        # durations as parse_duration reads them: seconds or text with units
        ("keep_alive = 300", {"keep_alive_s": 300.0}),
        ('keep_alive = "5m"', {"keep_alive_s": 300.0}),
        ("keep_alive = -1", {"keep_alive_s": float("inf")}),
        ('max_keep_alive = "1h"', {"max_keep_alive_s": 3600.0}),
        ("max_model_wait = 45", {"max_model_wait_s": 45.0}),
        ('max_model_wait = "2m"', {"max_model_wait_s": 120.0}),
        # whole numbers where a number is declared, lists where the field is a tuple, one word for a list
        ("job_timeout_s = 10\nkeep_days = 1\nbatch_wait_ms = 5", {"job_timeout_s": 10, "keep_days": 1}),
        ("restart_backoff_s = [1, 2.5]\nallow_uid = [1000]", {"restart_backoff_s": (1, 2.5), "allow_uid": (1000,)}),
        ('pin = "tiny"', {"pin": ("tiny",)}),
        ('pin = ["tiny"]\npreload = "tiny"', {"pin": ("tiny",), "preload": ("tiny",)}),
        ('socket_mode = "0660"', {"socket_mode": 0o660}),
        ("[limits]\nmax_timeout_s = 100\nmax_lora_weight = 2", {}),
        ('[[models]]\nspec = "tiny"\nworkers = "2"\nkeep_alive = 60', {}),
    ],
)
def test_every_form_a_settings_reader_takes_starts_the_daemon(tmp_path: Path, text: str,
                                                               expected: dict[str, object]) -> None:
    """A TOML file hands numbers over typed: the type check before validation refused device_memory = 0.8, which
    the size reader takes (and the docs show) as a share of the device, and stopped the start."""
    f = tmp_path / "c.toml"
    f.write_text(text + "\n")
    cfg = build_config(load_toml(f), {"device": "cpu"})
    assert {k: getattr(cfg, k) for k in expected} == expected
