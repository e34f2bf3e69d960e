"""Put first on ``PYTHONPATH`` by ``graddbg run`` for the processes a script starts itself
(``torch.multiprocessing.spawn``, Lightning's ``strategy="ddp"``, accelerate): Python
imports this module at start-up, and when ``GRADDBG_RUN_CHILD`` is set the process's
training is watched as ``graddbg run`` watches the script (graddbg._launch.boot). The
``sitecustomize`` this one hides, if any, runs first."""
import importlib.machinery
import importlib.util
import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
if os.environ.get("GRADDBG_RUN_CHILD"):
    try:
        from graddbg._launch import boot
        from graddbg.cli import ScriptWatcher

        boot(ScriptWatcher)
    except Exception as err:  # (a child's start must never fail because of graddbg)
        print(f"graddbg run: this process ({os.getpid()}) is not watched: {type(err).__name__}: {err}",
              file=sys.stderr)
