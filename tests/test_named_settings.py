"""Every setting that colo-data's messages, docstrings and comments tell a user to set
exists: `cd.Name(arg=...)` has that parameter, a bare setting (`set X`, `a larger X`) is a
parameter of a public constructor or function or a key of the config file, `[section] key`
is a key of that section, `--flag` an option of the `colo-data` command and `COLO_DATA_*` an
environment variable that colo-data reads. A message once told users to give the Loader "a
larger sidecar_timeout", a setting that never existed (it is `cd.Sidecar(timeout=...)`)."""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
import types
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import click
import pytest

import colo_data as cd
from colo_data import config
from colo_data.cli import main as cli
from colo_data.deploy import manifest

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

PACKAGE = Path(cd.__file__).parent
_IDENT = r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+"  # a setting's name: snake_case with at least one underscore
_SETTING = rf"`?(?:--[a-z][\w-]*|COLO_DATA_[A-Z_]+|\[[a-z]+\]\s+[a-z_]+|{_IDENT}(?![\w-])|`[a-z_]+`)`?"
# `set X`, `raise X`, `give a connect_timeout`, `a larger X`, `give the Loader a larger X`
_TOLD = re.compile(
    r"\b(?:set|raise|lower|increase|decrease|reduce|give(?:\s+(?:it|the\s+\w+))?(?:\s+(?:a|an))?"
    rf"|(?:a|an)\s+(?:larger|smaller|longer|shorter|higher|lower))\s+(?:the\s+)?({_SETTING})"
)
_CALL = re.compile(r"\b(cd\.)?([A-Z]\w*)\(([^()]*)")  # `cd.Sidecar(timeout=...`, `Loader(pipeline, state=`
_POSSESSIVE = re.compile(rf"\b(?:cd\.)?([A-Z]\w*)'s\s+(`[a-z_]+`|{_IDENT})")  # `the Loader's sidecar_timeout`
# wherever they are named: an environment variable, a config key (`[deploy] ray_nodes`, `[sidecar] slots = 4`)
_NAMED = re.compile(rf"\bCOLO_DATA_[A-Z]+(?:_[A-Z]+)*\b|\[[a-z]+\]\s+(?:{_IDENT}|[a-z]+(?=\s*=))")


def _text(node: ast.AST) -> str | None:
    """A string literal's text, an f-string's with `{}` for each replacement field."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every string literal, docstring and comment of `source`."""
    tree = ast.parse(source)
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        text = None if id(node) in parts else _text(node)
        if text is not None:
            yield node.lineno, text
    block: list[str] = []  # a comment of several lines is one text
    start = last = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            if block and token.start[0] != last + 1:
                yield start, " ".join(block)
                block = []
            start = token.start[0] if not block else start
            block.append(token.string.lstrip("#").strip())
            last = token.start[0]
    if block:
        yield start, " ".join(block)


def _public() -> dict[str, object]:
    """colo-data's public callables: the top-level names and the public modules' functions."""
    found: dict[str, object] = {}
    for name in cd.__all__:
        value = getattr(cd, name)
        if isinstance(value, types.ModuleType):
            found.update((f"{name}.{n}", v) for n, v in vars(value).items() if inspect.isfunction(v) and not n.startswith("_"))
        elif callable(value) and not (isinstance(value, type) and issubclass(value, BaseException)):
            found[name] = value
    return found


