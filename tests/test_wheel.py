"""``pip install`` of a built wheel (not editable) gives a working graddbg.

The wheel is built from a copy of the sources (``pip wheel --no-deps``), installed with
``--no-deps`` into a fresh virtual environment that has no graddbg at all, and run from a
folder outside the checkout, without PYTHONPATH: ``import graddbg`` must come from that
environment's site-packages, the ``graddbg`` command must run the demo, and pytest must find
the ``graddbg_check`` fixture through the wheel's ``pytest11`` entry point.

Installing torch and the other dependencies again would take minutes, so the new
environment reaches them through a ``.pth`` file naming a folder of links to the test
environment's site-packages entries, every graddbg entry left out (the editable install's
finder and metadata): the dependencies are shared, graddbg is only the wheel's.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(cmd, cwd, env=None, timeout=300):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "graddbg", src / "graddbg", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    args = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp / "dist", src]
    if _setuptools_builds_wheels():  # build with it, without downloading one
        args.insert(4, "--no-build-isolation")
    _run(args, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("graddbg-*.whl")
    return wheel


def _setuptools_builds_wheels() -> bool:
    """This environment's setuptools builds wheels by itself (70.1 and later; older ones
    need the ``wheel`` package too). Otherwise pip builds in isolation, fetching one."""
    import importlib.metadata as md

    try:
        major, minor = (int(x) for x in md.version("setuptools").split(".")[:2])
    except (md.PackageNotFoundError, ValueError):
        return False
    if (major, minor) >= (70, 1):
        return True
    try:
        md.version("wheel")
        return major >= 64
    except md.PackageNotFoundError:
        return False


def _fresh_venv(tmp: Path) -> Path:
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    deps = tmp / "deps"  # the dependencies, graddbg left out
    deps.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if "graddbg" not in entry.name.lower():
            (deps / entry.name).symlink_to(entry)
    (site / "zz_shared_deps.pth").write_text(f"{deps}\n")
    return venv


def test_wheel_installs_a_working_graddbg(tmp_path: Path):
    wheel = _build_wheel(tmp_path)
    venv = _fresh_venv(tmp_path)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(MPLBACKEND="Agg", PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    work = tmp_path / "work"
    work.mkdir()

    # before: the fresh environment has no graddbg (so what follows tests the wheel)
    probe = [py, "-c", "import importlib.util as u; print(u.find_spec('graddbg'))"]
    assert _run(probe, cwd=work, env=env).strip() == "None"

    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel],
         cwd=work, env=env)

    info = _run([py, "-c", (
        "import graddbg, pathlib, sysconfig, importlib.metadata as md\n"
        "print(graddbg.__file__)\n"
        "print(sysconfig.get_paths()['purelib'])\n"
        "print((pathlib.Path(graddbg.__file__).parent / 'py.typed').is_file())\n"
        "print(sorted(e.value for e in md.entry_points(group='pytest11') if e.name == 'graddbg'))\n"
        "print(md.distribution('graddbg').read_text('direct_url.json') is None or 'editable' not in md.distribution('graddbg').read_text('direct_url.json'))\n"
        "meta = md.metadata('graddbg'); print(meta['License-Expression'])\n"
        "print(any(str(f).endswith('LICENSE') and 'BSD 3-Clause' in f.read_text() for f in md.files('graddbg')))\n"
    )], cwd=work, env=env).splitlines()
    module_file, site, typed, plugin, not_editable, license_expr, license_file = info
    assert Path(module_file).resolve().is_relative_to(Path(site).resolve()), \
        f"graddbg imported from {module_file}, not from the new environment ({site})"
    assert not Path(module_file).resolve().is_relative_to(ROOT)
    assert typed == "True", "py.typed is not in the wheel"
    assert plugin == "['graddbg.pytest_plugin']", plugin
    assert not_editable == "True"
    assert license_expr == "BSD-3-Clause", license_expr  # the metadata names the license
    assert license_file == "True", "the wheel does not carry the LICENSE file"

    # the console script, from the wheel's entry point
    script = venv / "bin" / "graddbg"
    assert script.is_file()
    out = _run([script, "demo", "--out", "demo-out"], cwd=work, env=env, timeout=400)
    for name in ("report.html", "graph.svg", "stats.parquet"):
        assert (work / "demo-out" / name).stat().st_size > 0, name
    assert "nonfinite" in out.lower() or "nan" in out.lower(), out[-2000:]

    # the pytest plugin, registered by the wheel's metadata (no conftest here)
    (work / "test_square.py").write_text(
        "import torch\n\n"
        "def test_square(graddbg_check):\n"
        "    x = torch.randn(4, dtype=torch.float64, requires_grad=True)\n"
        "    graddbg_check.assert_gradients_close(lambda t: t * t, x)\n")
    out = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_square.py"], cwd=work, env=env)
    assert "1 passed" in out, out
