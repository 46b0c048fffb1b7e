"""The fused mix64 kernel on a real GPU (marked gpu; skipped without one): on CUDA buffers `gpu.mix64_partial` runs the
kernel (on after `warm_up`'s self-check), and its digests are `mix64_reference`'s, the numpy specification, for every
length, word offset and the parts of one bucket added up; on a side stream as the publisher calls it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no GPU", allow_module_level=True)

from rollpool.weights import gpu, mix64_kernel  # noqa: E402


def test_the_kernel_is_on_after_warm_up_and_sums_as_the_reference() -> None:
    dev = torch.device("cuda:0")
    gpu.warm_up(dev)
    assert mix64_kernel.enabled(), mix64_kernel._off
    g = torch.Generator().manual_seed(11)
    for n in (1, 7, 8, 9, 8 * 1024 + 3, 8 * mix64_kernel.BLOCK * mix64_kernel.ITERS * 5 + 5, 3 << 22):
        host = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert gpu.mix64_checksum(host.to(dev)) == gpu.mix64_reference(bytes(host.numpy())), n
    host = torch.randint(0, 256, (8 * 200_003 + 6,), dtype=torch.uint8, generator=g)
    data = host.to(dev)
    cut = 8 * 77_777  # a bucket's two parts, the second starting at word 77,777
    stream = gpu.side_stream(dev)
    with torch.cuda.stream(stream):
        total = gpu.mix64_partial(data[:cut], 0) + gpu.mix64_partial(data[cut:], cut // 8)
    stream.synchronize()
    assert gpu.mix64_format(int(total.item())) == gpu.mix64_reference(bytes(host.numpy()))
    assert mix64_kernel.enabled()
