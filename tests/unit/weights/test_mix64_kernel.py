"""The fused mix64 kernel (`rollpool.weights.mix64_kernel`), run by Triton's interpreter on the CPU (a child process
with ``TRITON_INTERPRET=1``, which Triton reads when the kernel is made): its sums are `mix64_reference`'s for every
length, word offset and block boundary; `gpu.self_check` finds a kernel that computes another function and switches it
off; a kernel that cannot launch (no GPU here) hands the sum to the torch path, which still gives the same digest."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from rollpool.weights import gpu, mix64_kernel  # noqa: E402

from .triton_interpreted import interpreted  # noqa: E402


def _interpreted(code: str) -> str:
    return interpreted(code, ROLLPOOL_MIX64_TRITON="1")


def test_the_kernels_sum_is_the_reference_for_every_length_and_word_offset() -> None:
    out = _interpreted("""
        import torch
        from rollpool.weights import mix64_kernel as mk
        from rollpool.weights.gpu import mix64_format, mix64_reference
        per = mk.BLOCK * mk.ITERS
        g = torch.Generator().manual_seed(7)
        for words, base in [(1, 0), (3, 0), (mk.BLOCK - 1, 0), (mk.BLOCK + 1, 9), (per, 0), (2 * per + 17, 5),
                            (3 * per - 1, 123456789)]:
            data = torch.randint(0, 256, (8 * words,), dtype=torch.uint8, generator=g)
            got = mix64_format(int(mk.mix64_words(data.view(torch.int64), base).item()))
            # the words as word `base` onwards of a bucket: the reference of the bucket with `base` zero words before,
            # less the sum of those zero words alone
            lead = mix64_reference(bytes(8 * base)) if base < 1 << 20 else None
            if lead is None:
                from rollpool.weights.gpu import _mix64_cpu
                want = mix64_format(_mix64_cpu(data, base))
            else:
                whole = int(mix64_reference(bytes(8 * base) + bytes(data.numpy())).split(":")[1], 16)
                want = mix64_format(whole - int(lead.split(":")[1], 16))
            print(words, base, got == want)
        print("off", mk._off)
    """)
    lines = out.split("\n")
    assert "off None" in lines, out
    results = [line for line in lines if line and not line.startswith("off")]
    assert len(results) == 7 and all(line.endswith("True") for line in results), out


def test_self_check_passes_the_kernel_and_switches_off_one_that_computes_another_function() -> None:
    out = _interpreted("""
        import torch
        from rollpool.weights import gpu, mix64_kernel as mk
        print("right", gpu.self_check(torch.device("cpu")), mk._off is None)
        mk._C1 ^= 1 << 40  # another multiplier: another function
        print("wrong", gpu.self_check(torch.device("cpu")), mk._off is None, mk.enabled())
    """)
    assert "right True True" in out, out
    assert "wrong False False False" in out, out


def test_a_kernel_that_cannot_launch_is_switched_off_and_the_torch_path_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton reads it as the kernel is made
    monkeypatch.setattr(mix64_kernel, "_off", None)
    monkeypatch.setattr(mix64_kernel, "_kernel", None)
    monkeypatch.setattr(gpu, "_checked", set())
    data = torch.randint(0, 256, (8 * 3000 + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    # not interpreted and no GPU here: the launch fails, as a kernel that does not build on a device would
    assert gpu._fused(data[: 8 * 3000], 0) is None
    assert mix64_kernel._off is not None and not mix64_kernel.enabled()
    # a CUDA buffer would now take the torch ops: the same ops on this CPU buffer give the reference digest
    w = data[: 8 * 3000].view(torch.int64)
    total = gpu._mix_sum(w, gpu._indices(data.device, 3000), 0) + gpu.mix64_partial(data[8 * 3000 :], 3000)
    assert gpu.mix64_format(int(total.item())) == gpu.mix64_reference(bytes(data.numpy()))


def test_the_switch_turns_the_kernel_off() -> None:
    out = _interpreted("""
        import os
        os.environ["ROLLPOOL_MIX64_TRITON"] = "0"
        from rollpool.weights import mix64_kernel as mk
        print("enabled", mk.enabled(), mk._off)
    """)
    assert "enabled False ROLLPOOL_MIX64_TRITON=0" in out, out
