"""`graddbg run`'s start-up hook (graddbg/_launch.py, graddbg/_boot/sitecustomize.py) reaches
only what it should: Python processes of the same interpreter and environment, and only once
they import torch. Any other interpreter the script starts (a tool with its own numpy, the
system python) is left untouched; a user's own sitecustomize still runs; the markers of
watched children are graddbg's own files; a second Ctrl-C while the record is written is
deferred."""
from __future__ import annotations

import glob
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

import graddbg
from graddbg import _launch

PACKAGE = pathlib.Path(graddbg.__file__).resolve().parent

# a user's own sitecustomize (Python 3.6+ syntax): it logs the pid of every process it runs in
USER_SITECUSTOMIZE = """\
import os
log = os.environ.get("USER_SITECUSTOMIZE_LOG")
if log:
    with open(log, "a") as f:
        f.write("%d\\n" % os.getpid())
"""

# what a process sees of graddbg and torch, as JSON on stdout (Python 3.6+ syntax)
PROBE = """\
import importlib.util, json, os, sys
own = None
if importlib.util.find_spec("numpy") is not None:
    import numpy
    own = numpy.__file__
print(json.dumps({"pid": os.getpid(), "numpy": own, "path": sys.path, "prefix": sys.prefix,
                  "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("graddbg", "torch")),
                  "found": [n for n in ("graddbg", "torch") if importlib.util.find_spec(n) is not None]}))
"""


