"""Loaders for diffusers models on disk or in the HF cache: a folder, a hub id, a GGUF transformer in a base
pipeline (a single checkpoint: ``single_file.py``).

Every model diffusiond serves through diffusers ends up here, including the ones built in code
(the ``tiny`` models and ``random:<preset>`` are saved and loaded back through ``load_folder``),
so the path benchmarks measure is the one real models take. Each refuses a pipeline class it
cannot serve before any weights load, and loads safetensors only unless ``allow_unsafe_weights=1``
(pickled weights can run code).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from diffusiond.pipelines.base import PipelineError, RequestDefaults, _tensor_bytes
from diffusiond.pipelines.diffusers_pipeline import DiffusersPipeline, task_for_class
from diffusiond.pipelines.errors import root_cause
from diffusiond.pipelines.load_progress import loaded
from diffusiond.pipelines.phases import Phases
from diffusiond.pipelines.pipeline_classes import check_components, components, fetch_component
from diffusiond.pipelines.pipeline_classes import pipeline_class as _pipeline_class
from diffusiond.pipelines.pipeline_classes import read_index as _read_index
from diffusiond.pipelines.quant import load_time_config, parse_quant
from diffusiond.pipelines.qwen_edit import processor_kwargs
from diffusiond.pipelines.spec import check_second_expert, second_expert_refusal
from diffusiond.pipelines.variants import NOT_LOADED, pipeline_variants

log = logging.getLogger(__name__)

def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """diffusers renamed ``torch_dtype`` to ``dtype`` (the old name warns); pass whichever it wants."""
    from diffusers.utils import deprecation_utils

    return {"dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype": dtype}


def dtype_kwarg_of(cls: type, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``dtype_kwarg`` for a component class of either library: transformers renamed it in 4.56."""
    import transformers
    from packaging.version import Version

    if issubclass(cls, transformers.PreTrainedModel):
        return {"dtype" if Version(Version(transformers.__version__).base_version) >= Version("4.56")
                else "torch_dtype": dtype}
    return dtype_kwarg(dtype)


def hub_offline() -> bool:
    """Read at call time: the hub libraries read HF_HUB_OFFLINE once, at import."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return flag in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


def _why_not_loaded(exc: BaseException, path: Path, options: Mapping[str, str]) -> str:
    """What diffusers' message leaves out: the first cause (``root_cause``), and the .bin hint only where the folder
    has such weights (it was given for any message naming a path, and every path names its .safetensors)."""
    root = root_cause(exc)
    said = f" ({type(root).__name__}: {root})" if root is not exc and str(root) not in str(exc) else ""
    if "SafetensorError" in said:
        said += "; `diffusiond fit FOLDER` checks each file's header and names the one that is truncated or corrupt"
    unsafe = [p for p in path.glob("*/*") if p.suffix in (".bin", ".pt", ".ckpt")]
    if unsafe and options.get("allow_unsafe_weights") != "1":
        said += (f"; {unsafe[0].relative_to(path)} is not read: only safetensors weights load by default "
                 "(allow_unsafe_weights=1 permits .bin, which is a pickle that can run code)")
    return said


def component_damaged(what: str, name: str, folder: Path, exc: BaseException, options: Mapping[str, str]) -> str:
    """Why component ``name`` (described by ``what``) did not load from its subfolder of ``folder``, and that
    the subfolder is to be fetched again: the folder loaders and a single file's ``config=`` say it alike."""
    return (f"cannot load {what}: {type(exc).__name__}: {exc}{_why_not_loaded(exc, folder, options)}; its {name}/ "
            f"folder is damaged or incomplete: {fetch_component(name)}")


