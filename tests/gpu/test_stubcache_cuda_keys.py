"""Key soundness on a CUDA machine (run by scripts/run_gpu_tests.sh; skips without a GPU)."""

from __future__ import annotations

import os

import pytest

from stubcache import StubCache, StubSpec

CUDA_SRC = '''
__global__ void add_one(int *x) { *x += 1; }
extern "C" int launch(int *x) { add_one<<<1, 1>>>(x); return 0; }
'''


@pytest.mark.skipif(not os.path.isdir("/proc/driver/nvidia/gpus"), reason="needs an NVIDIA GPU")
def test_visible_gpu_architectures_enter_the_key_when_arch_list_is_unset(cache_root, monkeypatch):
    import torch

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    spec = StubSpec("cudaarch", 'extern "C" int launch(int *x);', cuda_sources=CUDA_SRC)
    archs = StubCache().preimage(spec)["fingerprint"]["cuda"]["visible_archs"]
    expect = sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    assert archs == expect
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert "visible_archs" not in StubCache().preimage(spec)["fingerprint"]["cuda"]




@pytest.mark.skipif(not os.path.isdir("/proc/driver/nvidia/gpus"), reason="needs an NVIDIA GPU")
def test_cuda_stub_tracks_no_toolkit_header(cache_root):
    import torch

    if not torch.cuda.is_available() or torch.version.cuda is None:
        pytest.skip("needs a CUDA-enabled torch")
    entry = StubCache().get_or_build(StubSpec("cudatrack", 'extern "C" int launch(int *x);',
                                              cuda_sources=CUDA_SRC))
    cuda_home = os.path.realpath(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    assert not [p for p in entry.manifest.headers if os.path.realpath(p).startswith(cuda_home + "/")]
    assert StubCache().get_or_build(StubSpec("cudatrack", 'extern "C" int launch(int *x);',
                                             cuda_sources=CUDA_SRC)).key == entry.key