def _runs(exe: str) -> bool:
    try:
        return subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _python(minor: int):
    """An interpreter of Python 3.<minor> other than this process's, or None."""
    here = os.path.realpath(sys.executable)
    roots = [os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")]
    found = [shutil.which(f"python3.{minor}"), f"/usr/bin/python3.{minor}", f"/usr/local/bin/python3.{minor}"]
    found += [p for r in roots if r for p in sorted(glob.glob(f"{r}/versions/3.{minor}.*/bin/python3.{minor}"))]
    for exe in found:
        if exe and os.path.isfile(exe) and os.path.realpath(exe) != here and _runs(exe):
            return exe
    base = getattr(sys, "_base_executable", "")
    if minor == sys.version_info[1] and base and sys.prefix != sys.base_prefix and _runs(base):
        return base  # (this venv's base interpreter: the same version, another environment)
    return None


def _user_site(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "usersite"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(USER_SITECUSTOMIZE)
    return folder


def _logged(tmp_path: pathlib.Path) -> set:
    log = tmp_path / "sitecustomize.log"
    return {int(line) for line in log.read_text().split()} if log.exists() else set()


def _graddbg_run(tmp_path, out, script, *args, pythonpath=(), site=None, timeout=240):
    """``graddbg run`` in a subprocess (in ``tmp_path``), with graddbg imported from ``site``
    when given (put first on the parent's sys.path only, as a venv's site-packages is)."""
    env = {**os.environ, "USER_SITECUSTOMIZE_LOG": str(tmp_path / "sitecustomize.log"),
           "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    start = ["-m", "graddbg"] if site is None else [
        "-c", f"import sys; sys.path.insert(0, {str(site)!r}); from graddbg.cli import main; sys.exit(main())"]
    return subprocess.run([sys.executable, *start, "run", "--out", str(out), str(script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env,
                          cwd=tmp_path)


def _run_here(tmp_path, monkeypatch, capsys, out, script, *args, pythonpath=()):
    """`graddbg.cli.run_script` in this process (in ``tmp_path``): (exit code, stdout)."""
    from graddbg import cli

    monkeypatch.setenv("USER_SITECUSTOMIZE_LOG", str(tmp_path / "sitecustomize.log"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(str(p) for p in pythonpath))
    monkeypatch.chdir(tmp_path)
    code = cli.run_script(str(script), [str(a) for a in args], out=str(out))
    return code, capsys.readouterr().out


@pytest.mark.parametrize("minor", [9, 10, 11, 12, 13])
def test_the_hook_leaves_any_other_interpreter_untouched(minor, tmp_path):
    """Python 3.9-3.13, each another interpreter than this one: the hook imports nothing of
    graddbg (nor torch), says nothing, leaves no entry of its own on sys.path, and runs the
    user's own sitecustomize."""
    exe = _python(minor)
    if exe is None:
        pytest.skip(f"no Python 3.{minor} here other than this one")
    env_before = dict(os.environ)
    os.environ["USER_SITECUSTOMIZE_LOG"] = str(tmp_path / "sitecustomize.log")
    os.environ["PYTHONPATH"] = str(_user_site(tmp_path))
    try:
        with _launch.follow_children(tmp_path / "out", {}):
            res = subprocess.run([exe, "-c", PROBE], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    seen = json.loads(res.stdout)
    assert seen["modules"] == [] and seen["found"] == []
    assert not [p for p in seen["path"] if str(PACKAGE) in p], seen["path"]
    assert seen["pid"] in _logged(tmp_path)  # the user's sitecustomize ran
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.parquet"))


def _venv(base: str, folder: pathlib.Path) -> str:
    """A venv of ``base`` (no pip) whose site-packages holds a numpy of its own (a stand-in)."""
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, capture_output=True, timeout=120)
    exe = str(folder / "bin" / "python")
    purelib = subprocess.run([exe, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    (pathlib.Path(purelib) / "numpy").mkdir()
    (pathlib.Path(purelib) / "numpy" / "__init__.py").write_text("OWN = True\n")
    return exe


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tool_of_another_python_with_its_own_numpy_works_under_graddbg_run(tmp_path):
    """graddbg installed as a plain package (a site folder holding graddbg and numpy, as a
    venv's site-packages does): the script starts tools of other interpreters (a venv of
    another Python version, a venv of the same version, the system python), each with its
    own numpy or none. Each imports its own numpy, sees nothing of graddbg's environment on
    sys.path, has nothing of graddbg or torch in sys.modules and runs the user's
    sitecustomize."""
    import numpy

    site = tmp_path / "site"
    site.mkdir()
    shutil.copytree(PACKAGE, site / "graddbg")
    (site / "numpy").symlink_to(pathlib.Path(numpy.__file__).resolve().parent, target_is_directory=True)
    tools = [_venv(b, tmp_path / f"venv-{i}") for i, b in
             enumerate(b for b in (_python(12) or _python(13) or _python(10), _python(sys.version_info[1])) if b)]
    if os.path.isfile("/usr/bin/python3") and _runs("/usr/bin/python3") \
            and os.path.realpath("/usr/bin/python3") != os.path.realpath(sys.executable):
        tools.append("/usr/bin/python3")
    assert tools
    (tmp_path / "probe.py").write_text(PROBE)
    script = tmp_path / "tools.py"
    script.write_text(
        "import json, subprocess, sys\n"
        "res = [subprocess.run([exe, sys.argv[2]], capture_output=True, text=True) for exe in sys.argv[3:]]\n"
        "open(sys.argv[1], 'w').write(json.dumps([[r.returncode, r.stdout, r.stderr] for r in res]))\n")
    res = _graddbg_run(tmp_path, tmp_path / "out", script, tmp_path / "res.json", tmp_path / "probe.py", *tools,
                       pythonpath=[_user_site(tmp_path)], site=site)
    assert res.returncode == 0, res.stderr[-3000:]
    for exe, (rc, out, err) in zip(tools, json.loads((tmp_path / "res.json").read_text())):
        assert rc == 0 and err == "", (exe, err[-2000:])
        seen = json.loads(out)
        assert seen["numpy"] is None or seen["numpy"].startswith(seen["prefix"]), (exe, seen["numpy"])
        assert seen["modules"] == [] and seen["found"] == [], (exe, seen)
        assert not [p for p in seen["path"] if p.startswith((str(site), str(PACKAGE)))], (exe, seen["path"])
        assert seen["pid"] in _logged(tmp_path), exe


TRAIN = """\
import json, sys
import torch
from torch import nn
model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print(json.dumps({"pid": __import__("os").getpid(), "path": sys.path,
                  "finders": [type(f).__module__ for f in sys.meta_path],
                  "loader": type(torch.__spec__.loader).__module__, "torch_loader": type(torch.__loader__).__module__}))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_interpreter_children_are_watched_only_once_they_import_torch(tmp_path, monkeypatch, capsys):
    """The same interpreter: ``python -c`` that never imports torch has nothing of graddbg in
    sys.modules; a child that imports torch and trains is watched (its record under
    worker-<pid>/), its torch module as torch's own loader made it, no hook of graddbg's left in
    sys.meta_path; the user's sitecustomize ran in both."""
    (tmp_path / "train.py").write_text(TRAIN)
    script = tmp_path / "children.py"
    script.write_text(
        "import json, subprocess, sys\n"
        f"probe = {PROBE!r}\n"
        "plain = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)\n"
        "train = subprocess.run([sys.executable, sys.argv[2]], capture_output=True, text=True)\n"
        "open(sys.argv[1], 'w').write(json.dumps([[r.returncode, r.stdout, r.stderr] for r in (plain, train)]))\n")
    out = tmp_path / "out"
    code, stdout = _run_here(tmp_path, monkeypatch, capsys, out, script, tmp_path / "res.json",
                             tmp_path / "train.py", pythonpath=[_user_site(tmp_path)])
    assert code == 0, stdout
    (rc, pout, err), (trc, tout, terr) = json.loads((tmp_path / "res.json").read_text())
    assert rc == 0 and err == "", err[-2000:]
    plain = json.loads(pout)
    assert plain["modules"] == [], plain["modules"]
    assert trc == 0, terr[-3000:]
    trained = json.loads(tout)
    assert not [f for f in trained["finders"] if "sitecustomize" in f or "graddbg" in f], trained["finders"]
    assert trained["loader"] == trained["torch_loader"] and "sitecustomize" not in trained["loader"]
    run = graddbg.load(out / f"worker-{trained['pid']}" / "stats.parquet")
    assert sorted(run.stats["step"].unique()) == [0, 1, 2]
    assert {plain["pid"], trained["pid"]} <= _logged(tmp_path)
    assert "a worker process (worker-" in stdout


def test_a_users_running_files_in_the_out_folder_survive(tmp_path, monkeypatch, capsys):
    """Markers are graddbg's own: a user's files named .running-* in an existing out folder
    are left as they are, and graddbg's marker folder is gone after the run unless it was there
    before."""
    out = tmp_path / "out"
    out.mkdir()
    for name in (".running-123", ".running-notes"):
        (out / name).write_text("mine")
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    assert _run_here(tmp_path, monkeypatch, capsys, out, script)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == [".running-123", ".running-notes"]
    assert all((out / n).read_text() == "mine" for n in (".running-123", ".running-notes"))
    (out / ".graddbg-running").mkdir()  # there before the run: not graddbg's to remove
    assert _run_here(tmp_path, monkeypatch, capsys, out, script)[0] == 0
    assert (out / ".graddbg-running").is_dir()


SLOW_WRITE = """\
import pathlib, sys, time
import torch
from torch import nn
import graddbg

from graddbg.run import Run

writing = pathlib.Path(sys.argv[1])
report = Run.report  # (graddbg run writes each report from the saved run)

def slow_report(self, *args, **kwargs):  # the report takes long: the test's second Ctrl-C lands in it
    writing.write_text("writing")
    time.sleep(3)
    return report(self, *args, **kwargs)

Run.report = slow_report
model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100000):
    model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    print("step", step, flush=True)
    time.sleep(0.01)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_second_ctrl_c_while_the_record_is_written_is_deferred(tmp_path):
    """Ctrl-C stops the script; a second Ctrl-C while graddbg writes the record and the report
    waits for the write: exit code 130, no traceback, a loadable run and a whole report."""
    script, writing, out = tmp_path / "train.py", tmp_path / "writing", tmp_path / "out"
    script.write_text(SLOW_WRITE)
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        proc = subprocess.Popen([sys.executable, "-m", "graddbg", "run", "--out", str(out), "--save-every", "0",
                                 str(script), str(writing)], stdout=so, stderr=se, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        for done in (lambda: "step 5\n" in (tmp_path / "stdout").read_text(), writing.exists):
            while not done():
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "graddbg run: interrupted" in err, err[-3000:]
    run = graddbg.load(out / "stats.parquet")
    assert run.stats["step"].nunique() >= 6
    assert (out / "report.html").read_text(encoding="utf-8").rstrip().endswith("</html>")