def _load_kwargs(index: Mapping[str, Any], dtype: torch.dtype, opts: Mapping[str, str], device: torch.device,
                 root: Path | None, passed: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """from_pretrained arguments shared by folder and hub loads; ``quant=``'s bitsandbytes methods are
    applied here, while the files are read (pipelines/quant.py); a Qwen2-VL processor in the folder at ``root``
    is loaded without torchvision (pipelines/qwen_edit.py). With its files at ``root``, each component reads
    the weights variant the engine sized it by (pipelines/variants.py): one ``variant=`` for most; the
    components it would read from other files come back apart, each with its variant, for ``_read_apart``, which
    the caller runs only once the folder is known whole (they may be gigabytes). ``passed``: components the
    caller gives itself."""
    kwargs: dict[str, Any] = {**dtype_kwarg(dtype), **processor_kwargs(index, root)}
    if opts.get("quant"):
        config = load_time_config(parse_quant(opts["quant"]), index, dtype, device)
        if config is not None:
            kwargs["quantization_config"] = config
    # safetensors only, unless explicitly allowed: .bin weights are pickles and can run code.
    kwargs["use_safetensors"] = None if opts.get("allow_unsafe_weights") == "1" else True
    # Skip loading a component we would discard anyway (the engine does not count it either), and the safety
    # checker's image processor, which only it reads (SD folders lack both where people deleted them), unless an
    # image encoder uses that too; an IP-Adapter brings its own.
    kwargs.update(dict.fromkeys(NOT_LOADED & index.keys()))
    if "safety_checker" in index:
        kwargs["requires_safety_checker"] = False
        if "feature_extractor" in components(index) and "image_encoder" not in components(index):
            kwargs["feature_extractor"] = None
    apart: dict[str, str] = {}
    if root is not None:
        suffixes = (".safetensors", ".bin") if kwargs["use_safetensors"] is None else (".safetensors",)
        names = [n for n in components(index) if n not in kwargs and n not in passed]
        kwargs["variant"], apart = pipeline_variants(root, names, str(dtype).removeprefix("torch."), suffixes)
    return kwargs, apart


def _read_apart(root: Path, index: Mapping[str, Any], apart: Mapping[str, str], dtype: torch.dtype,
                kwargs: Mapping[str, Any], opts: Mapping[str, str]) -> dict[str, Any]:
    """The components ``_load_kwargs`` left apart, read from their own variants, as from_pretrained arguments."""
    return {name: _component(root, name, index[name], variant, dtype, kwargs, opts) for name, variant in apart.items()}


def _component(root: Path, name: str, entry: list[str], variant: str, dtype: torch.dtype,
               kwargs: Mapping[str, Any], opts: Mapping[str, str]) -> Any:
    """Component ``name`` of the folder ``root`` read from its ``variant`` files ("" the plain ones), given what
    diffusers gives the others (the dtype, the safetensors rule, its quantization): the one ``variant=``
    diffusers takes for a whole pipeline would read other files of it."""
    import diffusers

    library, class_name = entry
    module = importlib.import_module(library) if library in ("diffusers", "transformers") else \
        getattr(diffusers.pipelines, library, None)
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not hasattr(cls, "from_pretrained"):
        raise PipelineError(f"{str(root / 'model_index.json')!r} names {library} {class_name} for its {name}, which "
                            "diffusers cannot load: the folder is of a newer diffusers or transformers (pip install -U "
                            "diffusers transformers) or is damaged")
    extra: dict[str, Any] = dtype_kwarg_of(cls, dtype)
    quant = getattr(kwargs.get("quantization_config"), "quant_mapping", None) or {}
    if name in quant:
        extra["quantization_config"] = quant[name]
    try:
        component = cls.from_pretrained(str(root / name), variant=variant or None,
                                        use_safetensors=kwargs["use_safetensors"], **extra)
    except Exception as exc:  # a missing file, a truncated one, a config of another class: many types
        files = f"{variant} variant files (*.{variant}.*)" if variant else "files without a variant"
        raise PipelineError(component_damaged(f"the {name} ({class_name}) of {str(root)!r} from its {files}", name,
                                              root, exc, opts)) from exc
    loaded(component)
    return component


def load_folder(
    path: Path,
    *,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    options: Mapping[str, str],
    defaults: RequestDefaults | None = None,
    synthetic_weights: bool = False,
) -> DiffusersPipeline:
    """A local diffusers folder (``save_pretrained`` layout); the models built in code take it too,
    and declare what only they know (CPU-friendly defaults, random weights) through the keywords."""
    index_path = path / "model_index.json"
    if not index_path.is_file():
        raise PipelineError(f"folder {str(path)!r} has no model_index.json; it is not a diffusers pipeline folder")
    index = _read_index(index_path)
    phases = Phases()
    cls = _pipeline_class(str(index.get("_class_name", "")), str(index_path))
    phases.mark("import")
    kwargs, apart = _load_kwargs(index, dtype, options, device, path)
    check_components(path, index, kwargs)
    kwargs.update(_read_apart(path, index, apart, dtype, kwargs, options))
    try:
        pipe = cls.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise PipelineError(f"cannot load {cls.__name__} from {str(path)!r}: {exc}"
                            f"{_why_not_loaded(exc, path, options)}") from exc
    phases.mark("files")
    return DiffusersPipeline(
        pipe,
        name=name,
        device=device,
        dtype=dtype,
        options=options,
        defaults=defaults,
        synthetic_weights=synthetic_weights,
        phases=phases,
    )


def load_hub(
    repo_id: str, *, name: str, device: torch.device, dtype: torch.dtype, options: Mapping[str, str]
) -> DiffusersPipeline:
    """A hub id, through the normal HF cache; the daemon never hides a failed download."""
    from huggingface_hub import constants, try_to_load_from_cache

    cache = constants.HF_HUB_CACHE
    cached_index = try_to_load_from_cache(repo_id, "model_index.json")
    not_cached = (
        f"model {repo_id!r} is not in the Hugging Face cache ({cache}) and could not be downloaded; "
        f"download it first, e.g. `hf download {repo_id}` (older hubs: `huggingface-cli download {repo_id}`), "
        "or pass a local folder"
    )
    local_only = options.get("local_files_only") == "1" or hub_offline()
    downloading = not isinstance(cached_index, str)
    if downloading and local_only:
        raise PipelineError(not_cached)
    from diffusers import DiffusionPipeline

    if downloading:  # the index and processor first: what the rest is loaded with is chosen from them
        try:
            cached_index = str(Path(_fetch_head(repo_id)) / "model_index.json")
        except Exception as exc:  # network errors come in many types (requests, httpx, hub errors)
            raise PipelineError(f"{not_cached}: {type(exc).__name__}: {exc}") from exc
    assert isinstance(cached_index, str)
    index = _read_index(Path(cached_index))  # refuse an unservable class before fetching any weights
    _pipeline_class(str(index.get("_class_name", "")), f"{repo_id}/model_index.json")
    if index.get("processor") and not (Path(cached_index).parent / "processor").is_dir() and not local_only:
        try:  # a download cut short after the index: the processor too, before diffusers builds one
            cached_index = str(Path(_fetch_head(repo_id)) / "model_index.json")
        except Exception as exc:
            raise PipelineError(f"model {repo_id!r} has no processor/ in the Hugging Face cache ({cache}) and it "
                                f"could not be downloaded: {type(exc).__name__}: {exc}; finish the download "
                                f"(`hf download {repo_id}`)") from exc
    try:
        kwargs, apart = _load_kwargs(index, dtype, options, device, Path(cached_index).parent)
        kwargs.update(_read_apart(Path(cached_index).parent, index, apart, dtype, kwargs, options))
        if local_only:
            kwargs["local_files_only"] = True
        pipe = DiffusionPipeline.from_pretrained(repo_id, **kwargs)
    except PipelineError:
        raise
    except Exception as exc:
        if downloading:
            raise PipelineError(f"{not_cached}: {type(exc).__name__}: {exc}") from exc
        raise PipelineError(f"cannot load {repo_id!r} from the HF cache ({cache}): {exc}") from exc
    task_for_class(type(pipe))
    return DiffusersPipeline(pipe, name=name, device=device, dtype=dtype, options=options)


def _fetch_head(repo_id: str) -> str:
    """Download a hub model's ``model_index.json`` and ``processor/`` (small files) into the cache, and return its
    snapshot folder: a Qwen-Image-Edit's processor must be loaded from it without torchvision (qwen_edit.py) before
    diffusers fetches the rest, or its first start fails on the import."""
    from huggingface_hub import snapshot_download

    return str(snapshot_download(repo_id, allow_patterns=["model_index.json", "processor/*"]))


def _base_folder(base: str, path: Path) -> Path:
    """The diffusers folder a GGUF transformer's pipeline comes from: a folder, or a hub id's cached snapshot."""
    from diffusiond.pipelines.spec import parse_spec

    if not base:
        raise PipelineError(
            f"{path} is a GGUF file, which holds only the transformer: name the rest of the pipeline with "
            f"base=<diffusers folder or hub id>, e.g. --model flux={path},base=black-forest-labs/FLUX.1-dev")
    parsed = parse_spec(base)
    if parsed.kind == "folder":
        return Path(parsed.target)
    if parsed.kind == "hub":
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(parsed.target, local_files_only=True,
                                          allow_patterns=["*.json", "*.txt", "*.model", "*.safetensors"]))
        except Exception as exc:  # the hub's own errors: not cached, partial snapshot
            raise PipelineError(f"base={base}: not in the Hugging Face cache ({exc}); download it first "
                                f"(`hf download {parsed.target}`) or give a diffusers folder") from exc
    raise PipelineError(f"base={base}: expected a diffusers folder (with model_index.json) or a hub id in the HF cache")


