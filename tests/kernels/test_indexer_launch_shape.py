"""The scores kernel's launch shape (kernels/indexer_fast.py): one wave of programs, sized from the compiled
kernel's occupancy. CPU only: the SM count and the device properties are stand-ins. That the grid changes no bit of a score is
tested on the GPU (tests/kernels/test_indexer_gpu.py, spans of 1, 3 and 40 blocks against the default)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from kernels import indexer_fast  # noqa: E402

H100_LIKE = types.SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                                  max_threads_per_multi_processor=2048)


@pytest.fixture
def sms_132(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(indexer_fast, "_sm_count", lambda index: 132)


@pytest.mark.parametrize(("num_q", "length", "per_prog"), [
    (16, 32768, 16),   # 33 spans a query: 512 programs of 16 blocks <= 4 x 132 slots
    (64, 32768, 64),   # 8 spans a query
    (64, 131072, 256),
    (1, 8192, 1),      # one query: a block a program (128 programs)
    (1024, 8192, 128),  # more queries than slots: a whole row a program
])
def test_grid_is_one_wave(sms_132: None, num_q: int, length: int, per_prog: int) -> None:
    cuda = torch.device("cuda", 0)
    got = indexer_fast.blocks_per_program(num_q, length, 64, cuda, resident_per_sm=4)
    assert got == per_prog
    blocks = -(-length // 64)
    programs = num_q * -(-blocks // got)
    assert programs <= max(4 * 132, num_q), "more programs than resident slots: a second wave"


def test_resident_programs_from_registers_and_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: H100_LIKE)

    def kernel(regs: int, smem: int) -> object:
        return types.SimpleNamespace(n_regs=regs, metadata=types.SimpleNamespace(shared=smem))

    # 99 registers -> 104 allocated a thread (256 a warp at a time): 65536 / (3328 x 4 warps) = 4 programs.
    assert indexer_fast._resident_programs(kernel(99, 25 * 1024), 4, 0) == 4
    # Shared memory binds: 46 KiB + the 1 KiB the driver reserves a program: 228 KiB hold 4.
    assert indexer_fast._resident_programs(kernel(32, 46 * 1024), 4, 0) == 4
    assert indexer_fast._resident_programs(kernel(32, 100 * 1024), 4, 0) == 2
    # Warps bind: 2048 threads / 256 = 8 programs of 8 warps at most.
    assert indexer_fast._resident_programs(kernel(16, 1024), 8, 0) == 8

