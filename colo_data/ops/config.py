"""Pipeline configs: a TOML file naming a dataset definition (`pipeline = "pkg.module:function"`)
with the function's keyword arguments under `[args]`, sidecar settings under `[sidecar]` and
deployment settings under `[deploy]` (read by `colo_data.ops.manifest`). A file holding only
the `pipeline` line is valid and takes every default."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import tomllib
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colo_data import defaults
from colo_data.errors import ColoDataError, ConfigError
from colo_data.io.integers import as_int
from colo_data.workers.settings import workers_from

if TYPE_CHECKING:
    from colo_data.pipeline.kinds import AnyPipeline

_TOP_KEYS = {"pipeline", "args", "sidecar", "deploy"}
CONFIG_IS_CODE = (
    "A config is code: its `pipeline` names a Python function that colo-data imports and calls, as the user "
    "running the command; give only configs you trust (their modules are found on PYTHONPATH, then in the "
    "working directory)."
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
        return ConfigError(
            f"{self.path}: pipeline = {self.pipeline!r}: {doing} raised {type(error).__name__}: {error}. "
            f"Fix the pipeline's code; the end of its traceback:\n{where}"
        )

    def build(self) -> AnyPipeline:
        """Import `module:function` (from PYTHONPATH and the installed packages, then the
        working directory) and call it: a `cd.Pipeline` or a `cd.GrainPipeline`. A
        standard-library module, or a target that is not a Python function (a builtin such as
        `os:system`, a class), is refused before anything is called."""
        # the pipeline machinery, imported only when a pipeline is built
        from colo_data.pipeline.kinds import AnyPipeline

        module_name, _, function_name = self.pipeline.partition(":")
        if module_name.partition(".")[0] in sys.stdlib_module_names:
            raise ConfigError(
                f"{self.path}: pipeline = {self.pipeline!r}: a standard-library function, not a pipeline factory. "
                f"{CONFIG_IS_CODE}"
            )
        if os.getcwd() not in sys.path:  # last: a module left in the directory never shadows an installed one
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_name)
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
        if not inspect.isfunction(function):
            found = "no function" if function is None else f"a {type(function).__name__}, not a Python function,"
            raise ConfigError(
                f"{self.path}: pipeline = {self.pipeline!r}: module {module_name!r} ({getattr(module, '__file__', None)}) "
                f"has {found} {function_name!r}: give the function that returns the pipeline. {CONFIG_IS_CODE}"
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