def load_gguf(
    path: Path, *, name: str, device: torch.device, dtype: torch.dtype, options: Mapping[str, str]
) -> DiffusersPipeline:
    """A GGUF transformer (as downloaded: city96's FLUX Q8_0 and the like) in the pipeline of ``base=``, through
    diffusers' GGUF support: the weights stay quantized on the device, each layer dequantized to ``dtype`` as it
    runs, so the quantization is named in every output's approximations. Wan 2.2 A14B's two experts come as two
    files (one per expert, issue 28): ``transformer_2=`` names the low-noise one's, loaded the same way."""
    import diffusers

    root = _base_folder(options.get("base", ""), path)
    index = _read_index(root / "model_index.json") if (root / "model_index.json").is_file() else {}
    if not index:
        raise PipelineError(f"base {str(root)!r} has no model_index.json; it is not a diffusers pipeline folder")
    cls = _pipeline_class(str(index.get("_class_name", "")), str(root / "model_index.json"))
    entry = index.get("transformer")
    tcls = getattr(diffusers, str(entry[1]), None) if isinstance(entry, list) and len(entry) == 2 else None
    if not isinstance(tcls, type) or not hasattr(tcls, "from_single_file"):
        raise PipelineError(f"base {str(root)!r} ({cls.__name__}) has no transformer diffusers can load from a GGUF "
                            f"file (its model_index.json names {entry!r}); GGUF files replace a transformer")
    files = {"transformer": path, **_second_expert(options, index)}
    named = parse_quant(options["quant"]) if options.get("quant") else {}
    for component, file in files.items():
        if component in named:
            raise PipelineError(f"quant: the {component} of {file.name} is quantized by its GGUF file already; "
                                "quant= may name the base's other components (for example text_encoder_2:fp8-storage)")
    if importlib.util.find_spec("gguf") is None:
        raise PipelineError("GGUF models need the gguf package: pip install 'diffusiond[gguf]' (or pip install gguf)")
    experts = {component: _gguf_transformer(file, tcls, root, component, dtype) for component, file in files.items()}
    for expert in experts.values():
        loaded(expert)  # read outside diffusers' component loaders, which the load's progress counts
    try:
        kwargs, apart = _load_kwargs(index, dtype, options, device, root, files)
        kwargs.update(_read_apart(root, index, apart, dtype, kwargs, options))
        pipe = cls.from_pretrained(str(root), **experts, **kwargs)
    except PipelineError:
        raise
    except Exception as exc:
        if "meta tensor" in str(exc):  # the file's transformer, moved with the others, lacks a weight
            _gguf_failed(exc, path, tcls, root)
        raise PipelineError(f"cannot load the other components of base={root} ({cls.__name__}) beside the "
                            f"transformer of {path.name}: {type(exc).__name__}: {exc}; the base folder is damaged or "
                            "mixes files of several models (the GGUF file loaded)") from exc
    if "transformer_2" not in files and isinstance(getattr(pipe, "transformer_2", None), torch.nn.Module):
        log.warning("%s: the low-noise expert (transformer_2, %.2f GB) loads from base=%s unquantized, at %s; give "
                    "transformer_2=FILE.gguf (its GGUF file) to serve it quantized too", name,
                    _tensor_bytes([pipe.transformer_2]) / 1e9, root, str(dtype).removeprefix("torch."))
    approx = tuple(f"gguf-{k}({component}, dequantized per layer to {str(dtype).removeprefix('torch.')})"
                   for component, module in experts.items() for k in _quant_kinds(module))
    return DiffusersPipeline(pipe, name=name, device=device, dtype=dtype, options=options, approximations=approx)


