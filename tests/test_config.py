"""Config files: the shipped examples build, and every mistake is one ConfigError naming
the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

import colo_data as cd
from colo_data.ops.config import load_config

CONFIGS = Path(__file__).parent.parent / "configs"


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
    (tmp_path / "my_data.py").write_text(
        "import colo_data as cd\n"
        f"def pipeline():\n    return cd.Pipeline(source=cd.ArrowSource({str(token_corpus)!r}), global_batch_size=8)\n"
    )
    monkeypatch.chdir(tmp_path)  # imported from the working directory
    pipeline = load_config(write(tmp_path, 'pipeline = "my_data:pipeline"\n')).build()
    assert len(pipeline.source) == 120


@pytest.mark.parametrize(
    "text, match",
    [
        ("pipeline = [", "not valid TOML"),
        ("", r"pipeline = None: give \"package.module:function\""),
        ('pipeline = "colo_data.ops.demo"', "give \"package.module:function\""),
        ('pipeline = "colo_data.ops.demo:pipeline"\nbatch = 3', r"unknown key\(s\) \['batch'\]"),
        ('pipeline = "colo_data.ops.demo:pipeline"\n[sidecar]\nthreads = 2', r"unknown key\(s\) \['threads'\] in \[sidecar\]"),
        ('pipeline = "colo_data.ops.demo:pipeline"\nargs = 3', r"\[args\] and \[sidecar\] must be tables"),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, match: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(cd.ConfigError, match=match) as raised:
        load_config(path)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize(
    "text, match",
    [
        ('pipeline = "no_such_module_xyz:pipeline"', "cannot find module 'no_such_module_xyz'"),
        ('pipeline = "colo_data.ops.demo:nothing"', "has no function 'nothing'"),
        ('pipeline = "colo_data.ops.demo:pipeline"\n[args]\nwidth = 3', r"\[args\] do not fit colo_data.ops.demo:pipeline"),
        ('pipeline = "colo_data.ops.demo:cache_dir"', "returned PosixPath, not a colo_data.Pipeline"),
    ],
)
def test_configs_that_cannot_build(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(cd.ConfigError, match=match):
        load_config(write(tmp_path, text)).build()


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(cd.ConfigError, match="cannot read the config"):
        load_config(tmp_path / "none.toml")
