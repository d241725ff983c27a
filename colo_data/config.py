"""Pipeline configs: a TOML file naming a dataset definition (`pipeline = "pkg.module:function"`)
with the function's keyword arguments under `[args]`, sidecar settings under `[sidecar]` and
deployment settings under `[deploy]` (read by `colo_data.deploy.manifest`). A file holding only
the `pipeline` line is valid and takes every default."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import tomllib
import traceback
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from colo_data import defaults
from colo_data.errors import ColoDataError, ConfigError
from colo_data.setting_checks import as_int
from colo_data.workers.settings import workers_from

if TYPE_CHECKING:
    from colo_data.pipeline.kinds import AnyPipeline

_TOP_KEYS = {"pipeline", "args", "sidecar", "deploy"}
CONFIG_IS_CODE = (
    "A config is code: its `pipeline` names a Python function that colo-data imports and calls, as the user "
    "running the command; give only configs you trust (their modules are found on PYTHONPATH and among the "
    "installed packages, then in the working directory). What colo-data refuses to call (a standard-library "
    "module's function, one imported from another module, a builtin, a class) is a check against mistakes, "
    "not a security boundary."
)
_SIDECAR_KEYS = {"workers", "slots", "shm_dir"}


@dataclass(frozen=True)
class Config:
    """A parsed config file: where the dataset definition lives and how to call it."""

    path: str
    pipeline: str
    args: dict[str, Any] = field(default_factory=dict)
    sidecar: dict[str, Any] = field(default_factory=dict)
    deploy: dict[str, Any] = field(default_factory=dict)

    def _failed(self, doing: str, error: Exception) -> ConfigError:
        """The config's pipeline code raised: its error and where (the last frames of the
        user's code, not importlib's or this module's), as a ConfigError."""
        machinery = {__file__, importlib.__file__}
        frames = [
            f for f in traceback.extract_tb(error.__traceback__)
            if f.filename not in machinery and not f.filename.startswith("<frozen")
        ]
        where = "".join(traceback.format_list(frames[-2:]) + traceback.format_exception_only(error)).rstrip()
        fix = "Fix the pipeline's code"
        if isinstance(error, ModuleNotFoundError) and error.name and _in_working_directory(error.name.partition(".")[0]):
            fix = (
                f"Module {error.name!r} is in the working directory, which is not on the import path (a module left "
                "in a shared directory would be found there): make the two modules one package, or add the "
                "directory to PYTHONPATH"
            )
        return ConfigError(
            f"{self.path}: pipeline = {self.pipeline!r}: {doing} raised {type(error).__name__}: {error}. "
            f"{fix}; the end of its traceback:\n{where}"
        )

    def build(self) -> AnyPipeline:
        """Import `module:function` (from PYTHONPATH and the installed packages, then the
        working directory: `_import`) and call it: a `cd.Pipeline` or a `cd.GrainPipeline`.
        A standard-library module, a target that is not a Python function (a builtin such as
        `os:system`, a class) or a function that the module imported from another one (such
        as `shutil.rmtree` in a library) is refused before anything is called: a check
        against mistakes, not a boundary (any function a config names runs)."""
        # the pipeline machinery, imported only when a pipeline is built
        from colo_data.pipeline.kinds import AnyPipeline

        module_name, _, function_name = self.pipeline.partition(":")
        if module_name.partition(".")[0] in sys.stdlib_module_names:
            raise ConfigError(
                f"{self.path}: pipeline = {self.pipeline!r}: a standard-library function, not a pipeline factory. "
                f"{CONFIG_IS_CODE}"
            )
        try:
            module = _import(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                # the module is there; a module that it imports is not
                raise self._failed(f"importing module {module_name!r}", e) from e
            raise ConfigError(
                f"{self.path}: pipeline = {self.pipeline!r}: cannot find module {module_name!r} ({e}); "
                "run from the directory that holds it or add it to PYTHONPATH"
            ) from e
        except Exception as e:  # the module raised while it was imported
            raise self._failed(f"importing module {module_name!r}", e) from e
        function = getattr(module, function_name, None)
        where = f"module {module_name!r} ({getattr(module, '__file__', None)})"
        if not inspect.isfunction(function):
            found = "no function" if function is None else f"a {type(function).__name__}, not a Python function,"
            raise ConfigError(
                f"{self.path}: pipeline = {self.pipeline!r}: {where} has {found} {function_name!r}: give the "
                f"function that returns the pipeline. {CONFIG_IS_CODE}"
            )
        if function.__module__ != module_name:  # `pycparser:check_output` is subprocess.check_output
            raise ConfigError(
                f"{self.path}: pipeline = {self.pipeline!r}: {where} imported {function_name!r} from module "
                f"{function.__module__!r}, which defines it: name the function in the module that defines it, and "
                f"only a function that returns the pipeline. {CONFIG_IS_CODE}"
            )
        try:
            pipeline = function(**self.args)
        except ColoDataError:
            raise
        except TypeError as e:
            raise ConfigError(f"{self.path}: [args] do not fit {self.pipeline}: {e}") from e
        except Exception as e:
            raise self._failed(f"calling {self.pipeline}", e) from e
        if not isinstance(pipeline, AnyPipeline):
            raise ConfigError(
                f"{self.path}: {self.pipeline} returned {type(pipeline).__name__}, not a colo_data.Pipeline or "
                "colo_data.GrainPipeline"
            )
        return pipeline


def _in_working_directory(name: str) -> ModuleSpec | None:
    """Where the top-level module `name` lies in the working directory, if it does."""
    return importlib.machinery.PathFinder.find_spec(name, [os.getcwd()])


def _import(module_name: str) -> ModuleType:
    """Import a config's module: from the import path (PYTHONPATH, the installed packages),
    else the top-level module or package it belongs to from the working directory, without
    putting the directory on the path. On the path, it stayed there for the rest of the
    command, where any import of a module that is not installed (pyarrow's optional
    `pandas`, JAX's `libtpu` and plugins) found a file that another user of a shared
    directory left there; and children inherit the path. A module from the directory is
    sent to the processes that make batches by value (cloudpickle), so they never need to
    find it: its own imports of modules beside it fail (`_failed` says why)."""
    top = module_name.partition(".")[0]
    spec = None if importlib.util.find_spec(top) else _in_working_directory(top)
    if spec is not None:
        module = importlib.util.module_from_spec(spec)  # a directory without __init__.py: its loader is made here
        sys.modules[top] = module  # as an import does: a package's submodules find it there
        try:
            if spec.loader is not None:
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[top]
            raise
        import cloudpickle  # noqa: PLC0415 - only for such a module: `colo-data --help` imports this one

        cloudpickle.register_pickle_by_value(module)
    return importlib.import_module(module_name)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and check a config file; every problem is one ConfigError naming the key."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror})") from e
    except UnicodeDecodeError as e:  # a binary file, or text in another encoding: TOML is UTF-8
        raise ConfigError(
            f"{path}: not a TOML config: byte {e.start} ({e.object[e.start:e.start + 1]!r}) is not UTF-8 text. "
            "Give the path of a .toml file (UTF-8 text), e.g. configs/demo.toml."
        ) from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    reference = data.get("pipeline")
    if not isinstance(reference, str) or reference.count(":") != 1 or not all(reference.split(":")):
        raise ConfigError(f'{path}: pipeline = {reference!r}: give "package.module:function"')
    args, sidecar, deploy = data.get("args", {}), data.get("sidecar", {}), data.get("deploy", {})
    if not isinstance(args, dict) or not isinstance(sidecar, dict):
        raise ConfigError(f"{path}: [args] and [sidecar] must be tables")
    if not isinstance(deploy, dict):
        raise ConfigError(f"{path}: [deploy] must be a table (its keys are checked by `colo-data manifest`)")
    unknown = set(sidecar) - _SIDECAR_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)} in [sidecar]; allowed: {sorted(_SIDECAR_KEYS)}")
    workers, slots = sidecar.get("workers", "auto"), sidecar.get("slots", defaults.SLOTS)
    sidecar["workers"] = workers_from(workers, f"{path}: [sidecar] workers")
    if as_int(slots) is None or slots < 2:
        raise ConfigError(f"{path}: [sidecar] slots = {slots!r}: give an int >= 2")
    if not isinstance(sidecar.get("shm_dir", ""), str):
        raise ConfigError(f"{path}: [sidecar] shm_dir = {sidecar['shm_dir']!r}: give a directory path (a string)")
    return Config(str(path), reference, args, sidecar, deploy)
