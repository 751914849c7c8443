"""`flux2klein env`: the CPU host's report, a simulated accelerator's, and no libtpu noise from any command."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from typer.testing import CliRunner

from flux2klein_cli.cli import env_cmd
from flux2klein_cli.cli.app import app
from flux2klein_cli.core.compile.store import META, ExecutableStore
from flux2klein_cli.core.compile.target import ProgramSpec
from flux2klein_cli.core.devices import cpu
from flux2klein_cli.core.models import cpu_shim, kernels
from flux2klein_cli.core.runs import env_report
from tests.test_light_cli import probe

# Long for the fast tier (`-m "not slow"`, under 4 minutes); the full suite runs it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture
def private_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Caches in tmp_path, none of the user's; no FLUX2KLEIN_* from the caller's shell."""
    for name in list(os.environ):
        if name.startswith("FLUX2KLEIN_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("FLUX2KLEIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FLUX2KLEIN_COMPILE_CACHE", str(tmp_path / "store"))
    return tmp_path


def fill_store(root: Path, count: int) -> None:
    store = ExecutableStore(root)
    for i in range(count):
        fn = jax.jit(lambda x, s=float(i + 2): x * s)
        spec = ProgramSpec(f"scale{i}", fn, (jax.ShapeDtypeStruct((4,), jnp.float32),), {"scale": i + 2})
        _, info = store.load_or_compile(spec)
        assert info.saved, info


def files_bytes(root: Path) -> int:
    return sum(p.lstat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def env_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["env", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_cpu_host_report(private_caches: Path) -> None:
    store = private_caches / "store"
    fill_store(store, 3)
    # A third entry's record edited by someone else: counted, but not signed with this store's key.
    forged = next(p for p in sorted(store.iterdir()) if (p / META).is_file())
    meta = json.loads((forged / META).read_text())
    (forged / META).write_text(json.dumps({**meta, "compile_s": 0.0}))

    report = env_json()
    versions = report["versions"]
    assert versions["jax"] == jax.__version__ and versions["jaxlib"] and versions["flax"]
    assert isinstance(versions["flux2klein"], str)
    assert {"libtpu", "jax-cuda12-plugin", "jax-cuda13-plugin"} <= set(versions)
    assert versions["libtpu"] == (None if importlib.util.find_spec("libtpu") is None else versions["libtpu"])
    assert report["python"] == ".".join(map(str, sys.version_info[:3]))
    assert report["platform"] == "cpu" and report["process_count"] == 1 and report["process_index"] == 0
    host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert report["host"]["memory_bytes"] == host_total and isinstance(report["host"]["cpus"], int)
    assert 0 < report["host"]["available_bytes"] <= host_total
    assert len(report["devices"]) == len(jax.devices())
    for d in report["devices"]:
        assert d["platform"] == "cpu" and d["memory_bytes"] == host_total and d["memory_source"] == "host"
    assert set(report["cpu_bf16"]) == {"plugin", "onemkl", "why", "bf16_compute"}
    assert isinstance(report["cpu_bf16"]["why"], str)
    assert report["cpu_compile"] == cpu.xla_options()
    assert report["attention"] == {"cpu": "blocked", "gpu": "cudnn", "tpu": "splash"}
    assert report["cache_root"] == str(private_caches / "cache")

    s = report["executable_store"]
    assert s["root"] == str(store) and s["exists"] and s["trusted"] is True and s["why"] is None
    assert (s["entries"], s["signed_entries"]) == (3, 2)
    assert s["bytes"] == files_bytes(store) > 0
    assert report["xla_cache"]["state"] == "off" and report["xla_cache"]["dir"] is None
    assert report["environment"] == {"FLUX2KLEIN_CACHE": str(private_caches / "cache"),
                                     "FLUX2KLEIN_COMPILE_CACHE": str(store)}
    assert report["problems"] == []
    if (ROOT / "flux2klein_cli" / "core" / "limits.py").exists():
        assert any(row["field"] == "steps" for row in report["limits"])
        assert all(set(row) == {"field", "bound", "bounds"} for row in report["limits"])
    else:
        assert report["limits"] is None
    line = report["line"]
    assert "\n" not in line and f"jax {jax.__version__}" in line and "store 3 entries" in line
    assert "attention blocked" in line and "trusted" in line


def test_the_table_ends_with_the_bug_report_line(private_caches: Path) -> None:
    fill_store(private_caches / "store", 1)
    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == env_json()["line"]
    assert "executable store" in result.stdout and "1 entries (1 signed)" in result.stdout


def test_an_empty_host_and_a_refused_store(private_caches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No store yet: reported and nothing created. A store others can write: not trusted, one warning."""
    report = env_json()
    assert report["executable_store"]["exists"] is False and report["executable_store"]["trusted"] is None
    assert not (private_caches / "store").exists() and not (private_caches / "cache").exists()

    fill_store(private_caches / "store", 1)
    (private_caches / "store").chmod(0o777)
    monkeypatch.setenv("FLUX2KLEIN_XLA_CACHE", "on")
    report = env_json()
    s = report["executable_store"]
    assert s["trusted"] is False and "writable by other users" in s["why"] and s["signed_entries"] == 0
    assert report["problems"] == [f"executable store: {s['why']}"]
    assert report["xla_cache"]["state"] == "on" and report["xla_cache"]["dir"] == str(private_caches / "cache" / "xla")
    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0 and "warning: executable store" in result.stderr
    assert "untrusted" in result.stdout.strip().splitlines()[-1]


def test_env_builds_no_kernel_shim_in_a_fresh_process(private_caches: Path) -> None:
    """On a fresh cache `env` names the CPU's kernel plugin and says its shim is built on the first
    run: it builds nothing (about 20 s) and writes no folder."""
    done = subprocess.run([sys.executable, "-m", "flux2klein_cli", "env", "--json"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr
    bf16 = json.loads(done.stdout)["cpu_bf16"]
    assert not (private_caches / "cache").exists()
    applies = cpu.is_x86() and cpu.has_bf16_dot(cpu.cpu_flags())
    if applies and cpu_shim.compiler() is not None:
        assert bf16["plugin"] in kernels.PLUGINS and "built on the first run" in bf16["why"]


class FakeDevice:
    """What jax.devices() gives on an NVIDIA host, as far as the report reads it."""

    platform = "gpu"
    device_kind = "NVIDIA H200"

    def __init__(self, id: int, limit: int | None, in_use: int = 0, raises: bool = False):
        self.id, self.process_index = id, 0
        self._limit, self._in_use, self._raises = limit, in_use, raises

    def memory_stats(self) -> dict[str, int] | None:
        if self._raises:
            raise RuntimeError("not supported")
        return None if self._limit is None else {"bytes_limit": self._limit, "bytes_in_use": self._in_use}


def test_a_simulated_gpu_host(private_caches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = [FakeDevice(0, 140 * GIB, 3 * GIB), FakeDevice(1, 80 * GIB), FakeDevice(2, None, raises=True)]
    monkeypatch.setattr(jax, "devices", lambda *a: fakes)
    report = env_report.build_report()
    assert report.platform == "gpu"
    memory = [(d.id, d.kind, d.memory_bytes, d.memory_source, d.in_use_bytes) for d in report.devices]
    assert memory == [(0, "NVIDIA H200", 140 * GIB, "device", 3 * GIB), (1, "NVIDIA H200", 80 * GIB, "device", 0),
                      (2, "NVIDIA H200", None, "unknown", None)]
    assert report.attention["gpu"] == "cudnn"
    assert "gpu x3 (NVIDIA H200, 80.0 GiB)" in report.line() and "attention cudnn" in report.line()
    as_dict = report.as_dict()
    assert json.loads(json.dumps(as_dict))["devices"][0]["memory_bytes"] == 140 * GIB

    monkeypatch.setenv("FLUX2KLEIN_GPU_ATTENTION", "xla")  # XLA's own form kept on NVIDIA GPUs
    report = env_report.build_report()
    assert report.attention["gpu"] == "xla" and "attention xla" in report.line()
    assert report.environment == {"FLUX2KLEIN_CACHE": str(private_caches / "cache"),
                                  "FLUX2KLEIN_COMPILE_CACHE": str(private_caches / "store"),
                                  "FLUX2KLEIN_GPU_ATTENTION": "xla"}

    rows = dict(env_cmd.table_rows(report))  # what the table shows
    assert rows["device 0"] == "NVIDIA H200 (gpu, process 0): 140.0 GiB, 3.0 GiB in use"
    assert rows["device 2"] == "NVIDIA H200 (gpu, process 0): ?"
    assert rows["attention"] == "cpu blocked, gpu xla (this host), tpu splash"
    result = CliRunner().invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == report.line()


def test_a_bad_variable_is_a_problem_not_a_crash(private_caches: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUX2KLEIN_IDLE_AXES", "bogus")
    report = env_json()
    assert report["attention"] == {} and len(report["problems"]) == 1
    assert "FLUX2KLEIN_IDLE_AXES" in report["problems"][0]


def test_env_help_imports_no_jax() -> None:
    report = probe([["env", "--help"], ["env", "--no-such-flag"]])
    assert report["codes"] == [0, 2] and report["heavy"] == []


# ----------------------------------------------------------------------------- libtpu's noise

TPU_NOISE = re.compile(r"tpu|InitGoogle|^[EWF]\d{4} ", re.IGNORECASE | re.MULTILINE)


def bare_env(tmp_path: Path) -> dict[str, str]:
    """The caller's environment without anything that quiets libtpu (what a new user's shell has)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TPU_", "FLUX2KLEIN_", "JAX_")) and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", FLUX2KLEIN_CACHE=str(tmp_path / "cache"),
               FLUX2KLEIN_COMPILE_CACHE=str(tmp_path / "store"))
    if "FLUX2KLEIN_NATIVE_CACHE" in os.environ:  # the suite's shim, built once (a build says nothing)
        env["FLUX2KLEIN_NATIVE_CACHE"] = os.environ["FLUX2KLEIN_NATIVE_CACHE"]
    return env


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the [tpu] extra)")
def test_no_command_prints_libtpu_warnings(tmp_path: Path) -> None:
    from flux2klein_cli.core.devices.tpu import tpu_chips_present

    if tpu_chips_present():
        pytest.skip("a TPU host: libtpu has its chips")
    env = bare_env(tmp_path)

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env={**env, **extra},
                              cwd=tmp_path, timeout=300)

    # The control: on this host plain jax with libtpu does print them, so the check below can fail. (Allowed
    # past libtpu's machine-wide lock, which another process may hold: a libtpu refused by it stays silent.)
    control = run("-c", "import jax; jax.devices()", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    if not TPU_NOISE.search(control.stderr):
        pytest.skip("libtpu prints nothing on this host even without flux2klein's settings")

    done = run("-m", "flux2klein_cli", "env", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["platform"] == "cpu"
    assert not TPU_NOISE.search(done.stderr), done.stderr
    done = run("-m", "flux2klein_cli", "generate", "x", "--model", "tiny", "--height", "64", "--width", "64",
               "--steps", "1", "-o", str(tmp_path / "x.png"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "x.png").is_file()
    assert not TPU_NOISE.search(done.stderr), done.stderr


LOADS_LIBTPU = """
import sys
{setup}
import jax
jax.devices()
maps = open("/proc/self/maps").read()
print("libtpu" in maps)
print(jax.devices()[0].platform)
try:
    jax.devices("tpu")
except RuntimeError as e:
    print(e)
"""
CLI_SETUP = """
from flux2klein_cli.cli import main
main.install_handlers()
main._set_process_environment()
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the [tpu] extra)")
def test_a_host_without_tpu_chips_never_loads_libtpu_for_a_backend(tmp_path: Path) -> None:
    """jax starts its TPU backend wherever libtpu is installed; the CLI's processes skip it without chips."""
    from flux2klein_cli.core.devices.tpu import tpu_chips_present

    if tpu_chips_present():
        pytest.skip("a TPU host: the TPU backend is the one to start")
    env = {**bare_env(tmp_path), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}

    def run(setup: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", LOADS_LIBTPU.format(setup=setup)], capture_output=True,
                              text=True, env={**env, **extra}, cwd=tmp_path, timeout=300)

    control = run("")  # plain jax maps libtpu into the process, so the check below can fail
    assert control.returncode == 0, control.stderr
    if control.stdout.splitlines()[0] != "True":
        pytest.skip("jax did not load libtpu on this host even without flux2klein")
    done = run(CLI_SETUP)
    assert done.returncode == 0, done.stderr
    loaded, platform, why = done.stdout.splitlines()
    assert (loaded, platform) == ("False", "cpu")
    assert "no TPU chips" in why
    # A platform list the user chose is jax's to honour: it starts TPU, and fails on its own terms here.
    chosen = run(CLI_SETUP, JAX_PLATFORMS="cpu,tpu")
    assert chosen.returncode != 0 and "Unable to initialize backend 'tpu'" in chosen.stderr, chosen.stderr
    assert "no TPU chips" not in chosen.stderr


# ----------------------------------------------------------------------------- the GPU and TPU install lines


def readme_install_lines() -> list[str]:
    """The `pip install` lines under "## Install on a GPU or TPU host", as .ci/run's awk picks them."""
    section = (ROOT / "README.md").read_text().split("\n## Install on a GPU or TPU host\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("pip install ")]


def test_the_readme_gpu_and_tpu_lines_are_what_ci_dry_runs() -> None:
    import tomllib

    assert readme_install_lines() == ['pip install -e ".[cuda]"', 'pip install -e ".[tpu]"']
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["cuda"] == ["jax[cuda12]"] and extras["tpu"] == ["jax[tpu]"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "/^## Install on a GPU or TPU host/" in ci
    assert '"python -m pip install --dry-run ${install#pip install }' in ci
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Install on a GPU or TPU host\n", 1)[1].split("\n## ", 1)[0]
    for install in readme_install_lines():  # each followed by the quick start on tiny
        after = section.split(install + "\n", 1)[1].splitlines()[0]
        assert after == 'flux2klein generate "a red fox in snow" --model tiny -o fox.png'
    assert readme.index("## Quick start") < readme.index("## Install on a GPU or TPU host") < readme.index("## Use")