def _second_expert(options: Mapping[str, str], index: Mapping[str, Any]) -> dict[str, Path]:
    """``transformer_2=FILE.gguf``: Wan 2.2 A14B's low-noise expert, a GGUF file of its own (QuantStack's
    ``...-LowNoise-Q8_0.gguf``), checked against the base, which must have that expert for it to replace."""
    value = options.get("transformer_2", "")
    if not value:
        return {}
    check_second_expert("gguf", options)
    if refusal := second_expert_refusal(options, index):
        raise PipelineError(refusal)
    return {"transformer_2": Path(value).expanduser()}


def _gguf_transformer(path: Path, tcls: type[Any], root: Path, component: str, dtype: torch.dtype) -> Any:
    """One GGUF file loaded as the base's ``component`` (its config from that subfolder), still quantized."""
    import diffusers

    try:
        return tcls.from_single_file(
            _gguf_weights(path, tcls, root, component),
            quantization_config=diffusers.GGUFQuantizationConfig(compute_dtype=dtype),
            config=str(root), subfolder=component, **dtype_kwarg(dtype))
    except PipelineError:
        raise
    except Exception as exc:  # conversion and key mismatches raise many types
        _gguf_failed(exc, path, tcls, root)


def _quant_kinds(module: Any) -> list[str]:
    """The quantized types a GGUF-loaded module holds (its F32/F16/BF16 tensors are not approximations)."""
    return sorted({getattr(p.quant_type, "name", str(p.quant_type)) for p in module.parameters()
                   if getattr(p, "quant_type", None) is not None and str(getattr(p.quant_type, "name", "")) not in
                   ("F32", "F16", "BF16")})


