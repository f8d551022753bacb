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
    ],
)
def test_config_errors_name_the_setting(overrides: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_config({}, overrides)


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
    assert default_socket_path({"RUNTIME_DIRECTORY": "/run/diffusiond"}) == "/run/diffusiond/diffusiond.sock"
    assert default_socket_path({"XDG_RUNTIME_DIR": "/x"}) == "/x/diffusiond/diffusiond.sock"
    assert default_socket_path({}).startswith("/tmp/diffusiond-")


def test_device_cuda_without_a_gpu_is_a_config_error_naming_the_flag() -> None:
    import torch

    from diffusiond.daemon.config import parse_devices

    if torch.cuda.is_available():
        assert parse_devices("cuda", 1) == tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    else:
        with pytest.raises(ConfigError, match="--device cuda, but no CUDA device is visible"):
            parse_devices("cuda", 1)
