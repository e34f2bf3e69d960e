"""The graddbg command line, run as a user runs it: in subprocesses."""
from __future__ import annotations

import html.parser
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import graddbg
from graddbg import cli
import graddbg._script as _script
import _together
from _together import Together, selected

SCRIPTS = pathlib.Path(__file__).parent / "scripts"
_HOME = pathlib.Path.cwd()  # (where pytest started: the children's folder, whatever a test's chdir)


def _graddbg(*args, cwd=None, timeout=180):
    return _together.run([sys.executable, "-m", "graddbg", *args], cwd=cwd, timeout=timeout)


def _python(*args):
    return _together.run([sys.executable, *args], cwd=_HOME)


def _saved_run(tmp):
    """A run of three steps saved to ``tmp/run.parquet`` (in the test process)."""
    model = torch.nn.Linear(3, 1)
    with graddbg.watch(model) as w:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    w.save(tmp / "run.parquet")


def _blocker(tmp):
    (tmp / "file.txt").write_text("a file, not a folder")


def _bad_parquet(tmp):
    (tmp / "bad.parquet").write_text("not parquet at all")


_FAILING_SOURCES = {"syntax": "x = (\n", "import": "import json\nimport graddbg_no_such_module_y\n"}

# The children of this module's tests, by test (and parameter id): (what the test process
# prepares in the child's folder first, or None; the child, given that folder). The tests
# below each read their own: `res, tmp_path = children["name"]`.
_CHILDREN = {
    "test_demo_end_to_end": (None, lambda t: _graddbg("demo", "--out", str(t / "out"), cwd=_HOME)),
    "test_run_script_with_nan_exits_1_and_report_names_module": (
        None, lambda t: _graddbg("run", "--out", str(t), str(SCRIPTS / "nan_train.py"), "6", cwd=_HOME)),
    "test_run_healthy_script_exits_0_and_passes_arguments": (
        None, lambda t: _graddbg("run", "--out", str(t), "--every", "2", str(SCRIPTS / "healthy_train.py"), cwd=_HOME)),
    "test_run_record_policy_and_fail_on_never": (
        None, lambda t: _graddbg("run", "--out", str(t), "--nonfinite", "record", "--fail-on", "never",
                                 str(SCRIPTS / "nan_train.py"), cwd=_HOME)),
    "test_report_renders_a_saved_run": (
        _saved_run, lambda t: _graddbg("report", str(t / "run.parquet"), "--out", str(t / "r.html"), cwd=_HOME)),
    "test_out_inside_a_regular_file_exits_2_before_the_script_runs": (
        _blocker, lambda t: [_graddbg("run", "--out", str(t / "file.txt" / "out"), str(SCRIPTS / "marker.py"),
                                      str(t / "ran.txt"), cwd=_HOME),
                             _graddbg("run", "--out", str(t / "file.txt"), str(SCRIPTS / "marker.py"),
                                      str(t / "ran.txt"), cwd=_HOME)]),
    "test_report_of_a_bad_file_prints_one_line_and_exits_2": (
        _bad_parquet, lambda t: _graddbg("report", str(t / "bad.parquet"), "--out", str(t / "r.html"), cwd=_HOME)),
    "test_a_forked_child_of_the_script_still_dies_by_sigterm": (
        None, lambda t: _graddbg("run", "--out", str(t), str(SCRIPTS / "fork_child.py"), cwd=_HOME)),
    "test_run_lightning_records_the_lightning_modules_names_per_optimizer_step": (
        None, lambda t: _graddbg("run", "--out", str(t / "out"), str(SCRIPTS / "lightning_train.py"),
                                 str(t / "torch.json"), str(t / "trainer"), cwd=_HOME)),
    "test_quickstart_example_prints_the_summary_table": (
        None, lambda t: _python(str(SCRIPTS.parent.parent / "examples" / "quickstart.py"))),
    "test_hogwild_workers_write_their_own_records": (
        None, lambda t: _graddbg("run", "--out", str(t / "out"), str(SCRIPTS / "hogwild_train.py"), cwd=_HOME)),
    "test_a_nan_at_the_first_step_is_blamed_on_its_op_as_under_watch": (
        None, lambda t: _graddbg("run", "--out", str(t / "out"), str(SCRIPTS / "sqrt_train.py"), cwd=_HOME)),
}
for _id, _source in _FAILING_SOURCES.items():  # (python itself, on the script the test runs under graddbg)
    _CHILDREN[f"test_a_script_failing_before_its_first_step_shows_python_s_traceback_alone[{_id}]"] = (
        lambda t, source=_source: (t / "broken.py").write_text(source),
        lambda t: _together.run([sys.executable, str(t / "broken.py")], cwd=t))