def _parameters(value: object) -> set[str]:
    try:
        return set(inspect.signature(value).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return set()


def _command_options(command: click.Command) -> tuple[set[str], set[str]]:
    """The `--flags` and environment variables of `command` and its subcommands."""
    flags, envvars = set(), set()
    for param in command.params:
        flags.update(o for o in param.opts + param.secondary_opts if o.startswith("--"))
        envvars.update([param.envvar] if isinstance(param.envvar, str) else param.envvar or [])
    for sub in getattr(command, "commands", {}).values():
        more_flags, more_envvars = _command_options(sub)
        flags |= more_flags
        envvars |= more_envvars
    return flags, envvars


def _constants() -> set[str]:
    """Every whole string literal of the package (an environment variable's name is one)."""
    return {
        node.value
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


class Settings:
    """What exists to be set: the public API's parameters, the config file's keys, the
    command's options and the environment variables colo-data reads."""

    def __init__(self) -> None:
        self.public = _public()
        self.parameters = set().union(*(_parameters(v) for v in self.public.values()))
        deploy = {f.name for f in fields(manifest.Deploy)}
        self.sections = {"sidecar": set(config._SIDECAR_KEYS), "deploy": deploy}
        self.keys = set().union(*self.sections.values())
        self.flags, envvars = _command_options(cli)
        self.envvars = envvars | {c for c in _constants() if re.fullmatch(r"COLO_DATA_[A-Z_]+", c)}

    def missing(self, text: str) -> list[str]:
        """The settings `text` names that do not exist, each with why."""
        found = []
        for prefixed, name, args in _CALL.findall(text):
            if name not in self.public:
                if prefixed:
                    found.append(f"cd.{name}: no such public name")
                continue
            for arg in re.findall(r"\b([a-z_]\w*)=", args):
                if arg not in _parameters(self.public[name]):
                    found.append(f"{name}({arg}=...): {name} has no parameter {arg!r}")
        for name, attribute in _POSSESSIVE.findall(text):
            attribute = attribute.strip("`")
            if name in self.public and attribute not in _parameters(self.public[name]) | set(dir(self.public[name])):
                found.append(f"{name}'s {attribute}: {name} has no parameter or attribute {attribute!r}")
        for setting in {*_TOLD.findall(text), *_NAMED.findall(text)}:
            why = self._unknown(setting.strip("`"))
            if why:
                found.append(why)
        return found

    def _unknown(self, setting: str) -> str | None:
        """Why `setting` (a flag, an environment variable, a config key or a bare name) does not exist, if it does not."""
        if setting.startswith("--"):
            return None if setting in self.flags else f"{setting}: no option of the colo-data command"
        if setting.startswith("COLO_DATA_"):
            return None if setting in self.envvars else f"{setting}: an environment variable colo-data does not read"
        section = re.fullmatch(r"\[([a-z]+)\]\s+(\w+)", setting)
        if section:
            if section[1] not in self.sections:
                return None  # [args]: the pipeline function's own arguments
            return None if section[2] in self.sections[section[1]] else f"{setting}: no key of the config's [{section[1]}]"
        if setting in self.parameters or setting in self.keys:
            return None
        return f"{setting}: no parameter of a public constructor or function, nor a config key"


@pytest.fixture(scope="module")
def settings() -> Settings:
    """What exists to be set, read once for the module."""
    return Settings()


@pytest.mark.parametrize(
    ("text", "missing"),
    [
        ("if its host is that busy, give the Loader a larger sidecar_timeout.", "sidecar_timeout"),
        ("a trainer that hears nothing for the Loader's `sidecar_timeout` takes it for frozen", "sidecar_timeout"),
        ("as long as cd.Sidecar(timeot=...) says", "timeot"),
        ("resume with cd.Loader(pipeline, stat=state)", "stat"),
        ("set cd.Sidcar(shm_dir=...)", "Sidcar"),
        ("set --shm-dirs", "--shm-dirs"),
        ("or set COLO_DATA_SHM_DIRECTORY", "COLO_DATA_SHM_DIRECTORY"),
        ("set [sidecar] shm_directory", "shm_directory"),
        ("raise ray_cpu", "ray_cpu"),
    ],
)
def test_the_check_finds_a_setting_that_does_not_exist(settings: Settings, text: str, missing: str) -> None:
    """The check itself: each way of naming a setting that does not exist is found."""
    assert any(missing in why for why in settings.missing(text)), settings.missing(text)


@pytest.mark.parametrize(
    "text",
    [
        "give the Loader a larger prefetch",
        "cd.Sidecar(timeout=...), cd.Loader(pipeline, state=state)",
        "set --shm-dir or COLO_DATA_SHM_DIR, or [sidecar] shm_dir",
        "lower ray_actors or raise ray_cpus",
        "set sidecar_cpus = 3",
    ],
)
def test_the_check_passes_settings_that_exist(settings: Settings, text: str) -> None:
    """The check itself: settings that exist, named each way, are not reported."""
    assert settings.missing(text) == []


def test_every_setting_the_package_tells_users_to_set_exists(settings: Settings) -> None:
    """Scans every string literal, docstring and comment of colo_data/."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {why}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in texts(path.read_text())
        for why in settings.missing(text)
    ]
    assert found == []
