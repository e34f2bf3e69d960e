"""The harness that starts a module's children together (tests/_together.py)."""
import os
import sys

from _together import Together, run


def test_a_child_gets_the_environment_of_its_start_while_the_main_thread_changes_it(monkeypatch):
    # A child spawned from a worker thread must not read the C environ that the main thread is
    # rewriting (a vfork'ed execv then fails with EFAULT): it gets the start's copy, explicitly.
    monkeypatch.setenv("GRADDBG_TOGETHER_PROBE", "at-start")
    together = Together()
    code = "import os; print(os.environ.get('GRADDBG_TOGETHER_PROBE'))"
    for i in range(4):
        together.start(f"c{i}", run, [sys.executable, "-c", code])
    try:
        for n in range(2000):  # the main thread rewrites the environment while they spawn
            os.environ["GRADDBG_TOGETHER_PROBE"] = f"changed-{n}"
            os.environ[f"GRADDBG_TOGETHER_FILL_{n % 50}"] = "x" * (n % 200)
        outs = [together.result(f"c{i}") for i in range(4)]
    finally:
        together.close()
        for k in [k for k in os.environ if k.startswith("GRADDBG_TOGETHER_FILL_")]:
            del os.environ[k]
    assert [(o.returncode, o.stdout.strip()) for o in outs] == [(0, "at-start")] * 4, [o.stderr for o in outs]