class _Children:
    def __init__(self, together: Together, dirs: dict) -> None:
        self.together, self.dirs = together, dirs

    def __getitem__(self, key: str):
        return self.together.result(key), self.dirs[key]


@pytest.fixture(scope="module")
def children(request, tmp_path_factory):
    """The children of the selected tests of this module, started together (tests/_together.py)."""
    names = {key.split("[")[0] for key in _CHILDREN}
    keys = [f"{name}[{i}]" if i else name for name, ids in selected(request, names).items() for i in ids]
    together, dirs = Together(), {}
    for key in keys:
        prepare, child = _CHILDREN[key]
        dirs[key] = tmp_path_factory.mktemp(key.split("[")[0][5:40])
        if prepare is not None:
            prepare(dirs[key])
        together.start(key, child, dirs[key])
    yield _Children(together, dirs)
    together.close()


class _Collector(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list = []
        self.text: list = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text.append(data)


def _parse(path: pathlib.Path) -> _Collector:
    p = _Collector()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.mark.slow
def test_demo_end_to_end(children):
    res, tmp_path = children["test_demo_end_to_end"]
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    for f in ("report.html", "graph.svg", "stats.parquet"):
        assert (out / f).stat().st_size > 1000, f
    assert "module norm, op aten.div" in res.stdout  # the planted 0/0 is caught where it is
    assert "explode" in res.stdout and "step   81" in res.stdout  # the lr spike, the step after
    assert str(out / "report.html") in res.stdout
    page = _parse(out / "report.html")
    assert "svg" in page.tags and "table" in page.tags
    assert "nonfinite" in " ".join(page.text)
    run = graddbg.load(out / "stats.parquet")
    assert {a.kind for a in run.anomalies} >= {"nonfinite", "explode"}
    assert (out / "graph.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


def test_run_script_with_nan_exits_1_and_report_names_module(children):
    res, tmp_path = children["test_run_script_with_nan_exits_1_and_report_names_module"]
    assert res.returncode == 1, res.stdout + res.stderr
    assert "stopped by graddbg" in res.stderr and "module 'logs'" in res.stderr
    text = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "logs" in text and "aten.log" in text
    run = graddbg.load(tmp_path / "stats.parquet")
    assert run.anomalies[0].module == "logs" and run.anomalies[0].step == 3
    assert sorted(run.stats["step"].unique()) == [0, 1, 2, 3]  # nothing lost before the crash


def test_run_healthy_script_exits_0_and_passes_arguments(children):
    res, tmp_path = children["test_run_healthy_script_exits_0_and_passes_arguments"]
    assert res.returncode == 0, res.stderr
    assert "ok" in res.stdout and "0 anomalies" in res.stdout
    run = graddbg.load(tmp_path / "stats.parquet")
    assert sorted(run.stats["step"].unique()) == [0, 2, 4]
    assert run.stats["name"].unique().tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_run_record_policy_and_fail_on_never(children):
    res, _ = children["test_run_record_policy_and_fail_on_never"]
    assert res.returncode == 0, res.stderr
    assert "trained 6" in res.stdout and "nonfinite" in res.stdout


def test_report_renders_a_saved_run(children):
    res, tmp_path = children["test_report_renders_a_saved_run"]  # (_saved_run, then graddbg report)
    assert res.returncode == 0, res.stderr
    page = _parse(tmp_path / "r.html")
    assert "svg" in page.tags and "weight" in " ".join(page.text)


def test_report_writes_next_to_its_input_by_default_and_says_where(tmp_path, monkeypatch, capsys):
    model = torch.nn.Linear(3, 1)
    with graddbg.watch(model) as w:
        model(torch.randn(2, 3)).sum().backward()
    (tmp_path / "runs").mkdir()
    path = w.save(tmp_path / "runs" / "run.parquet")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cli.main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "runs" / "run.html").stat().st_size > 1000
    assert out == f"graddbg report: wrote {tmp_path / 'runs' / 'run.html'}\n"
    assert list((tmp_path / "elsewhere").iterdir()) == []  # nothing in the current folder


def _subparsers():
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction))
    return parser, sub.choices


@pytest.mark.parametrize("command", ["demo", "run", "report"])
def test_every_command_has_a_description_and_every_option_its_help_and_default(command):
    _, commands = _subparsers()
    p = commands[command]
    assert p.description and len(p.description) > 100, command
    help_text = p.format_help()
    text = help_text[help_text.index("\noptions:"):]  # the option entries, after the usage
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.dest}: no help"
        if action.option_strings:  # an option: its default is said (a value, or what None means)
            entry = text[text.index("\n  " + action.option_strings[-1]):]
            entry = entry[:(entry + "\n  -").index("\n  -", 1)]  # up to the next option
            assert "(default:" in " ".join(entry.split()), (command, action.dest, entry)
    for flag, default in {"run": [("--nonfinite", "raise"), ("--explode", "warn"), ("--vanish", "none")],
                          "demo": [("--steps", "120")], "report": []}[command]:
        assert f"(default: {default})" in " ".join(text[text.index("\n  " + flag):].split())[:200], flag


