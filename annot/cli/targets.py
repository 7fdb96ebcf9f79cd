"""Build the model a command-line TARGET names, on the meta device.

TARGET is ``path/to/model.py:ClassName``, ``hf:<model_type>``, a local directory
holding a HuggingFace ``config.json`` (transformers' or diffusers'), or a diffusers
pipeline directory (``model_index.json``: its denoiser is planned). Every failure is a `TargetError` whose message
is one line naming the problem; the CLI prints it and exits with 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

import torch
from torch import nn

from annot.policies.errors import AnnotError

__all__ = ["TargetError", "build_target", "read_options"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(AnnotError, ValueError):
    """The command-line target or its options are unusable."""


def read_options(kwargs: str | None, config: str | None) -> dict[str, Any]:
    """Constructor/config values from ``--config FILE`` (JSON or YAML), then ``--kwargs JSON``
    on top."""
    options: dict[str, Any] = {}
    if config is not None:
        path = Path(config)
        if _probe(path, f"--config {config}").is_dir():
            raise TargetError(f"--config {config}: is a folder; give the JSON or YAML file in it")
        if not path.is_file():
            raise TargetError(f"--config {config}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TargetError(f"--config {config}: not UTF-8 text (JSON and YAML files are)") from None
        except OSError as exc:
            raise TargetError(f"--config {config}: cannot read ({exc.strerror or exc})") from None
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise TargetError("--config with YAML needs PyYAML: pip install pyyaml") from None
            try:
                loaded = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise TargetError(f"--config {config}: bad YAML: {_one_line(exc)}") from None
        else:
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TargetError(f"--config {config}: bad JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise TargetError(f"--config {config}: expected a mapping of names to values")
        options.update(loaded)
    if kwargs is not None:
        try:
            loaded = json.loads(kwargs)
        except json.JSONDecodeError as exc:
            raise TargetError(f"--kwargs: bad JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise TargetError("--kwargs: expected a JSON object such as '{\"n_layer\": 8}'")
        options.update(loaded)
    return options


def build_target(target: str, options: dict[str, Any], *, dtype: str | None = None) -> nn.Module:
    """The model TARGET names, constructed under ``torch.device("meta")``."""
    path = Path(target) if target.startswith("hf:") else _probe(Path(target), target)
    if target.startswith("hf:"):
        model = _build_hf(target[3:], options, directory=None)
    elif ":" in target and not path.is_dir():
        file, _, class_name = target.rpartition(":")
        model = _build_from_file(Path(file), class_name, options)
    elif path.is_dir():
        if not _probe(path / "config.json", target).is_file() and \
                _probe(path / "model_index.json", target).is_file():
            path = _denoiser_folder(path, target)  # a diffusers pipeline: its denoiser
        if not _probe(path / "config.json", target).is_file():
            raise TargetError(f"{target}: directory has no config.json (not a HuggingFace model)")
        model = _build_diffusers(path, options) if _is_diffusers(path) else _build_hf(None, options, directory=path)
    elif path.is_file():
        raise TargetError(f"{target}: name the class too, as {target}:ClassName")
    else:
        raise TargetError(
            f"{target}: no such file or directory (expected path/model.py:Class, hf:<model_type> "
            "or a directory with config.json or model_index.json)"
        )
    if dtype is not None:
        model = model.to(DTYPES[dtype])
    return model


def _probe(path: Path, what: str) -> Path:
    """``path``, once asking the file system about it has worked.

    ``Path.is_dir``/``is_file`` answer False for a missing path but raise for one the
    user may not look into (a folder without read or search permission): that becomes
    one line naming ``what`` and the fix, never a traceback (issue #33).
    """
    try:
        path.stat()
    except FileNotFoundError:
        pass  # the callers say "no such file" in their own words
    except OSError as exc:
        raise TargetError(_unreadable(what, exc)) from None
    return path


def _unreadable(what: str, exc: OSError) -> str:
    reason = exc.strerror or type(exc).__name__
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != what else ""
    return (f"{what}: cannot read{where}: {reason}; make it readable for this user "
            "(e.g. chmod u+rx on the folder, u+r on the files)")


def _build_from_file(file: Path, class_name: str, options: dict[str, Any]) -> nn.Module:
    if not _probe(file, str(file)).is_file():
        raise TargetError(f"{file}: no such file")
    if not class_name.isidentifier():
        raise TargetError(f"{file}:{class_name}: {class_name!r} is not a class name")
    module = _import_file(file)
    klass = getattr(module, class_name, None)
    if klass is None:
        found = sorted(n for n, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == module.__name__)
        hint = f" (nn.Module classes there: {', '.join(found)})" if found else ""
        raise TargetError(f"{file}: no class {class_name}{hint}")
    if not (isinstance(klass, type) and issubclass(klass, nn.Module)):
        raise TargetError(f"{file}:{class_name} is not an nn.Module class ({type(klass).__name__})")
    config_class = _config_parameter(klass, options)
    call = f"{config_class.__name__}(**{options})" if config_class else f"**{options}"
    try:
        with torch.device("meta"):
            if config_class is not None:
                return klass(config_class(**options))
            return klass(**options)
    except SystemExit as exc:  # would end `annot plan` with the constructor's status, silently
        raise TargetError(f"{class_name}({call}) called sys.exit({exc.code!r}): a model's "
                          "constructor must return the model, not end the program") from None
    except Exception as exc:  # the user's constructor: report, don't trace back
        raise TargetError(f"{class_name}({call}) failed: {_one_line(exc)}") from None


def _config_parameter(klass: type[nn.Module], options: dict[str, Any]) -> type | None:
    """The dataclass of a nanoGPT-style ``Model(config: ModelConfig)`` constructor, so
    ``--kwargs`` can fill the config; None when the options are the constructor's own."""
    try:
        params = [p for p in inspect.signature(klass).parameters.values()
                  if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        hints = typing.get_type_hints(klass.__init__)
    except (TypeError, ValueError, NameError):
        return None
    if len(params) != 1 or params[0].name in options:
        return None
    annotation = hints.get(params[0].name)
    return annotation if isinstance(annotation, type) and dataclasses.is_dataclass(annotation) else None


def _import_file(file: Path):
    try:
        source = file.read_text(encoding="utf-8")
        compile(source, str(file), "exec")
    except SyntaxError as exc:
        raise TargetError(f"{file}:{exc.lineno}:{exc.offset}: syntax error: {exc.msg}") from None
    except OSError as exc:
        raise TargetError(_unreadable(str(file), exc)) from None
    except UnicodeDecodeError as exc:
        raise TargetError(f"{file}: cannot read: {_one_line(exc)}") from None
    # Name the module after the file so plans read "model.Block", unless that is taken.
    name = file.stem if file.stem.isidentifier() and file.stem not in sys.modules else (
        f"_annot_target_{abs(hash(str(file.resolve())))}")
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # The model file may import modules beside it (import layers); make them findable.
    sys.path.insert(0, str(file.resolve().parent))
    sys.modules[name] = module
    # A script-like file parses sys.argv at import: let it see its own name, not annot's.
    argv, sys.argv = sys.argv, [str(file)]
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        # A file that runs its main at import and exits (0 too) would otherwise end
        # `annot plan` with no plan and no word (issue #33).
        del sys.modules[name]
        raise TargetError(
            f"{file}: importing it called sys.exit({exc.code!r}) before annot could read its "
            "classes: put the script part under `if __name__ == \"__main__\":`") from None
    except Exception as exc:
        del sys.modules[name]
        raise TargetError(f"{file}: importing it failed: {_one_line(exc)}") from None
    finally:
        sys.argv = argv
        sys.path.remove(str(file.resolve().parent))
    return module


def _build_hf(model_type: str | None, options: dict[str, Any], directory: Path | None) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for a hub
    try:
        import transformers
    except ImportError:
        raise TargetError("HuggingFace targets need transformers: pip install 'annot-train[hf]'") from None
    if directory is None and model_type not in transformers.CONFIG_MAPPING:
        raise TargetError(
            f"hf:{model_type}: unknown transformers model type {model_type!r} "
            "(examples: llama, mistral, qwen2, gpt2, bert, t5)"
        )
    try:
        if directory is not None:
            config = transformers.AutoConfig.from_pretrained(directory, **options)
        else:
            if model_type is None:  # build_target passes a model type or a directory
                raise AssertionError("_build_hf needs a model type or a directory")
            config = transformers.AutoConfig.for_model(model_type, **options)
    except PermissionError as exc:
        raise TargetError(_unreadable(str(directory), exc)) from None
    except Exception as exc:  # noqa: BLE001 - transformers' config validation raises its own types
        what = f"hf:{model_type}" if directory is None else str(directory)
        raise TargetError(f"{what}: {_one_line(exc)}") from None
    from annot.huggingface.model import model_factory

    try:
        # The class `annot.from_pretrained` builds for this directory or config.
        factory = model_factory(config)
    except ValueError as exc:
        raise TargetError(f"{type(config).__name__}: {_one_line(exc)}") from None
    try:
        with torch.device("meta"):
            model = factory(config, dtype=getattr(config, "dtype", None) or torch.float32)
    except Exception as exc:
        raise TargetError(f"building {type(config).__name__} model failed: {_one_line(exc)}") from None
    if directory is not None:  # trainable as annot.from_pretrained loads it (and says so)
        from annot.huggingface.pretrained import train_loaded_parameters

        train_loaded_parameters(model, directory)
    return model


def _denoiser_folder(path: Path, target: str) -> Path:
    """The denoiser's folder of the diffusers pipeline folder ``path``."""
    from annot.errors import CheckpointError
    from annot.formats.diffusers import component_folder

    try:
        return component_folder(path, None)
    except CheckpointError as exc:
        raise TargetError(f"{target}: {_one_line(exc)}") from None


def _is_diffusers(path: Path) -> bool:
    from annot.formats.diffusers import is_diffusers_folder

    try:
        return is_diffusers_folder(path)
    except AnnotError as exc:
        raise TargetError(f"{path}: {_one_line(exc)}") from None


def _build_diffusers(directory: Path, options: dict[str, Any]) -> nn.Module:
    """The diffusers model of ``directory``'s config (``options`` override its values),
    built on the meta device as `annot.from_pretrained` builds it, in float32."""
    from annot.huggingface import diffusers_model

    try:
        config = {**diffusers_model.read_config(directory), **options}
        with torch.device("meta"):
            return diffusers_model.build(config, torch.float32)
    except AnnotError as exc:
        raise TargetError(f"{directory}: {_one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the class's own constructor
        raise TargetError(f"building {config.get('_class_name')} failed: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    """The exception on one line. transformers' validation errors put the reason on the
    lines after a generic first one, so up to three lines are joined."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:3])
    return f"{type(exc).__name__}: {text}".rstrip(": ")
