"""Config files: the shipped examples build, and every mistake is one ConfigError naming
the file and the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import colo_data as cd
from colo_data.cli import main
from colo_data.config import load_config

pytestmark = pytest.mark.unit  # the fast tier: `make test-fast` (docs/development.md)

CONFIGS = Path(__file__).parent.parent / "configs"
COLO = Path(sys.executable).parent / "colo-data"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return path


def test_shipped_demo_config_builds_the_demo_pipeline() -> None:
    config = load_config(CONFIGS / "demo.toml")
    assert config.sidecar == {"workers": "auto"}
    pipeline = config.build()
    assert pipeline.global_batch_size == 32 and pipeline.order.shuffle == "block"


def test_pipeline_line_alone_takes_every_default(tmp_path: Path, token_corpus: Path, monkeypatch) -> None:
    """A file of the `pipeline` line alone: no [args] (the function's own defaults), the
    sidecar's workers "auto" (slots and shm_dir left to each command's defaults), no [deploy]."""
    (tmp_path / "my_data.py").write_text(
        "import colo_data as cd\n"
        f"def pipeline(batch=8):\n    return cd.Pipeline(source=cd.ArrowSource({str(token_corpus)!r}), global_batch_size=batch)\n"
    )
    monkeypatch.chdir(tmp_path)  # imported from the working directory
    config = load_config(write(tmp_path, 'pipeline = "my_data:pipeline"\n'))
    assert (config.args, config.sidecar, config.deploy) == ({}, {"workers": "auto"}, {})
    pipeline = config.build()
    assert len(pipeline.source) == 120 and pipeline.global_batch_size == 8


@pytest.mark.parametrize(
    "text, match",
    [
        ("pipeline = [", "not valid TOML"),
        ("", r"pipeline = None: give \"package.module:function\""),
        ('pipeline = "colo_data.demo"', "give \"package.module:function\""),
        ('pipeline = "colo_data.demo:pipeline"\nbatch = 3', r"unknown key\(s\) \['batch'\]"),
        ('pipeline = "colo_data.demo:pipeline"\n[sidecar]\nthreads = 2', r"unknown key\(s\) \['threads'\] in \[sidecar\]"),
        ('pipeline = "colo_data.demo:pipeline"\nargs = 3', r"\[args\] and \[sidecar\] must be tables"),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, match: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(cd.errors.ConfigError, match=match) as raised:
        load_config(path)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize(
    "text, match",
    [
        ('pipeline = "no_such_module_xyz:pipeline"', "cannot find module 'no_such_module_xyz'"),
        ('pipeline = "colo_data.demo:nothing"', "has no function 'nothing'"),
        ('pipeline = "colo_data.demo:pipeline"\n[args]\nwidth = 3', r"\[args\] do not fit colo_data.demo:pipeline"),
        ('pipeline = "colo_data.demo:cache_dir"', "returned PosixPath, not a colo_data.Pipeline"),
    ],
)
def test_configs_that_cannot_build(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(cd.errors.ConfigError, match=match):
        load_config(write(tmp_path, text)).build()


def test_a_module_left_in_the_working_directory_never_shadows_an_installed_one(tmp_path: Path, token_corpus: Path) -> None:
    """A `tokenizers.py` left in a shared directory that a config runs from is not what
    `import tokenizers` finds, in the config's module or after it, nor in the sidecar and
    the worker process that make the batches (it ran as root when the working directory
    came first on the path); the config's own module still comes from there."""
    (tmp_path / "tokenizers.py").write_text("open('PLANTED_RAN', 'w').write('the planted module ran')\n")
    (tmp_path / "shared_pipelines.py").write_text(
        "import colo_data as cd\n"
        "def padded(corpus):\n"
        "    import tokenizers  # as cd.tokenize does once the config is loaded\n"
        "    assert hasattr(tokenizers, 'Tokenizer'), tokenizers.__file__\n"
        "    return cd.Pipeline(source=cd.ArrowSource(corpus, columns=['id', 'tokens']), global_batch_size=8,\n"
        "                       transforms=[real_tokenizers, cd.pad_or_truncate('tokens', 8)], index_column='_index')\n"
        "def real_tokenizers(batch):\n"
        "    import tokenizers  # where the batches are made: the sidecar and its worker process\n"
        "    assert hasattr(tokenizers, 'Tokenizer'), tokenizers.__file__\n"
        "    return batch\n"
    )
    config = write(tmp_path, f'pipeline = "shared_pipelines:padded"\n[args]\ncorpus = "{token_corpus}"\n')
    for command in (["lineage", str(config), "--steps", "1"], ["bench", str(config), "--backend", "sidecar", "--workers", "1"]):
        done = subprocess.run([str(COLO), *command], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr
        assert not (tmp_path / "PLANTED_RAN").exists(), command


def planted(directory: Path, *modules: str, mode: int = 0o1777) -> Path:
    """`directory` made with `mode` (default: shared as /tmp is), holding a module of each
    name that, once imported, leaves a file `RAN-<name>-<pid>` beside itself."""
    directory.mkdir()
    directory.chmod(mode)
    for name in modules:
        (directory / f"{name}.py").write_text(
            "import os\nopen(os.path.join(os.path.dirname(__file__), f'RAN-{__name__}-{os.getpid()}'), 'w').close()\n"
        )
    return directory


def test_a_module_left_in_a_shared_working_directory_never_runs(tmp_path: Path, token_corpus: Path) -> None:
    """Run from a shared directory, a command imported a `pandas.py` that another user left
    there (pyarrow tries `pandas` as an optional import): importing the config's module put
    the working directory on the import path for the rest of the command. The config's
    own module still comes from there, and so do the functions that its worker processes
    and sidecar run."""
    shared = planted(tmp_path / "shared", "pandas", "libtpu", "sitecustomize")
    (shared / "shared_pipelines.py").write_text(
        "import colo_data as cd\n"
        "def padded(corpus):\n"
        "    return cd.Pipeline(source=cd.ArrowSource(corpus, columns=['id', 'tokens']), global_batch_size=8,\n"
        "                       transforms=[same, cd.pad_or_truncate('tokens', 8)], index_column='_index')\n"
        "def same(batch):  # made in the sidecar and its worker process\n"
        "    return batch\n"
    )
    (shared / "shared.toml").write_text(f'pipeline = "shared_pipelines:padded"\n[args]\ncorpus = "{token_corpus}"\n')
    commands = [
        ["doctor", str(CONFIGS / "demo.toml")],
        ["lineage", str(CONFIGS / "lm.toml"), "--steps", "1"],
        ["doctor", "shared.toml"],
        ["bench", "shared.toml", "--backend", "sidecar", "--workers", "1", "--steps", "3"],
    ]
    for command in commands:
        done = subprocess.run([str(COLO), *command], capture_output=True, text=True, cwd=shared, timeout=300)
        assert done.returncode == 0, (command, done.stderr)
        assert not list(shared.glob("RAN-*")), (command, done.stderr)


@pytest.mark.parametrize("backend", [["sidecar"], ["inprocess", "--workers", "1"]], ids=" ".join)
def test_a_sitecustomize_in_a_shared_directory_never_runs_in_a_child(tmp_path: Path, backend: list[str]) -> None:
    """A child process (the local sidecar, the worker processes' fork server) got this
    process's import path as its PYTHONPATH, and `site` imports a `sitecustomize.py` from
    it at start: a trainer started in a shared directory (`python -m` and a script put
    theirs first on the path) ran another user's in the child."""
    shared = planted(tmp_path / "shared", "sitecustomize")
    command = [sys.executable, "-m", "colo_data.cli", "bench", str(CONFIGS / "demo.toml"), "--steps", "3", "--backend"]
    done = subprocess.run([*command, *backend], capture_output=True, text=True, cwd=shared, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not list(shared.glob("RAN-*")), done.stderr


@pytest.mark.parametrize("group, stays", [(0, True), (12345, False)], ids=["its owner's own group", "another group"])
def test_a_directory_its_group_may_write_stays_on_a_childs_path_only_where_the_group_is_its_owners(
    tmp_path: Path, group: int, stays: bool
) -> None:
    """A umask of 002 leaves a user's own checkout group-writable, its group the user's own
    (named after it, with no other member): it stays on a child's path, which imports the
    user's modules from it (here: the sidecar runs its `sitecustomize.py`). Where a group
    of other users may write it, it is left off."""
    if os.geteuid() != 0:
        pytest.skip(f"giving a directory to root's group or to a group of no one needs root (this is uid {os.geteuid()})")
    directory = planted(tmp_path / "project", "sitecustomize", mode=0o775)
    os.chown(directory, 0, group)
    command = [sys.executable, "-m", "colo_data.cli", "bench", str(CONFIGS / "demo.toml"), "--steps", "3", "--backend", "sidecar"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=directory, timeout=300)
    assert done.returncode == 0, done.stderr
    assert bool(list(directory.glob("RAN-sitecustomize-*"))) == stays, done.stderr


@pytest.mark.parametrize(
    "target, match",
    [
        ("os:system", "a standard-library function, not a pipeline factory"),
        ("subprocess:run", "a standard-library function, not a pipeline factory"),
        ("colo_data:Pipeline", r"has a type, not a Python function, 'Pipeline'"),
        ("numpy:add", r"has a ufunc, not a Python function, 'add'"),
    ],
)
def test_a_target_that_is_not_a_pipeline_factory_is_refused_before_it_is_called(
    tmp_path: Path, target: str, match: str
) -> None:
    """`pipeline = "os:system"` ran a command; a standard-library module, a builtin, a class
    or another callable that is not a Python function is refused, and the message says a
    config is code; `--help` of every command that runs one says so too."""
    config = write(tmp_path, f'pipeline = "{target}"\n[args]\ncommand = "touch {tmp_path}/RAN"\n')
    with pytest.raises(cd.errors.ConfigError, match=match) as raised:
        load_config(config).build()
    assert "A config is code" in str(raised.value) and not (tmp_path / "RAN").exists()
    for command in (["bench"], ["doctor"], ["lineage"], ["verify"], ["sidecar", "serve"]):
        shown = CliRunner().invoke(main, [*command, "--help"], terminal_width=400)
        assert "A config is code" in shown.output and "give only configs you trust" in shown.output, command
        assert "is a check against mistakes, not a security boundary" in " ".join(shown.output.split()), command


@pytest.mark.parametrize(
    "target, args",
    [
        ("pycparser:check_output", 'args = "touch {victim}/touched"\nshell = true'),  # subprocess.check_output
        ("fsspec.implementations.cached:rmtree", 'path = "{victim}"'),  # shutil.rmtree
    ],
)
def test_a_function_imported_from_another_module_is_refused_before_it_is_called(tmp_path: Path, target: str, args: str) -> None:
    """The refusal of standard-library functions looked at the module's name only: a
    library's module that imported one (`pycparser:check_output`) ran a shell command, and
    `fsspec...cached:rmtree` removed a directory. A function is called only from the
    module that defines it, and `--help` says that this is no security boundary."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "kept").write_text("not the config's to remove")
    config = write(tmp_path, f'pipeline = "{target}"\n[args]\n' + args.format(victim=victim) + "\n")
    module, _, name = target.partition(":")
    refused = rf"module '{module}' \(.*\) imported '{name}' from module '(subprocess|shutil)'"
    with pytest.raises(cd.errors.ConfigError, match=refused):
        load_config(config).build()
    assert sorted(p.name for p in victim.iterdir()) == ["kept"]


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(cd.errors.ConfigError, match="cannot read the config"):
        load_config(tmp_path / "none.toml")


BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"  # what a config path given by mistake may hold


def test_a_binary_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """Issue 26: it was a raw UnicodeDecodeError."""
    path = tmp_path / "picture.toml"
    path.write_bytes(BINARY)
    with pytest.raises(cd.errors.ConfigError, match=rf"^{path}: not a TOML config: byte 0 \(b'\\x89'\) is not UTF-8 text\. Give"):
        load_config(path)


@pytest.mark.parametrize(
    "command", [["verify"], ["bench"], ["doctor"], ["doctor", "--json"], ["sidecar", "serve", "--socket", "S"]], ids=" ".join
)
def test_every_command_says_a_binary_config_is_not_toml(tmp_path: Path, command: list[str]) -> None:
    """verify, bench, doctor and sidecar serve print the one error line (they printed a
    UnicodeDecodeError traceback); doctor --json prints it as JSON (it printed nothing)."""
    path = tmp_path / "picture.toml"
    path.write_bytes(BINARY)
    at = 2 if command[0] == "sidecar" else 1
    args = [*command[:at], str(path), *(str(tmp_path / "s.sock") if a == "S" else a for a in command[at:])]
    if command[0] == "sidecar":  # it sets process-wide signal handlers: a process of its own
        run = subprocess.run([str(COLO), *args], capture_output=True, text=True, timeout=120)
        code, stdout, stderr = run.returncode, run.stdout, run.stderr
    else:  # in this process: verify and bench import the pipeline machinery before they read the config
        result = CliRunner().invoke(main, args)
        assert isinstance(result.exception, SystemExit), result.exception
        code, stdout, stderr = result.exit_code, result.stdout, result.stderr
    assert code in (1, 2) and f"Error: {path}: not a TOML config: byte 0" in stderr, stderr
    assert "Traceback" not in stdout + stderr, stderr
    if "--json" in command:
        report = json.loads(stdout)
        assert report["type"] == "ConfigError" and report["error"].startswith(f"{path}: not a TOML config"), report


# Digits that are not ASCII: str.isdigit() accepts them and int() fails on "²" and "①" (a raw
# ValueError traceback) or reads "٣" as 3. A count of workers is ASCII digits, else the one
# error line that "x" gets.
UNICODE_DIGITS = ["²", "①", "٣"]


@pytest.mark.parametrize("value", ["x", *UNICODE_DIGITS])
def test_workers_in_other_than_ascii_digits_are_a_config_error(tmp_path: Path, value: str) -> None:
    """A config's `[sidecar] workers`: the ConfigError that "x" gets, naming the file and key."""
    path = write(tmp_path, f'pipeline = "colo_data.demo:pipeline"\n[sidecar]\nworkers = "{value}"')
    with pytest.raises(cd.errors.ConfigError, match=rf"^{path}: \[sidecar\] workers = '{value}': give a number >= 0, \"auto\""):
        load_config(path)


@pytest.mark.parametrize("command", ["bench --workers", "COLO_DATA_WORKERS= sidecar serve"])
@pytest.mark.parametrize("value", UNICODE_DIGITS[:2])
def test_workers_in_other_than_ascii_digits_are_one_error_line(tmp_path: Path, command: str, value: str) -> None:
    """`colo-data bench --workers` and the sidecar's COLO_DATA_WORKERS (its `--workers`)."""
    env = dict(os.environ)
    if command == "bench --workers":
        args = ["bench", str(CONFIGS / "demo.toml"), "--steps", "1", "--workers", value]
    else:
        args, env["COLO_DATA_WORKERS"] = ["sidecar", "serve", "--socket", str(tmp_path / "s.sock")], value
    run = subprocess.run([str(COLO), *args], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode in (1, 2) and "Traceback" not in run.stdout + run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("Error:") and f"--workers = '{value}': give a number >= 0, \"auto\", or Ray workers" in last, last