def _gguf_failed(exc: Exception, path: Path, tcls: type[Any], root: Path) -> NoReturn:
    """The GGUF file's transformer did not load into the base's: what the error says about the file."""
    if "expected shape" in str(exc):  # a size or variant of the family that the names alone do not tell
        raise PipelineError(f"{path.name} does not fit the transformer of base={root} ({tcls.__name__}: "
                            f"{exc}): base= names another size or variant of the family than the GGUF file "
                            "was made from; name that pipeline as base=") from exc
    if "meta tensor" in str(exc):  # a weight the file lacks stays on the meta device; moving the model says so
        wan = " (a Wan file needs its 5-D patch_embedding.weight, which city96's converter adds in a second " \
              "step)" if _FAMILIES.get(tcls.__name__, ("",))[0] == "Wan" else ""
        raise PipelineError(f"{path.name} lacks weights of the base's {tcls.__name__}{wan}: the file is "
                            f"incomplete or made for another model than base={root}") from exc
    raise PipelineError(f"cannot load {tcls.__name__} from GGUF file {str(path)!r} with base {str(root)!r}: "
                        f"{type(exc).__name__}: {exc}") from exc


_COMFY_PREFIX = "model.diffusion_model."
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    # transformer class -> its family, and names (or their starts) only its weights have, in either naming
    "FluxTransformer2DModel": ("FLUX", ("double_blocks.", "single_transformer_blocks.")),
    "WanTransformer3DModel": ("Wan", ("head.modulation", "condition_embedder.time_proj.")),
}


def _check_family(checkpoint: Mapping[str, Any], tcls: type[Any], path: Path, root: Path) -> None:
    """A GGUF of one family with ``base=`` another's folder otherwise fails deep in diffusers' conversion
    ("list index out of range", "Cannot copy out of meta tensor"), which does not say the base is wrong."""
    family, marks = _FAMILIES[tcls.__name__]
    if any(k.startswith(marks) for k in checkpoint):
        return
    found = next((f for f, m in _FAMILIES.values() if any(k.startswith(m) for k in checkpoint)), None)
    holds = f"holds a {found} transformer" if found else f"holds no {family} transformer (no tensor named {marks[0]}*)"
    raise PipelineError(f"{path.name} {holds}, but base={root} is a {family} pipeline ({tcls.__name__}): "
                        "name the pipeline the GGUF file was made from as base=")


