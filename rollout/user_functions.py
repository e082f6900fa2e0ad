"""Users' functions named in a config, found one way wherever they are named: reward functions (`rewards[].fn`,
orchestrator/rewards/functions.py) and tools (`agent.tools`, rollout/agent/tools.py).

- `path/to/file.py:function`: a file, relative to the config file's directory (as every path of a config is).
- `package.module:function`: a module importable from the installed packages, the config file's directory or the
  working directory (`tide` is a console script: neither directory is on Python's path by itself).

The resolved config (RUN_DIR/config.yaml, `tide config show`) names what it found beside the config or in the
working directory by absolute paths, `/abs/path/file.py:function` and `/abs/dir/package.module:function` (the module
imported with that directory on the path), so a resumed run, which reads it from the run directory, finds the same
code from any working directory. Every process that loads a function (the driver, the reward workers) loads it from
that spec alone."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import ValidationInfo


class UserFunctionError(ValueError):
    """A function that cannot be found: the message names its spec, the file or module, and why."""


def resolve_spec(spec: str, config_dir: str | Path | None) -> str:
    """`spec` as the resolved config holds it: a file's path absolute (a relative one joined to `config_dir`), a
    module found under `config_dir` or the working directory qualified by that directory, anything else (an
    installed package's module, a built-in's name) as written. `config_dir` None: no config file; a module is
    then looked for in the working directory when it is loaded."""
    source, sep, attr = spec.rpartition(":")
    if not sep or not source:
        return spec
    base = Path(config_dir) if config_dir else Path.cwd()
    if source.endswith(".py"):
        return f"{os.path.abspath(base / Path(source).expanduser())}:{attr}"
    root, slash, module = source.rpartition("/")
    if slash:  # `dir/package.module`: dir relative to the config's directory
        return f"{os.path.abspath(base / Path(root).expanduser())}/{module}:{attr}"
    for directory in (base, Path.cwd()) if config_dir else ():
        if _module_under(directory, source):
            return f"{os.path.abspath(directory)}/{source}:{attr}"
    return spec


def resolve_in_config(spec: str, info: ValidationInfo) -> str:
    """`resolve_spec` as a config's validator: the config file's directory from the validation context (set by
    orchestrator.config.schema.load_config)."""
    return resolve_spec(spec, (info.context or {}).get("config_dir"))


def _module_under(directory: Path, module: str) -> bool:
    """Whether `directory` holds the module's file or package (no code runs)."""
    path = directory.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def load_function(spec: str, kind: str) -> Callable[..., Any]:
    """The function `spec` names (`path/to/file.py:function`, `package.module:function` or, as the resolved config
    writes a module found beside it, `/abs/dir/package.module:function`); `kind` ("reward", "tool") starts
    the UserFunctionError's message."""
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise UserFunctionError(f"{kind} {spec!r}: write it as \"package.module:function\" or "
                                f"\"path/to/file.py:function\"")
    if source.endswith(".py"):
        module, where = import_file(spec, kind, source), str(Path(source).expanduser().resolve())
    else:
        root, _, name = source.rpartition("/")
        module, where = import_module(spec, kind, name, root or None), name
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserFunctionError(f"{kind} {spec!r}: {where} has no function {attr!r}")
    return fn


def import_module(spec: str, kind: str, name: str, root: str | None = None) -> ModuleType:
    """Module `name` from the installed packages, `root` (the config's directory it was found in) or the working
    directory, which are put on the path after the installed packages."""
    for directory in ([root] if root else []) + [os.getcwd()]:
        if directory not in sys.path:
            sys.path.append(directory)
    importlib.invalidate_caches()  # a directory's listing may be cached from before the module was written
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise _raised(spec, kind, name, e) from None  # the module's own import of something missing
        places = ", ".join(([root] if root else []) + [f"the working directory {os.getcwd()}"])
        raise UserFunctionError(f"{kind} {spec!r}: cannot import {name}: ModuleNotFoundError: {e} (looked in the "
                                f"installed packages, {places}; a file is named \"path/to/file.py:function\", "
                                f"relative to the config file's directory)") from None
    except Exception as e:  # an import error of any kind inside the user's module
        raise _raised(spec, kind, name, e) from None


def import_file(spec: str, kind: str, path: str) -> ModuleType:
    """A module from a file, imported once per process under a name of its own."""
    file = Path(path).expanduser().resolve()
    name = f"tide_user_{file.stem}_{hashlib.sha256(str(file).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    if not file.is_file():
        raise UserFunctionError(f"{kind} {spec!r}: no such file {file}")
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before running it, as an import does (dataclasses and pickling look it up)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise _raised(spec, kind, str(file), e) from None
    return module


def _raised(spec: str, kind: str, where: str, e: BaseException) -> UserFunctionError:
    return UserFunctionError(f"{kind} {spec!r}: cannot import {where}: {type(e).__name__}: {e} (raised by the "
                             f"module's own code)")
