"""Which compiled variant of a Triton kernel a launch needs, decided exactly as Triton decides it, on any machine.

On a GPU, `JITFunction.run` binds a launch's arguments with a binder built from the kernel's signature
(`create_function_from_signature`): constexpr values, each integer's type, its value 1 and its divisibility by 16,
each pointer's dtype and 16-byte alignment (minus what `do_not_specialize` / `do_not_specialize_on_alignment`
exclude), then the options (num_warps, num_stages, ...). That list is the kernel cache's key: a launch whose key
is new compiles. Under the interpreter nothing is compiled, so `SpecialisationRecorder` computes the same key for
every launch of the kernels of some modules (the real binder, over a JITFunction built from the kernel's source
and its do_not_specialize lists) and records the distinct keys per kernel: more than one key for a workload is
more than one compile. `compile_launch(jit, args, kwargs, target)` compiles a recorded launch for a GPU target
with Triton's own compiler (ptxas included), which needs no GPU: launches recorded by `dry_launches` in a process
without the interpreter (tests/support/triton_compile_check.py).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from types import ModuleType

from triton.backends.compiler import BaseBackend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, create_function_from_signature

Key = tuple


def kernels_of(*modules: ModuleType) -> dict[str, object]:
    """The Triton kernels (launchable objects named *_kernel) of the modules, by name."""
    return {name: getattr(m, name) for m in modules for name in dir(m) if name.endswith("_kernel")}


def innermost(kernel):
    """The jit function an Autotuner (or a chain of them) wraps: what is launched with the config's arguments."""
    while isinstance(kernel, Autotuner):
        kernel = kernel.fn
    return kernel


def as_jit_function(kernel) -> JITFunction:
    """The kernel as a real JITFunction (under the interpreter, one built from the same source and lists)."""
    kernel = innermost(kernel)
    if isinstance(kernel, JITFunction):
        return kernel
    options = kernel.kwargs  # InterpretedFunction: what triton.jit was given
    return JITFunction(kernel.fn, do_not_specialize=options.get("do_not_specialize"),
                       do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"))


class _Binder:
    def __init__(self, kernel) -> None:
        self.jit = as_jit_function(kernel)
        self.bind = create_function_from_signature(self.jit.signature, self.jit.params, BaseBackend)

    def key(self, args: tuple, kwargs: dict) -> Key:
        _, specialization, options = self.bind(*args, **kwargs)
        named = tuple((p.name, tuple(s)) for p, s in zip(self.jit.params, specialization))
        return named + tuple(sorted((k, str(v)) for k, v in options.items()))


class SpecialisationRecorder:
    """`with SpecialisationRecorder(modules) as rec:` records every launch's key per kernel name in rec.keys;
    the kernels run as usual."""

    def __init__(self, *modules: ModuleType) -> None:
        self.kernels = kernels_of(*modules)
        self.keys: dict[str, set[Key]] = defaultdict(set)
        self._binders = {name: _Binder(k) for name, k in self.kernels.items()}

    def snapshot(self) -> dict[str, set[Key]]:
        return {name: set(keys) for name, keys in self.keys.items()}

    def __enter__(self) -> "SpecialisationRecorder":
        for name, kernel in self.kernels.items():
            target = innermost(kernel)
            run = target.run

            def recording(*args, _name=name, _run=run, **kwargs):
                key = self._binders[_name].key(args, {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})
                self.keys[_name].add(key)
                return _run(*args, **kwargs)
            target.run = recording
        return self

    def __exit__(self, *exc_info) -> None:
        for kernel in self.kernels.values():
            del innermost(kernel).run  # the instance attribute: the class's run again


def new_keys(before: dict[str, set[Key]], after: dict[str, set[Key]]) -> dict[str, list[Key]]:
    """Keys in `after` that `before` lacks, per kernel (what would compile after `before`'s launches)."""
    grown = {name: sorted(keys - before.get(name, set()), key=str) for name, keys in after.items()}
    return {name: keys for name, keys in grown.items() if keys}


@contextlib.contextmanager
def dry_launches(*modules: ModuleType):
    """Inside, the modules' kernels record their launches instead of running (for compile_launch; no device needed):
    yields a list of (kernel name, jit function, args, kwargs), one per autotune config of an autotuned kernel."""
    launches: list[tuple[str, JITFunction, tuple, dict]] = []
    kernels = kernels_of(*modules)
    for name, kernel in kernels.items():
        def record(*args, _name=name, _kernel=kernel, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            configs = _kernel.configs if isinstance(_kernel, Autotuner) else [None]
            for config in configs:
                extra = config.all_kwargs() if config is not None else {}
                launches.append((_name, innermost(_kernel), args, {**kwargs, **extra}))
        kernel.run = record
    try:
        yield launches
    finally:
        for kernel in kernels.values():
            del kernel.run


def compile_launch(jit: JITFunction, args: tuple, kwargs: dict, target):
    """Compiles the variant this launch needs for `target` (a triton GPUTarget) with Triton's compiler, as
    JITFunction.run would on that device: PTX and cubin for CUDA (ptxas ships with triton). Returns the
    CompiledKernel; raises what the compiler raises. Run it where TRITON_INTERPRET is not set."""
    import triton
    from triton.compiler.compiler import ASTSource, make_backend

    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(jit.signature, jit.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)