def _check_wan(checkpoint: Mapping[str, Any], tcls: type[Any], path: Path, root: Path, component: str) -> None:
    """Wan's variants share one transformer class, and diffusers loads one variant's file into another's
    base as far as the names go: a VACE file into a T2V base dropped its ``vace_blocks`` without a word
    (a T2V model, served as if it were the file), and an I2V file and a T2V base failed on a shape."""
    from diffusiond.pipelines.edit_pipes import NOT_SERVED

    if any(k.startswith("vace_") for k in checkpoint):
        raise PipelineError(f"{path.name} holds a Wan VACE transformer (vace_blocks.*), which is not served: "
                            f"{NOT_SERVED['WanVACE']}")
    image = any(k.startswith(("img_emb.", "condition_embedder.image_embedder.")) for k in checkpoint)
    config = tcls.load_config(str(root), subfolder=component)
    if image == bool(config.get("image_dim")):
        return
    shape: tuple[int, ...] = tuple(getattr(checkpoint.get("patch_embedding.weight"), "shape", ()))
    if image:
        holds, wants = ("a Wan 2.1 I2V transformer (img_emb.*)", "has no image embedding; base= must be a "
                        "WanImageToVideoPipeline folder with a CLIP image encoder "
                        "(Wan-AI/Wan2.1-I2V-14B-480P-Diffusers)")
    elif len(shape) == 5 and shape[1] == config.get("in_channels"):  # the image's latents in its input: Wan 2.2 I2V
        holds, wants = (f"a Wan image-to-video transformer without an image embedding ({shape[1]} input channels, no "
                        "img_emb.*: Wan 2.2 I2V A14B's)", "is Wan 2.1 I2V's, with a CLIP image embedding; base= must "
                        "be a WanImageToVideoPipeline folder without an image encoder "
                        "(Wan-AI/Wan2.2-I2V-A14B-Diffusers)")
    else:
        holds, wants = ("a Wan transformer without Wan 2.1 I2V's image embedding (img_emb.*)",
                        "is Wan 2.1 I2V's; base= must be the pipeline the file was made from (a T2V or TI2V file: a "
                        "WanPipeline folder, Wan-AI/Wan2.1-T2V-14B-Diffusers)")
    raise PipelineError(f"{path.name} holds {holds}, but the transformer of base={root} {wants}")


def _gguf_weights(path: Path, tcls: type[Any], root: Path, component: str) -> str | dict[str, torch.Tensor]:
    """What ``from_single_file`` is given: the file, its weights once checked to be of the base's family, or
    for a FLUX transformer under the original BFL names (city96's GGUFs, with or without ComfyUI's prefix)
    its weights converted here. diffusers' converter
    splits each single block's fused ``linear1`` at FLUX.1's width (3072) written into its code, so any
    other width fails to load; the split here takes the width from the base's config, and the result is
    already in diffusers' names, so diffusers loads it as is."""
    import diffusers
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint

    if tcls.__name__ not in _FAMILIES:
        return str(path)
    checkpoint = load_single_file_checkpoint(str(path))
    checkpoint = {k.removeprefix(_COMFY_PREFIX): v for k, v in checkpoint.items()}
    _check_family(checkpoint, tcls, path, root)
    if issubclass(tcls, diffusers.WanTransformer3DModel):
        _check_wan(checkpoint, tcls, path, root, component)
    if not issubclass(tcls, diffusers.FluxTransformer2DModel) or not any(k.startswith("double_blocks.")
                                                                          for k in checkpoint):
        return checkpoint
    config = tcls.load_config(str(root), subfolder=component)
    return flux_from_bfl(checkpoint, int(config["num_attention_heads"]) * int(config["attention_head_dim"]))


def flux_from_bfl(checkpoint: dict[str, torch.Tensor], inner: int) -> dict[str, torch.Tensor]:
    """BFL-named FLUX weights (``checkpoint``, consumed) in diffusers' names, for a transformer ``inner``
    wide: diffusers' own converter does all but the single blocks' ``linear1`` split (q, k, v, then the
    MLP input, whatever is left), which it is handed a stand-in of its hard-coded shape for; quantized
    tensors split by rows, as their rows are whole blocks, so they stay quantized."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    stand_in = torch.empty(3 * 3072 + 4 * 3072)  # the split diffusers' converter makes of every linear1
    split: dict[str, torch.Tensor] = {}
    for key in [k for k in checkpoint if k.startswith("single_blocks.") and ".linear1." in k]:
        block, kind = key.split(".")[1], key.rsplit(".", 1)[1]
        tensor = checkpoint[key]
        if tensor.shape[0] <= 3 * inner:
            raise PipelineError(f"{key} has {tensor.shape[0]} rows, too few for q, k, v and the MLP of the base's "
                                f"transformer ({inner} wide): base= names a different model than the GGUF file")
        parts = torch.split(tensor, [inner, inner, inner, tensor.shape[0] - 3 * inner])
        for name, part in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), parts, strict=True):
            split[f"single_transformer_blocks.{block}.{name}.{kind}"] = part
        checkpoint[key] = stand_in
    converted = convert_flux_transformer_checkpoint_to_diffusers(checkpoint)
    converted.update(split)
    return converted
