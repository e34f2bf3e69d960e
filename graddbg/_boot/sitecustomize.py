"""The start-up hook of ``graddbg run``'s child processes (see graddbg/_launch.py).

``graddbg run`` puts this folder, which holds only this file, first on ``PYTHONPATH`` for
the processes a script starts itself (``torch.multiprocessing.spawn``, Lightning's
``strategy="ddp"``, accelerate); Python imports it at start-up. It first runs the
``sitecustomize`` it hides, if any, and takes its own folder off ``sys.path``. Then:

- in a process of another interpreter or environment than ``graddbg run``'s (its
  ``GRADDBG_RUN_PYTHON`` differs from this process's `_identity`): nothing more. Nothing of
  graddbg or of graddbg's environment is imported or put on ``sys.path``.
- in a process of the same interpreter and environment: a meta path finder waits for the
  first import of torch, then takes itself out and watches the process's training as
  ``graddbg run`` watches the script (graddbg._launch.boot), graddbg imported from the
  absolute path ``graddbg run`` recorded. A process that never imports torch imports
  nothing of graddbg.

Any Python 3 must be able to import this file (no newer syntax), and nothing here may make
a process fail to start.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain():
    """Run the ``sitecustomize`` this one hides (the next on ``sys.path``), if any."""
    import importlib.machinery
    import importlib.util

    paths = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def _identity():
    """As graddbg._launch.interpreter computes it in ``graddbg run``."""
    return "\n".join((sys.version, sys.prefix, os.path.realpath(sys.executable)))


def _boot():
    """Watch this process: graddbg from the path ``graddbg run`` recorded (it is already on
    ``sys.path`` in the same environment; the recorded one is used all the same)."""
    try:
        import importlib.util
        import json

        if "graddbg" not in sys.modules:
            root = json.loads(os.environ["GRADDBG_RUN_CHILD"])["graddbg"]
            spec = importlib.util.spec_from_file_location(
                "graddbg", os.path.join(root, "__init__.py"), submodule_search_locations=[root])
            module = importlib.util.module_from_spec(spec)
            sys.modules["graddbg"] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop("graddbg", None)
                raise
        from graddbg._launch import boot
        from graddbg.cli import ScriptWatcher

        boot(ScriptWatcher)
    except Exception as err:  # (a child's start must never fail because of graddbg)
        sys.stderr.write("graddbg run: this process (%d) is not watched: %s: %s\n"
                         % (os.getpid(), type(err).__name__, err))


class _ThenBoot(object):
    """torch's own loader, which then boots the watch (put back as torch's loader first)."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        try:
            self.loader.exec_module(module)
        finally:
            if getattr(module, "__spec__", None) is not None and module.__spec__.loader is self:
                module.__spec__.loader = self.loader
            if getattr(module, "__loader__", None) is self:
                module.__loader__ = self.loader
        _boot()


class _WhenTorch(object):
    """A meta path finder that fires once, at the first import of torch: it takes itself out
    of ``sys.meta_path`` and hands torch's own spec on, its loader wrapped (`_ThenBoot`)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        _unhook()
        try:
            import importlib.util

            spec = importlib.util.find_spec("torch")
        except Exception:
            return None  # (the import goes on without this finder, and fails as it would)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _ThenBoot(spec.loader)
        return spec

    def invalidate_caches(self):
        pass


def _unhook():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _WhenTorch)]


def _main():
    try:
        _chain()
    finally:
        sys.path[:] = [p for p in sys.path if not (p and os.path.abspath(p) == _HERE)]
    if not os.environ.get("GRADDBG_RUN_CHILD") or os.environ.get("GRADDBG_RUN_PYTHON") != _identity():
        return
    if "torch" in sys.modules:  # (imported by the sitecustomize chained above)
        _boot()
    else:
        sys.meta_path.insert(0, _WhenTorch())


_main()
