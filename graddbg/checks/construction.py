"""``module_setup``: the model's modules do what their construction says. Host facts of the
model, read at the first step and again on the step audit's steps (`graddbg._args.STEP_AUDIT`),
never a device read:

- a module with an attribute ``requires_grad`` (``model.backbone.requires_grad = False``)
  whose parameters disagree with it: ``nn.Module`` has no such flag, so the assignment
  freezes (or unfreezes) nothing; ``requires_grad_(False)``, the method, does. A bug.
- a positional container (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``) that holds
  one module object with parameters at several places (``[nn.Linear(32, 1)] * 4`` repeats one
  reference): the places share their parameters, compute the same function and train as one.
  Sharing can be intended (a layer applied twice), so this is a fact, not a bug: warned once,
  never raised.
"""
from __future__ import annotations

from typing import Dict, List, Set

from torch import nn

from graddbg._args import STEP_AUDIT
from graddbg._model import unwrap
from graddbg.anomaly import Anomaly
from graddbg.checks.base import Finding, PolicyCheck, Step, Watched, finding, shown
from graddbg.checks.ledger import LedgerKeeper

__all__ = ["ModuleSetup"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class ModuleSetup(PolicyCheck):
    """``module_setup`` (see the module's docstring): each module reported once."""

    STATE = ("_seen",)
    KIND = "module_setup"
    NEEDS_OPTIMIZER = False

    after = (LedgerKeeper,)  # (its findings join the step's entry the keeper began)

    def attach(self, ctx: Watched) -> None:
        super().attach(ctx)
        self._on = self._on and ctx.model is not None
        self._seen: Set[str] = set()  # "what:module path" reported (strings: kept in a checkpoint)
        self._looked = False  # the containers were looked at (again after parameters are added)

    def params_added(self, k: int) -> None:
        self._looked = False

    def read(self, step: Step) -> List[Finding]:
        if not self._on or (self._looked and not STEP_AUDIT.includes(step.index)):
            return []
        root = unwrap(self.ctx.model)
        names = {id(p): n for p, n in zip(self.ctx.params, self.ctx.names)}
        named = {id(p): n for n, p in root.named_parameters()}  # (frozen ones too)
        found = self._flags(root, step.index, names, named)
        if not self._looked:
            self._looked = True
            found += self._repeated(root, step.index, names, named)
        return found

    def _flags(self, root: nn.Module, index: int, names: Dict[int, str], named: Dict[int, str]) -> List[Finding]:
        found = []
        for path, m in root.named_modules():
            flag = m.__dict__.get("requires_grad")
            if not isinstance(flag, bool) or f"flag:{path}" in self._seen:
                continue
            params = list(m.parameters())
            off = [p for p in params if p.requires_grad != flag]
            if not off:
                continue
            self._seen.add(f"flag:{path}")
            shown_names = [names.get(id(p)) or named.get(id(p), "?") for p in off]
            where = f"model.{path}" if path else "model"
            if flag:
                what = (f"its {len(off)} of {len(params)} parameter(s) {shown(shown_names)} are still frozen "
                        f"(requires_grad=False), so nothing was unfrozen")
                fix = f"{where}.requires_grad_(True), then add them to the optimizer (add_param_group)"
            else:
                held = self.ctx.held_by_optimizer()
                trained = ("; the optimizer holds them, so it trains them" if held is not None
                           and any(id(p) in held for p in off) else "")
                what = (f"its {len(off)} of {len(params)} parameter(s) {shown(shown_names)} still have "
                        f"requires_grad=True: they receive gradients{trained}")
                fix = f"{where}.requires_grad_(False) (the method, with an underscore), before building the optimizer"
            msg = (f"graddbg: {where}.requires_grad = {flag} sets an attribute of the {type(m).__name__} and changes "
                   f"nothing: nn.Module has no requires_grad flag (only tensors do), and {what}. Fix: {fix}.")
            watched = [names[id(p)] for p in off if id(p) in names]
            found.append(finding(self.KIND, index, watched or shown_names, [path] * max(len(watched), 1), msg,
                                 self._policy, self.ctx.rank, value=float(len(off))))
        return found

    def _repeated(self, root: nn.Module, index: int, names: Dict[int, str], named: Dict[int, str]) -> List[Finding]:
        found = []
        for path, m in root.named_modules():
            if not isinstance(m, _CONTAINERS):
                continue
            places: Dict[int, List[str]] = {}
            for key, child in m._modules.items():
                if child is not None and next(child.parameters(), None) is not None:
                    places.setdefault(id(child), []).append(key)
            for keys in places.values():
                if len(keys) < 2 or f"repeated:{path}.{keys[0]}" in self._seen:
                    continue
                self._seen.add(f"repeated:{path}.{keys[0]}")
                found.append(self._fact(root, path, m, keys, index, names, named))
        return found

    def _fact(self, root: nn.Module, path: str, container: nn.Module, keys: List[str], index: int,
              names: Dict[int, str], named: Dict[int, str]) -> Finding:
        child = container._modules[keys[0]]
        params = [names.get(id(p)) or named.get(id(p), "?") for p in child.parameters()]
        where = f"model.{path}" if path else "model"
        at = "keys" if isinstance(container, nn.ModuleDict) else "positions"
        msg = (f"graddbg.watch: a fact, maybe a bug: {where} ({type(container).__name__}) holds one "
               f"{type(child).__name__} object at {at} {', '.join(keys)}, so these places share its parameters "
               f"({shown(params)}): they compute the same function and train as one (a list built as "
               f"[module] * n repeats one reference). If the sharing is intended there is nothing to fix (to "
               f"silence it, pass module_setup=None); otherwise build each one: "
               f"nn.{type(container).__name__}([make() for _ in range(n)]).")
        watched = [n for n in params if n != "?"]
        mods = [f"{path}.{keys[0]}" if path else keys[0]] * max(len(watched), 1)
        a = Anomaly(step=index, kind=self.KIND, name=watched[0] if watched else None, module=mods[0], op=None,
                    value=float(len(keys)), threshold=None, source=None, message=msg, rank=self.ctx.rank,
                    params=tuple(watched), severity="fact")
        return Finding(a, self._policy, skip=[])