def test_run_usage_shows_the_scripts_arguments_as_optional(capsys):
    _, commands = _subparsers()
    usage = " ".join(commands["run"].format_usage().split())
    assert usage.endswith("script [args ...]"), usage
    assert cli.main(["run"]) == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: script (" in err and "args" not in err, err


@pytest.mark.parametrize("args,message", [
    (["run", "missing_script.py"], "graddbg run: error: script: 'missing_script.py' does not exist"),
    (["run", "--every", "0", str(SCRIPTS / "healthy_train.py")], "graddbg run: error: --every must be >= 1, got 0"),
    (["run", "--every", "two", "x.py"], "graddbg run: error: argument --every: invalid int value: 'two'"),
    (["run", "--nonfinite", "explode", "x.py"], "graddbg run: error: argument --nonfinite: invalid choice: 'explode'"),
    (["run", "--save-every", "-1", str(SCRIPTS / "healthy_train.py")],
     "graddbg run: error: --save-every must be a number of seconds >= 0"),
    (["report", "nope.parquet"], "graddbg report: error: run: 'nope.parquet' does not exist"),
    (["demo", "--steps", "0"], "graddbg demo: error: --steps must be >= 1, got 0"),
    (["frobnicate"], "graddbg: error: unknown command 'frobnicate'; accepted: demo, run, report"),
    (["rn", "x.py"], "graddbg: error: unknown command 'rn' (did you mean 'run'?); accepted: demo, run, report"),
    (["run", "--evry", "2", "x.py"], "graddbg run: error: unknown option '--evry' (did you mean '--every'?)"),
    (["report", "--ot=r.html", "x"], "graddbg report: error: unknown option '--ot' (did you mean '--out'?)"),
    (["--verison"], "graddbg: error: unknown option '--verison' (did you mean '--version'?)"),
    (["run", "-m"], "graddbg run: error: argument -m: expected a module name"),
    (["run", "-m", "graddbg_no_such_module_x"], "graddbg run: error: -m: no module named 'graddbg_no_such_module_x'"),
    ([], "usage: graddbg"),
])
def test_usage_errors_exit_2_with_one_line(args, message, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_run_script_arguments_are_checked_as_value_errors(tmp_path):
    script = str(SCRIPTS / "healthy_train.py")
    for kw, message in ((dict(fail_on="sometimes"), "--fail-on: got 'sometimes'; accepted: any, nonfinite, never"),
                        (dict(vanish="loud"), "--vanish: got 'loud'; accepted: raise, warn, skip, record, none"),
                        (dict(every=1.5), "--every must be >= 1, got 1.5"),
                        (dict(save_every=float("nan")), "--save-every must be a number of seconds >= 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            cli.run_script(script, [], out=str(tmp_path / "o"), **kw)
    assert not (tmp_path / "o").exists()  # nothing ran, nothing was created


def test_out_inside_a_regular_file_exits_2_before_the_script_runs(children):
    (res, res_file), tmp_path = children["test_out_inside_a_regular_file_exits_2_before_the_script_runs"]
    blocker = tmp_path / "file.txt"  # (a file, written before graddbg run --out blocker/out, --out blocker)
    marker = tmp_path / "ran.txt"
    assert blocker.read_text() == "a file, not a folder"
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr == f"graddbg run: error: --out: cannot create the folder {str(blocker / 'out')!r}: " \
                         "Not a directory\n"
    assert not marker.exists()  # the script never ran
    res = res_file
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "exists and is not a folder" in res.stderr
    assert not marker.exists()


def test_report_of_a_bad_file_prints_one_line_and_exits_2(children):
    res, tmp_path = children["test_report_of_a_bad_file_prints_one_line_and_exits_2"]
    bad = tmp_path / "bad.parquet"  # ("not parquet at all")
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(f"graddbg report: error: path: {str(bad)!r} is not a parquet file")
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "r.html").exists()


def test_report_of_a_tampered_run_and_to_a_missing_folder_exit_2(tmp_path, capsys):
    import json

    import pyarrow.parquet as pq

    model = torch.nn.Linear(3, 1)
    with graddbg.watch(model) as w:
        model(torch.randn(2, 3)).sum().backward()
    path = w.save(tmp_path / "run.parquet")
    assert cli.main(["report", str(path), "--out", str(tmp_path / "no" / "r.html")]) == 2
    assert capsys.readouterr().err == f"graddbg report: error: --out: the folder {str(tmp_path / 'no')!r} " \
                                      "does not exist\n"
    table = pq.read_table(path)
    md = dict(table.schema.metadata)
    doc = json.loads(md[b"graddbg"])
    doc["version"] = -7
    md[b"graddbg"] = json.dumps(doc).encode()
    pq.write_table(table.replace_schema_metadata(md), path)
    assert cli.main(["report", str(path), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown format version -7" in err and str(path) in err


@pytest.mark.parametrize("code,status,printed", [("fatal: bad config", 1, "fatal: bad config\n"),
                                                 ("3", 3, ""), ("0", 0, "")])
def test_sys_exit_in_the_script_exits_as_python_does(code, status, printed, tmp_path, capsys):
    assert cli.main(["run", "--out", str(tmp_path), str(SCRIPTS / "exit_train.py"), code]) == status
    assert capsys.readouterr().err == printed
    assert sorted(graddbg.load(tmp_path / "stats.parquet").stats["step"].unique()) == [0, 1]


def test_a_script_that_raises_shows_its_own_traceback(tmp_path, capsys):
    script = tmp_path / "boom.py"
    script.write_text("def f():\n    raise KeyError('missing key')\nf()\n")
    assert cli.main(["run", "--out", str(tmp_path / "o"), str(script)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n"  # nothing watched: python's own traceback
                          f'  File "{script}", line 3, in <module>')
    assert "KeyError: 'missing key'" in err and "runpy" not in err and "cli.py" not in err
    assert not (tmp_path / "o").exists()  # nothing watched: the folder made for it is gone


@pytest.mark.parametrize("name,status", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_signal_inside_the_script_saves_and_restores_the_handlers(name, status, tmp_path, capsys):
    signum = getattr(signal, name)
    seen = []
    sentinel = lambda s, f: seen.append(s)  # noqa: E731 - stands in for the caller's own handler
    previous = signal.signal(signum, sentinel)
    try:
        code = cli.run_script(str(SCRIPTS / "self_signal.py"), [name], out=str(tmp_path))
        assert signal.getsignal(signum) is sentinel  # put back
    finally:
        signal.signal(signum, previous)
    assert code == status and seen == []  # graddbg's handler took it, the caller's was back after
    out, err = capsys.readouterr()
    assert "trained past the signal" not in out
    assert f"graddbg run: terminated by {name}; saving what was recorded" in err
    run = graddbg.load(tmp_path / "stats.parquet")
    assert sorted(run.stats["step"].unique()) == [0, 1, 2]
    assert (tmp_path / "report.html").stat().st_size > 1000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_of_the_script_still_dies_by_sigterm(children):
    res, _ = children["test_a_forked_child_of_the_script_still_dies_by_sigterm"]
    assert res.returncode == 0, res.stderr
    assert "child killed by signal 15" in res.stdout and "Traceback" not in res.stderr


def _start(tmp_path, *extra):
    """`graddbg run` of slow_train.py in a subprocess (output to files, so no pipe fills
    up), returned once the script has trained 21 steps."""
    import time

    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    with open(logs / "stdout", "w") as so, open(logs / "stderr", "w") as se:
        proc = subprocess.Popen([sys.executable, "-m", "graddbg", "run", "--out", str(out), *extra,
                                 str(SCRIPTS / "slow_train.py")], stdout=so, stderr=se,
                                stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while "step 20\n" not in (logs / "stdout").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"slow_train.py did not start: {(logs / 'stderr').read_text()}")
        time.sleep(0.05)
    return proc, out, lambda: (logs / "stderr").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name,status", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_run_stopped_by_a_signal_leaves_a_loadable_run_and_a_report(name, status, tmp_path):
    proc, tmp_path, stderr = _start(tmp_path, "--save-every", "0")
    proc.send_signal(getattr(signal, name))
    proc.wait(timeout=180)
    err = stderr()
    assert proc.returncode == status, err
    assert f"graddbg run: terminated by {name}" in err and "Traceback" not in err
    run = graddbg.load(tmp_path / "stats.parquet")
    assert run.stats["step"].nunique() >= 21  # steps 0..20 at least, nothing lost
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert page.rstrip().endswith("</html>") and "<svg" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "stats.parquet"]  # no temp file


@pytest.mark.slow
def test_kill_9_leaves_the_last_snapshot(tmp_path):
    import time

    proc, tmp_path, _ = _start(tmp_path, "--save-every", "0.2")
    stats = tmp_path / "stats.parquet"
    deadline, steps = time.monotonic() + 120, 0
    while steps < 21 and time.monotonic() < deadline:  # a snapshot with step 20 in it
        time.sleep(0.1)
        steps = graddbg.load(stats).stats["step"].nunique() if stats.exists() else 0
    proc.kill()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    run = graddbg.load(stats)  # every snapshot is whole: written aside, then renamed
    assert run.stats["step"].nunique() >= 21
    assert run.stats["name"].unique().tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("script,args", [("healthy_train.py", []), ("manual_sgd_train.py", ["seen.json"]),
                                         ("lbfgs_train.py", ["seen.json", "hidden"])])
def test_run_leaves_no_global_hooks(script, args, tmp_path, monkeypatch):
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optim_mod

    def counts():
        return (len(module_mod._global_forward_hooks), len(module_mod._global_forward_pre_hooks),
                len(optim_mod._global_optimizer_pre_hooks), len(optim_mod._global_optimizer_post_hooks),
                signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))

    monkeypatch.chdir(tmp_path)
    before = counts()
    code = cli.run_script(str(SCRIPTS / script), args, out=str(tmp_path / "out"))
    assert code == 0
    assert counts() == before


# ----------------------------------------------------------------------------- what `graddbg run` watches

def _torch_norms(path):
    """The norms a script recorded with torch itself: {name: norm} per step."""
    import json

    return json.loads(pathlib.Path(path).read_text())


def _assert_norms_equal(run, seen):
    """One record per step the script saw, each parameter's norm as torch computed it."""
    norms = run.stats.pivot(index="step", columns="name", values="norm")
    assert sorted(run.stats["step"].unique()) == list(range(len(seen)))
    for step, by_name in enumerate(seen):
        for name, value in by_name.items():
            assert norms.loc[step, name] == pytest.approx(value, rel=1e-5, abs=1e-12), (step, name)


def test_run_without_an_optimizer_watches_the_model_a_step_per_backward(tmp_path, capsys):
    """word_language_model's default loop: the update by hand, no torch.optim optimizer."""
    seen_path = tmp_path / "torch.json"
    code = cli.run_script(str(SCRIPTS / "manual_sgd_train.py"), [str(seen_path)], out=str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "watched RNNModel without an optimizer (a step per backward pass) for 5 steps" in out
    seen = _torch_norms(seen_path)
    run = graddbg.load(tmp_path / "out" / "stats.parquet")
    assert run.stats["name"].unique().tolist() == list(seen[0]) == [
        "encoder.weight", "rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0", "rnn.bias_hh_l0",
        "decoder.weight", "decoder.bias"]
    _assert_norms_equal(run, seen)  # 5 backward passes, 5 steps (the no_grad pass is none), pre-clip norms
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.html", "stats.parquet"]
    assert "decoder.weight" in (tmp_path / "out" / "report.html").read_text(encoding="utf-8")


def test_an_optimizer_replaces_the_watch_without_one(tmp_path, capsys):
    """A forward and backward pass before the first optimizer step start a watch without an
    optimizer; the optimizer's watch takes over: one watch, one record per optimizer step."""
    assert cli.run_script(str(SCRIPTS / "healthy_train.py"), [], out=str(tmp_path)) == 0
    assert "watched Sequential with SGD for 5 steps" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "stats.parquet"]
    run = graddbg.load(tmp_path / "stats.parquet")
    assert run.meta["optimizer"] == "SGD" and sorted(run.stats["step"].unique()) == [0, 1, 2, 3, 4]


def test_forward_passes_without_a_backward_watch_nothing(tmp_path, capsys):
    script = tmp_path / "infer.py"
    script.write_text("import torch\nm = torch.nn.Linear(3, 1)\nfor _ in range(3):\n    m(torch.randn(2, 3))\n")
    assert cli.run_script(str(script), [], out=str(tmp_path / "out")) == 0
    assert "nothing was watched" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["shown", "hidden"])
def test_run_lbfgs_names_the_model_first_called_in_the_closure(where, tmp_path, capsys):
    """time_sequence_prediction: LBFGS made before any forward pass, the model first called
    in the closure; "hidden": no frame calling step() holds the model, only the closure."""
    seen_path = tmp_path / "torch.json"
    code = cli.run_script(str(SCRIPTS / "lbfgs_train.py"), [str(seen_path), where], out=str(tmp_path / "out"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "watched Sequence with LBFGS for 3 steps" in out
    seen = _torch_norms(seen_path)
    run = graddbg.load(tmp_path / "out" / "stats.parquet")
    assert run.stats["name"].unique().tolist() == list(seen[0]) == [
        "lstm1.weight_ih", "lstm1.weight_hh", "lstm1.bias_ih", "lstm1.bias_hh", "linear.weight", "linear.bias"]
    assert run.stats["module"].unique().tolist() == ["lstm1", "linear"]
    _assert_norms_equal(run, seen)  # each step's first closure evaluation


_BARE_LBFGS = """
import torch
w = torch.zeros(3, requires_grad=True)
opt = torch.optim.LBFGS([w], max_iter=3)
def closure():
    opt.zero_grad()
    loss = ((w - torch.arange(3.0)) ** 2).sum()
    loss.backward()
    return loss
for _ in range(3):
    opt.step(closure)
"""


def test_run_lbfgs_on_a_bare_tensor_records_every_step(tmp_path, capsys):
    """No module owns the parameters: the stand-in names them by group, from the first step."""
    script = tmp_path / "bare.py"
    script.write_text(_BARE_LBFGS)
    assert cli.run_script(str(script), [], out=str(tmp_path / "out")) == 0
    assert "watched tensor w with LBFGS for 3 steps" in capsys.readouterr().out  # the user's name, not graddbg's class
    assert "_ParamHolder" not in (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    run = graddbg.load(tmp_path / "out" / "stats.parquet")
    assert run.stats["name"].unique().tolist() == ["group0_param0"]
    assert run.stats["norm"].iloc[0] == pytest.approx(2 * 5 ** 0.5)  # |2 (w - [0, 1, 2])| at w = 0


@pytest.mark.slow
def test_run_lightning_records_the_lightning_modules_names_per_optimizer_step(children):
    pytest.importorskip("lightning")
    res, tmp_path = children["test_run_lightning_records_the_lightning_modules_names_per_optimizer_step"]
    seen_path = tmp_path / "torch.json"
    assert res.returncode == 0, res.stdout + res.stderr
    assert "watched Tiny with SGD for 4 steps" in res.stdout  # 8 batches, accumulation 2
    seen = _torch_norms(seen_path)
    run = graddbg.load(tmp_path / "out" / "stats.parquet")
    assert run.stats["name"].unique().tolist() == list(seen[0]) == [
        "net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    _assert_norms_equal(run, seen)  # what on_before_optimizer_step saw: the accumulated gradients


def test_snapshots_without_an_optimizer_are_due_between_backward_passes():
    """Without an optimizer there is no step hook: the snapshot callback runs before each
    outermost forward pass once the watch has started (not before, not for submodules)."""
    calls = []
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with _script.ScriptWatcher({"explode": None}, after_step=lambda: calls.append(1)) as watcher:
        for _ in range(4):
            model(torch.randn(2, 3)).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    (w,) = watcher.watches
    assert w.current_step == 4 and len(calls) == 3  # before forward passes 2, 3 and 4
    assert w.stats["name"].unique().tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_the_model_of_an_optimizer_is_the_outermost_smallest_owner():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    outer = torch.nn.ModuleDict({"net": inner})  # a LightningModule around what it calls
    ema = torch.nn.ModuleDict({"model": outer, "ema": torch.nn.Linear(2, 2)})  # more trainable parameters
    held = {id(p) for p in inner.parameters()}
    assert _script.choose_model([inner, ema, outer], held) is outer
    frozen = torch.nn.ModuleDict({"backbone": torch.nn.Linear(2, 2).requires_grad_(False), "head": inner})
    assert _script.choose_model([inner, frozen], held) is frozen  # frozen parameters do not count
    assert _script.choose_model([inner[0]], held) is inner[0]
    assert _script.choose_model([torch.nn.Linear(2, 2)], held) is None


def test_quickstart_example_prints_the_summary_table(children):
    res, _ = children["test_quickstart_example_prints_the_summary_table"]
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["name", "numel", "norm_mean"]
    assert [line.split()[0] for line in lines[1:7]] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert "100 steps" in res.stdout and "anomalies: 0" in res.stdout


def test_hogwild_workers_write_their_own_records(children):
    res, tmp_path = children["test_hogwild_workers_write_their_own_records"]
    out = tmp_path / "out"
    assert res.returncode == 0, res.stdout + res.stderr
    assert "file True" in res.stdout  # __file__ is absolute, as under python
    records = sorted(out.glob("worker-*/stats.parquet"))
    assert len(records) == 2, res.stdout
    for path in records:
        run = graddbg.load(path)
        assert run.anomalies == [] and sorted(run.stats["step"].unique()) == [0, 1, 2, 3, 4]
        assert (path.parent / "report.html").exists()
    assert res.stdout.count("a worker process (worker-") == 2
    assert "stepped no optimizer" not in res.stdout


def test_a_nan_at_the_first_step_is_blamed_on_its_op_as_under_watch(children):
    """graddbg run starts watching after the first forward pass; that pass is handed to the
    watch, so a sqrt(0) NaN at step 0 is named by module, op and line (not 'found from
    parameter gradients' on the module upstream)."""
    res, tmp_path = children["test_a_nan_at_the_first_step_is_blamed_on_its_op_as_under_watch"]
    assert res.returncode == 1, res.stdout + res.stderr
    (a,) = graddbg.load(tmp_path / "out" / "stats.parquet").anomalies
    assert (a.kind, a.step, a.module, a.op) == ("nonfinite", 0, "1", "SqrtBackward0")
    assert a.source.endswith("sqrt_train.py:8") and a.reproduced is True


def test_run_records_the_first_steps_pre_clip_norm(tmp_path):
    """As under watch(): step 0's global norm is the pre-clip one (torch's clip returns it),
    its post-clip norm in clipped_norm; before, the watch began after step 0's clip."""
    norms_file = tmp_path / "norms.txt"
    assert cli.main(["run", "--out", str(tmp_path / "out"), str(SCRIPTS / "clip_train.py"), str(norms_file)]) == 0
    torch_norms = [float(v) for v in norms_file.read_text().split()]
    steps = graddbg.load(tmp_path / "out" / "stats.parquet").steps
    assert list(steps["step"]) == [0, 1, 2]
    assert steps["global_norm"].tolist() == pytest.approx(torch_norms, rel=1e-5)
    assert torch_norms[0] > 2 and steps["clipped_norm"].tolist() == pytest.approx([1.0] * 3, rel=1e-5)


def test_run_under_torch_compile_gives_no_warning_of_graddbgs_hooks(tmp_path):
    import warnings

    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        inner = list(warnings.filters)
        assert cli.main(["run", "--out", str(tmp_path), str(SCRIPTS / "compiled_train.py")]) == 0
        assert warnings.filters == inner  # graddbg's filter is gone with its hooks
    assert [str(w.message)[:80] for w in seen if "global hooks" in str(w.message)] == []
    assert warnings.filters == before
    assert len(graddbg.load(tmp_path / "stats.parquet").steps) == 3


def _timed_lines(cmd, cwd):
    """Run ``cmd``; (time of each output line, keyed by its start; the exit time), from
    its start."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    seen = {}
    for line in proc.stdout:
        seen.setdefault(line.split(":")[0].strip(), time.monotonic() - t0)
    proc.wait(timeout=300)
    assert proc.returncode == 0, seen
    return seen, time.monotonic() - t0


@pytest.mark.slow
def test_run_with_dataloader_workers_exits_like_the_plain_script(tmp_path, children):
    """The script's objects die at exit as under plain python: once the report is written,
    graddbg run exits as fast as the plain script does after its last line; and writing the
    report takes no longer with DataLoader workers than without (before: the script's
    namespace was collected while the report was written, the workers' queues first, and
    each worker's join waited out its 5 s timeout: 15 s more with 3 workers)."""
    children.together.drain()  # (timed: nothing else of this module runs beside it)
    script = str(SCRIPTS / "loader_train.py")
    plain, plain_exit = _timed_lines([sys.executable, script, "3"], tmp_path)
    plain_tail = plain_exit - plain["script done"]
    tails, writes = [], []
    for workers in ("3", "0"):  # (3 workers: 15 s of joins before, far above the bounds below)
        out = tmp_path / f"out{workers}"
        run, run_exit = _timed_lines([sys.executable, "-m", "graddbg", "run", "--out", str(out), script, workers],
                                     tmp_path)
        tails.append(run_exit - run["graddbg run"])  # after the report's line: the exit
        writes.append(run["graddbg run"] - run["script done"])  # the record and the report
    assert tails[0] < plain_tail + 4.0, (tails, plain_tail)  # (generous: a loaded machine)
    assert writes[0] < writes[1] + 7.0, writes


def test_run_summary_counts_in_words(tmp_path, capsys):
    """'1 step', '1 anomaly': not '1 steps', '1 anomalies'."""
    script = tmp_path / "one_step.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "m(torch.randn(3, 2)).sum().backward()\nopt.step()\n"
                      "m(torch.randn(3, 2)).sum().backward()\nopt.step()\n")  # no zero_grad: 1 finding
    assert cli.main(["run", "--out", str(tmp_path / "o"), "--stale-grad", "record", "--fail-on", "never",
                     str(script)]) == 0
    out = capsys.readouterr().out
    assert "with SGD for 2 steps; 1 anomaly; report:" in out, out
    from graddbg.plots import counted

    assert [counted(n, w) for n, w in ((1, "step"), (2, "step"), (1, "anomaly"), (2, "anomaly"), (0, "key"))] \
        == ["1 step", "2 steps", "1 anomaly", "2 anomalies", "0 keys"]


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"graddbg {graddbg.__version__} (torch {torch.__version__}, Python ")


@pytest.mark.parametrize("source", list(_FAILING_SOURCES))
def test_a_script_failing_before_its_first_step_shows_python_s_traceback_alone(source, children, capsys):
    """A SyntaxError or an exception at import: what python prints, no graddbg frame, no hint."""
    plain, tmp_path = children[f"test_a_script_failing_before_its_first_step_shows_python_s_traceback_alone[{source}]"]
    script = tmp_path / "broken.py"  # (_FAILING_SOURCES[source]; plain: python itself, run on it)
    assert script.read_text() == _FAILING_SOURCES[source]
    assert cli.main(["run", "--out", str(tmp_path / "o"), str(script)]) == plain.returncode == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", plain.stderr)
    assert not (tmp_path / "o").exists()


_MODULE = """import json, sys
import torch
from torch import nn

model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for _ in range(int(sys.argv[1])):
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
with open(sys.argv[2], "w") as f:
    json.dump({"name": __name__, "argv0": sys.argv[0], "file": __file__}, f)
"""


@pytest.mark.parametrize("name", ["gdbg_mpkg.train", "gdbg_mpkg"])
def test_run_m_runs_a_module_as_python_m_with_its_model_watched(name, tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "gdbg_mpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(_MODULE)
    (pkg / "__main__.py").write_text(_MODULE)
    monkeypatch.chdir(tmp_path)  # found from the current folder, as python -m finds it
    monkeypatch.setattr(sys, "path", list(sys.path))
    seen = tmp_path / "seen.json"
    try:
        assert cli.main(["run", "--out", str(tmp_path / "o"), "-m", name, "3", str(seen)]) == 0
    finally:
        for module in [m for m in sys.modules if m.split(".")[0] == "gdbg_mpkg"]:
            del sys.modules[module]
    assert "watched Sequential with SGD for 3 steps" in capsys.readouterr().out
    facts = __import__("json").loads(seen.read_text())
    module_file = str(pkg / ("train.py" if name.endswith("train") else "__main__.py"))
    assert facts == {"name": "__main__", "argv0": module_file, "file": module_file}
    run = graddbg.load(tmp_path / "o" / "stats.parquet")
    assert sorted(run.stats["step"].unique()) == [0, 1, 2]
    assert run.stats["name"].unique().tolist() == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_run_s_report_names_its_run_file_not_w_and_report_reads_the_folder(tmp_path, capsys):
    import html

    out = tmp_path / "o"
    assert cli.main(["run", "--out", str(out), str(SCRIPTS / "healthy_train.py")]) == 0
    for report, run_file in ((out / "report.html", out / "stats.parquet"), (None, out / "stats.parquet")):
        if report is None:  # graddbg report DIR: the folder graddbg run wrote
            assert cli.main(["report", str(out)]) == 0
            report = out / "stats.html"
        text = html.unescape(re.sub(r"<[^>]+>", "", report.read_text(encoding="utf-8")))
        assert "w.ledger" not in text and "w.anomalies" not in text
        assert f"graddbg.load({str(run_file)!r}).ledger has them all" in text


_GRID = """import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x)

for i, hidden in enumerate((2, 4)):  # a grid search: a fit per setting
    model = MLP(hidden) if i == 0 else nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(2 + i):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        if i == 1:
            opt.zero_grad()  # (the first fit forgets it: a stale_grad finding)
"""


def test_several_models_watched_get_a_report_each_and_an_index(tmp_path, capsys):
    script = tmp_path / "grid.py"
    script.write_text(_GRID)
    out = tmp_path / "o"
    assert cli.main(["run", "--out", str(out), "--stale-grad", "record", "--fail-on", "never", str(script)]) == 0
    printed = capsys.readouterr().out
    assert f"graddbg run: 2 models watched, a report each; index of the reports: {out / 'index.html'}" in printed
    lines = _parse(out / "index.html").text
    items = re.findall(r'<li[^>]*><a href="([^"]+)">([^<]+)</a>([^<]+)</li>', (out / "index.html").read_text())
    assert [(href, text + facts) for href, text, facts in items] == [
        ("report.html", "1. MLP with SGD — 2 steps, 1 finding"),
        ("report-2.html", "2. Linear with SGD — 3 steps, 0 findings")], lines
    assert all((out / href).is_file() for href, _, _ in items)


def test_demo_help_says_how_long_it_takes():
    """'a few seconds' it was not: the help gives the time measured (graddbg demo prints it)."""
    _, commands = _subparsers()
    text = " ".join(commands["demo"].description.split())
    assert "a few seconds" not in text and re.search(r"about \d+ seconds on two CPU cores", text), text
