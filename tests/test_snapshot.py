"""Model resolution and `flux2klein fetch`: the Hugging Face cache (hit, miss, partial), offline
mode, what is downloaded, local and converted directories, and the generated `tiny` alias."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError
from typer.testing import CliRunner

from flux2klein_cli.cli.app import app
from flux2klein_cli.core.errors import CheckpointError, UserInputError
from flux2klein_cli.core.hub.random_checkpoint import write_random_checkpoint
from flux2klein_cli.core.hub.snapshot import (
    ALLOW_PATTERNS,
    TINY_DIR_NAME,
    describe,
    resolve,
    resolve_model,
    snapshot_problems,
)
from tests.fixtures.hub_cache import COMMIT, populate, repo_folder

REPO = "black-forest-labs/FLUX.2-klein-4B"
runner = CliRunner()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete snapshot (the tiny geometry) to put into hub caches."""
    return write_random_checkpoint(tmp_path_factory.mktemp("src") / "snapshot", "tiny")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, made huggingface_hub's current one (as HF_HOME / HF_HUB_CACHE would)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any call that is not cache-only fails the test."""

    def refuse(*args, **kwargs):
        if not kwargs.get("local_files_only"):
            raise AssertionError("the network was used")
        return real(*args, **kwargs)

    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


def fetch(*args: str):
    return runner.invoke(app, ["fetch", *args], catch_exceptions=False)


# ---------------------------------------------------------------- the cache


def test_cached_snapshot_is_found_without_the_network(hub: Path, source: Path, monkeypatch) -> None:
    snapshot = populate(hub, REPO, source, extra_root_files={"flux-2-klein-4b.safetensors": b"x" * 64})
    no_network(monkeypatch)
    for model in ("4b", REPO):
        resolved = resolve(model, download=True)
        assert resolved.path == snapshot and resolved.kind == "hub-cache"
        assert resolved.repo_id == REPO and resolved.revision == COMMIT
    # The root single-file checkpoint is listed in the repo but not needed: still complete.
    assert resolve_model("4b", revision=COMMIT) == snapshot

    result = fetch("4b")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{snapshot}\n"  # only the path: path=$(flux2klein fetch 4b) works

    report = json.loads(fetch("4b", "--json").stdout)
    assert report["path"] == str(snapshot) and report["revision"] == COMMIT and report["repo_id"] == REPO
    assert "transformer/diffusion_pytorch_model.safetensors.index.json" in report["files"]
    assert report["bytes"] == sum(p.stat().st_size for p in source.rglob("*") if p.is_file())


def test_missing_model_offline_names_the_fetch_command(hub: Path, monkeypatch) -> None:
    offline(monkeypatch)
    no_network(monkeypatch)
    result = fetch("9b-kv")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "black-forest-labs/FLUX.2-klein-9b-kv" in result.stderr and "offline" in result.stderr
    assert "flux2klein fetch 9b-kv" in result.stderr and "Traceback" not in result.stderr

    result = fetch("base-4b", "--revision", "v1.0", "--offline")
    assert result.exit_code == 2 and "flux2klein fetch base-4b --revision v1.0" in result.stderr


def test_model_commands_never_download_implicitly(hub: Path, monkeypatch) -> None:
    no_network(monkeypatch)
    with pytest.raises(CheckpointError, match="download it with: flux2klein fetch 4b"):
        resolve_model("4b")


@pytest.mark.parametrize("tree", [True, False], ids=["with-tree-listing", "without"])
def test_partial_snapshot_is_a_clear_error(hub: Path, source: Path, monkeypatch, tree: bool) -> None:
    snapshot = populate(hub, REPO, source, tree=tree)
    shard = next((snapshot / "transformer").glob("*-00002-of-*.safetensors"))
    shard.resolve().unlink()  # an interrupted download: the link is there, its blob is not
    offline(monkeypatch)
    result = fetch("4b")
    assert result.exit_code == 2 and result.stdout == ""
    assert "incomplete" in result.stderr and shard.name in result.stderr
    assert "flux2klein fetch 4b" in result.stderr
    assert any(shard.name in p for p in snapshot_problems(snapshot))


