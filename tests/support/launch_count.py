"""What a GPU would pay for a forward, counted on CPU: every torch op on tensors that is not a view or an
allocation (each a kernel launch on CUDA) and every Triton kernel launch, while the code runs on CPU tensors (Triton under its
interpreter). Triton's interpreter copies its arguments with torch ops: those are not counted."""
from __future__ import annotations

import collections
import contextlib
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NOT_LAUNCHES = ("empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "detach", "_to_copy_noop")


class LaunchCounter(TorchDispatchMode):
    """Counts launches while `counting` is on (a forward hook turns it on inside the layers only)."""

    def __init__(self) -> None:
        super().__init__()
        self.torch_ops: collections.Counter[str] = collections.Counter()
        self.triton: collections.Counter[str] = collections.Counter()
        self.counting = False
        self._inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        touches_tensors = any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0])
        if self.counting and not self._inside_kernel and touches_tensors and not func.is_view \
                and name not in NOT_LAUNCHES:
            self.torch_ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.torch_ops.values()) + sum(self.triton.values())

    @contextlib.contextmanager
    def triton_launches(self, *modules: ModuleType):
        """Counts every `kernel[grid](...)` of the modules' kernels (module attributes named *_kernel)."""
        originals = {(m, n): getattr(m, n) for m in modules for n in dir(m) if n.endswith("_kernel")}
        for (module, name), kernel in originals.items():
            setattr(module, name, _Counted(kernel, name, self))
        try:
            yield self
        finally:
            for (module, name), kernel in originals.items():
                setattr(module, name, kernel)


class _Counted:
    def __init__(self, kernel, name: str, counter: LaunchCounter) -> None:
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            if self.counter.counting:
                self.counter.triton[self.name] += 1
            self.counter._inside_kernel += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self.counter._inside_kernel -= 1
        return counted
