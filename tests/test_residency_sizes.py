"""Weight bytes from safetensors headers, checked against tensors written here, and every malformed header
refused with an error that names its file (the engine reads these from untrusted folders)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from diffusiond.daemon.residency import sizes
from diffusiond.daemon.residency.sizes import WeightsError, choose_variant, component_files, model_weights, read_header


def tensors(seed: int, dtype: type = np.float32, n: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal((4 + i, 3 + seed % 5)).astype(dtype) for i in range(n)}


def nbytes(ts: dict[str, np.ndarray]) -> int:
    return sum(t.nbytes for t in ts.values())


def raw_file(path: Path, header: bytes | str, data: bytes = b"", length: int | None = None) -> Path:
    body = header.encode() if isinstance(header, str) else header
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def test_a_single_checkpoint_counts_its_tensors_real_bytes(tmp_path: Path) -> None:
    ts = {**tensors(1), "step": np.arange(5, dtype=np.int64), "mask": np.ones((3, 3), dtype=np.bool_)}
    save_file(ts, str(tmp_path / "m.safetensors"), metadata={"format": "pt", "note": "{[not json, a string]}"})
    w = model_weights(tmp_path / "m.safetensors")
    assert w.stored_bytes == nbytes(ts)
    assert w.files[0].tensors == len(ts)
    floats = nbytes(tensors(1))
    # loaded as float16, the fp32 tensors take half; the int64 and bool tensors stay as stored
    assert w.bytes_at("float16") == floats // 2 + 5 * 8 + 9
    assert w.bytes_at("bfloat16") == w.bytes_at("float16")
    assert w.bytes_at("float32") == w.stored_bytes


def test_fp16_weights_loaded_at_float32_double(tmp_path: Path) -> None:
    ts = tensors(2, np.float16)
    save_file(ts, str(tmp_path / "h.safetensors"))
    f = read_header(tmp_path / "h.safetensors")
    assert f.bytes_by_dtype == {"F16": nbytes(ts)}
    assert f.bytes_at("float32") == 2 * nbytes(ts)


def test_a_bf16_header_written_by_hand(tmp_path: Path) -> None:
    header = json.dumps({"a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                         "b": {"dtype": "F4", "shape": [3], "data_offsets": [12, 14]}})
    f = read_header(raw_file(tmp_path / "b.safetensors", header, bytes(14)))
    assert f.bytes_by_dtype == {"BF16": 12, "F4": 2}
    assert f.bytes_at("float32") == 24 + 2  # fp4 storage is not converted


def diffusers_folder(root: Path) -> dict[str, dict[str, np.ndarray]]:
    """A pipeline folder as diffusers writes it: a unet with fp32 and fp16 files, a sharded text encoder,
    a vae with only its fp16 variant, and components with no weights."""
    root.mkdir()
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"], "scheduler": ["diffusers", "EulerDiscreteScheduler"],
        "tokenizer": ["transformers", "CLIPTokenizer"], "safety_checker": [None, None]}))
    for sub in ("unet", "vae", "text_encoder", "scheduler", "tokenizer"):
        (root / sub).mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    made = {"unet": tensors(3), "unet16": {k: v.astype(np.float16) for k, v in tensors(3).items()},
            "vae16": tensors(4, np.float16), "te1": tensors(5), "te2": tensors(6)}
    save_file(made["unet"], str(root / "unet" / "diffusion_pytorch_model.safetensors"))
    save_file(made["unet16"], str(root / "unet" / "diffusion_pytorch_model.fp16.safetensors"))
    save_file(made["vae16"], str(root / "vae" / "diffusion_pytorch_model.fp16.safetensors"))
    shards = {"model-00001-of-00002.safetensors": made["te1"], "model-00002-of-00002.safetensors": made["te2"]}
    weight_map = {}
    for name, ts in shards.items():
        save_file(ts, str(root / "text_encoder" / name))
        weight_map.update({k + name[:11]: name for k in ts})
    (root / "text_encoder" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return made


def test_a_diffusers_folder_sums_its_components_and_picks_the_variant_its_dtype_implies(tmp_path: Path) -> None:
    made = diffusers_folder(tmp_path / "sd")
    te = nbytes(made["te1"]) + nbytes(made["te2"])
    w32 = model_weights(tmp_path / "sd", "float32")
    assert set(w32.components) == {"unet", "vae", "text_encoder", "scheduler", "tokenizer"}
    assert [f.path.name for f in w32.components["unet"]] == ["diffusion_pytorch_model.safetensors"]
    assert [f.path.name for f in w32.components["vae"]] == ["diffusion_pytorch_model.fp16.safetensors"]
    assert len(w32.components["text_encoder"]) == 2 and w32.components["scheduler"] == ()
    assert w32.stored_bytes == nbytes(made["unet"]) + nbytes(made["vae16"]) + te
    assert w32.bytes_at("float32") == nbytes(made["unet"]) + 2 * nbytes(made["vae16"]) + te

    w16 = model_weights(tmp_path / "sd", "float16")
    assert [f.path.name for f in w16.components["unet"]] == ["diffusion_pytorch_model.fp16.safetensors"]
    assert w16.stored_bytes == nbytes(made["unet16"]) + nbytes(made["vae16"]) + te
    # whichever files are read, the bytes on the device are those of the dtype
    assert w16.bytes_at("float16") == w32.bytes_at("float16") == w32.bytes_at("float32") // 2

    chosen = model_weights(tmp_path / "sd", "float32", variant="fp16")
    assert [f.path.name for f in chosen.components["unet"]] == ["diffusion_pytorch_model.fp16.safetensors"]


def test_a_sharded_variant_index_and_a_component_folder_alone(tmp_path: Path) -> None:
    ts16, ts32 = tensors(7, np.float16), tensors(7)
    save_file(ts16, str(tmp_path / "diffusion_pytorch_model.fp16-00001-of-00001.safetensors"))
    (tmp_path / "diffusion_pytorch_model.safetensors.index.fp16.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(ts16, "diffusion_pytorch_model.fp16-00001-of-00001.safetensors")}))
    save_file(ts32, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    assert sum(f.stored_bytes for f in component_files(tmp_path, "float16")) == nbytes(ts16)
    assert model_weights(tmp_path, "float32").stored_bytes == nbytes(ts32)
    assert model_weights(tmp_path, "bfloat16").stored_bytes == nbytes(ts32)  # no bf16 variant: the plain files


def test_the_variant_rule() -> None:
    assert choose_variant({"", "fp16"}, "float16") == "fp16"
    assert choose_variant({"", "fp16"}, "float32") == ""
    assert choose_variant({"", "fp16"}, "bfloat16") == ""
    assert choose_variant({"fp16"}, "float32") == "fp16"
    assert choose_variant({"bf16", "fp16"}, "bfloat16") == "bf16"
    assert choose_variant({"fp16", "ema"}, "float32") == "ema"  # no plain files: the first by name
    assert choose_variant({"", "ema"}, "float32", variant="ema") == "ema"
    assert choose_variant(set(), "float16") is None


def test_long_digit_runs_in_metadata_text_are_fine(tmp_path: Path) -> None:
    ts = tensors(9)
    save_file(ts, str(tmp_path / "m.safetensors"), metadata={"seed": "9" * 40, "hash": "1" * 64})
    assert read_header(tmp_path / "m.safetensors").stored_bytes == nbytes(ts)


def test_a_checkpoint_named_with_dots_is_no_variant(tmp_path: Path) -> None:
    ts = tensors(8)
    save_file(ts, str(tmp_path / "sd_xl_base_1.0.safetensors"))
    assert model_weights(tmp_path).stored_bytes == nbytes(ts)


@pytest.mark.parametrize(("name", "header", "data", "length", "expected"), [
    ("short", b"", b"", None, "shorter than the 8-byte"),
    ("huge", b"{}", b"", sizes.MAX_HEADER_BYTES + 1, "over the limit of 100000000"),
    ("past-end", b"{}", b"", 10_000, "truncated: its header length is 10000"),
    ("not-json", "{hello", b"", None, "not valid JSON"),
    ("not-utf8", b'{"\xff": 1}', b"", None, "not UTF-8"),
    ("list", "[1, 2]", b"", None, "not a JSON object"),
    ("deep", "[" * 100_000 + "]" * 100_000, b"", None, "nested too deeply"),
    ("deep-object", '{"a": ' * 100_000 + "1" + "}" * 100_000, b"", None, "nested too deeply"),
    ("deep-unclosed", "[" * 100_000, b"", None, "nested too deeply"),
    ("deep-shape", '{"a": {"dtype": "F32", "shape": [[[[1]]]], "data_offsets": [0, 4]}}', bytes(4), None,
     "shape must be a list of non-negative integers"),
    ("big-number", '{"a": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}', b"", None,
     "5000 digits"),
    ("big-number-in-a-large-header", '{"m": "' + "x" * 17_000_000 + '", "a": ' + "9" * 5000 + "}", b"", None,
     "its safetensors header holds a number of more than 20 digits and is 17005016 bytes long"),
    ("nan", '{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', b"", None, "NaN is not a number"),
    ("entry", '{"a": 3}', b"", None, "tensor 'a': expected an object"),
    ("dtype", '{"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}', bytes(4), None, "unknown dtype 'Q7'"),
    ("float-dim", '{"a": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}', bytes(4), None,
     "shape must be a list of non-negative integers"),
    ("bool-dim", '{"a": {"dtype": "F32", "shape": [true], "data_offsets": [0, 4]}}', bytes(4), None,
     "shape must be"),
    ("negative", '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}', bytes(4), None,
     "data_offsets must be [start, end]"),
    ("backwards", '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', bytes(4), None,
     "0 <= start <= end"),
    ("three", '{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}', bytes(8), None, "data_offsets"),
    ("mismatch", '{"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 4]}}', bytes(16), None,
     "holds 4 bytes but its dtype F32 and shape [2, 2] need 16 bytes"),
    ("hostile-shape", '{"a": {"dtype": "F32", "shape": [' + ", ".join(["4611686018427387904"] * 2000)
     + '], "data_offsets": [0, 4]}}', bytes(4), None, "more than the file's 4 bytes"),
    ("truncated-data", '{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', bytes(8), None,
     "ends at byte 16 of the data, but the file holds only 8"),
])
def test_malformed_headers_are_refused_naming_the_file(tmp_path: Path, name: str, header: bytes | str, data: bytes,
                                                       length: int | None, expected: str) -> None:
    path = tmp_path / f"{name}.safetensors"
    if name == "short":
        path.write_bytes(b"\x01\x02")
    else:
        raw_file(path, header, data, length)
    started = time.monotonic()
    with pytest.raises(WeightsError) as err:
        read_header(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)
    assert time.monotonic() - started < 5


def test_folder_faults_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"pickle")
    with pytest.raises(WeightsError, match=r"x\.bin: only \.safetensors"):
        model_weights(tmp_path / "x.bin")
    with pytest.raises(WeightsError, match="no such file or folder"):
        model_weights(tmp_path / "absent")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model_index.json").write_text("[1]")
    with pytest.raises(WeightsError, match=r"model_index\.json: expected a JSON object"):
        model_weights(bad)
    for weight_map, expected in [({"a": "../../etc/passwd.safetensors"}, "is not a .safetensors file name"),
                                 ({"a": "model.bin"}, "is not a .safetensors file name"),
                                 ({"a": "gone.safetensors"}, "which is missing from"),
                                 ([1], "expected a JSON object with a \"weight_map\"")]:
        folder = tmp_path / f"idx{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        index = folder / "model.safetensors.index.json"
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(WeightsError) as err:
            model_weights(folder)
        assert str(index) in str(err.value) and expected in str(err.value)
    with pytest.raises(WeightsError, match="dtype 'int8' is not one of"):
        read_header(raw_file(tmp_path / "ok.safetensors", "{}")).bytes_at("int8")


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200) | st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20).map(lambda v: json.dumps(v).encode()))
def test_any_header_bytes_either_size_or_raise_weights_error(tmp_path: Path, header: bytes) -> None:
    path = raw_file(tmp_path / "fuzz.safetensors", header, bytes(64))
    try:
        read_header(path)
    except WeightsError as e:
        assert str(path) in str(e)


def test_sizing_never_imports_torch() -> None:
    code = ("import sys, diffusiond.daemon.residency.sizes, diffusiond.daemon.residency.policy; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'safetensors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