def test_partial_snapshot_is_completed_when_online(hub: Path, source: Path, monkeypatch) -> None:
    snapshot = populate(hub, REPO, source)
    shard = next((snapshot / "transformer").glob("*-00002-of-*.safetensors"))
    blob = shard.resolve()
    data = blob.read_bytes()
    blob.unlink()
    calls = []

    def download(repo_id, **kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            return real(repo_id, **kwargs)
        blob.write_bytes(data)  # what a real download would restore
        return str(snapshot)

    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    resolved = resolve("4b", download=True)
    assert resolved.kind == "hub" and resolved.path == snapshot and not snapshot_problems(snapshot)
    assert calls[-1]["allow_patterns"] == ALLOW_PATTERNS and not calls[-1].get("local_files_only")


def test_downloads_only_what_the_pipeline_reads() -> None:
    from huggingface_hub.utils import filter_repo_objects

    repo_files = [
        "model_index.json", "README.md", "LICENSE.md", "flux-2-klein-4b.safetensors", "teaser.png",
        "transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model.safetensors.index.json", "text_encoder/model-00001-of-00002.safetensors",
        "vae/diffusion_pytorch_model.safetensors", "tokenizer/tokenizer.json", "scheduler/scheduler_config.json",
    ]
    kept = set(filter_repo_objects(repo_files, allow_patterns=ALLOW_PATTERNS))
    assert kept == {f for f in repo_files if "/" in f} | {"model_index.json"}


@pytest.mark.slow
def test_hub_environment_variables_in_a_fresh_process(tmp_path: Path, source: Path) -> None:
    """HF_HOME and HF_HUB_OFFLINE as a user sets them, read by huggingface_hub itself."""
    snapshot = populate(tmp_path / "home" / "hub", REPO, source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    code = "from flux2klein_cli.cli.app import main; main()"
    done = subprocess.run([sys.executable, "-c", code, "fetch", "4b"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{snapshot}\n"
    done = subprocess.run([sys.executable, "-c", code, "fetch", "9b"], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "flux2klein fetch 9b" in done.stderr and done.stdout == ""


# ---------------------------------------------------------------- local directories and names


def test_local_directories_are_returned_as_they_are(source: Path, tmp_path: Path, monkeypatch) -> None:
    no_network(monkeypatch)
    assert resolve_model(str(source)) == source
    monkeypatch.chdir(source.parent)
    assert resolve_model(source.name) == source  # a relative path wins over an alias or repo id
    result = fetch(str(source))
    assert result.exit_code == 0 and result.stdout == f"{source}\n"
    assert describe(resolve(str(source)))["revision"] is None

    with pytest.raises(UserInputError, match="^revision applies to hub models"):
        resolve_model(str(source), revision="main")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(UserInputError, match="not a directory"):
        resolve_model(str(tmp_path / "file.txt"))
    with pytest.raises(UserInputError, match="not a model alias"):
        resolve_model("./no/such/dir")
    with pytest.raises(UserInputError, match="empty"):
        resolve_model(" ")


def test_fetch_checks_a_local_snapshot(source: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    next((broken / "text_encoder").glob("model-00001-of-*.safetensors")).unlink()
    result = fetch(str(broken))
    assert result.exit_code == 2 and "model-00001-of-" in result.stderr and result.stdout == ""


def test_tiny_is_written_once_into_the_flux2klein_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))
    path = resolve_model("tiny")
    assert path == tmp_path / "cache" / TINY_DIR_NAME and not snapshot_problems(path)
    stamp = (path / "model_index.json").stat().st_mtime_ns
    assert resolve_model("TINY") == path and (path / "model_index.json").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [TINY_DIR_NAME]  # no temporary left behind
    result = fetch("tiny")
    assert result.exit_code == 0 and result.stdout == f"{path}\n"
    with pytest.raises(UserInputError, match="revision"):
        resolve_model("tiny", revision="main")


def test_repo_folder_helper_matches_huggingface_hub(hub: Path, source: Path) -> None:
    """The hand-made cache is one huggingface_hub recognises (guards the test helper itself)."""
    populate(hub, REPO, source)
    info = huggingface_hub.scan_cache_dir(hub)
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.repo_path == repo_folder(hub, REPO)
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT and revision.refs == frozenset({"main"})
    with pytest.raises(LocalEntryNotFoundError):
        huggingface_hub.snapshot_download("black-forest-labs/FLUX.2-klein-9B", local_files_only=True)
