"""Both memory backends satisfy :class:`kvarena.backend.MemoryBackend`, the one interface the
arena uses: every method with the protocol's parameters and annotations, every attribute with
its type. The host backend is checked on a real reservation; the CUDA backend's class is
checked everywhere (it imports without a GPU), and a CUDA backend instance on a real GPU in
tests/gpu."""

from __future__ import annotations

import inspect

import pytest

from kvarena.backend import MemoryBackend

TYPES = {"int": int, "str": str}


def protocol_methods() -> list[str]:
    return sorted(n for n, v in vars(MemoryBackend).items() if inspect.isfunction(v) and not n.startswith("_"))


def check_methods(cls: type) -> None:
    assert protocol_methods() == ["grow", "mapped_bytes", "release", "shrink", "shrink_target"]
    for name in protocol_methods():
        want = inspect.signature(getattr(MemoryBackend, name))
        got = inspect.signature(getattr(cls, name))
        assert [(p.name, p.kind, p.annotation) for p in got.parameters.values()] == \
            [(p.name, p.kind, p.annotation) for p in want.parameters.values()], f"{cls.__name__}.{name}{got}"
        assert got.return_annotation == want.return_annotation, f"{cls.__name__}.{name}{got}"


def check_instance(backend: object) -> None:
    assert isinstance(backend, MemoryBackend)
    for name, ann in MemoryBackend.__annotations__.items():
        value = getattr(backend, name)
        assert type(value) is TYPES[ann], f"{type(backend).__name__}.{name} = {value!r}, not {ann}"
    assert backend.reserved % backend.granularity == 0 and backend.mapped_bytes() == 0


def test_host_backend_satisfies_the_protocol():
    from kvarena.host import HostBackend

    check_methods(HostBackend)
    backend = HostBackend(1 << 20)
    try:
        check_instance(backend)
        assert backend.kind == "cpu"
        backend.grow(0, backend.granularity)
        assert backend.mapped_bytes() == backend.granularity
    finally:
        backend.release()


def test_cuda_backend_class_satisfies_the_protocol():
    from kvarena.cuda import CudaBackend

    check_methods(CudaBackend)
    assert CudaBackend.kind == "cuda"


def test_cuda_backend_instance_satisfies_the_protocol(monkeypatch):
    """On the driver fake of test_kvarena_devicelogic (the real driver: tests/gpu)."""
    from kvarena import cuda

    from .test_kvarena_devicelogic import MiB, FakeDriver

    drv = FakeDriver()
    monkeypatch.setattr(cuda, "_driver", lambda: drv)
    monkeypatch.setattr(cuda.CudaBackend, "_synchronize", lambda self: None)
    backend = cuda.CudaBackend(8 * MiB, 0)
    try:
        check_instance(backend)
    finally:
        backend.release()


def test_a_backend_missing_a_method_does_not_satisfy_it():
    class Partial:
        kind, base, reserved, granularity = "cpu", 0, 4096, 4096

        def grow(self, old: int, new: int) -> None: ...

    assert not isinstance(Partial(), MemoryBackend)
    with pytest.raises(AttributeError):
        check_methods(Partial)
