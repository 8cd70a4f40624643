# ruff: noqa  -- kept as it ran
"""pytest plugin: print torch.cuda.memory_allocated() after every test whose end value differs from its start."""
import gc
import pytest
import torch

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
    yield
    gc.collect()
    after = torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
    if after != before:
        print(f"\nMEMTRACK {item.nodeid}: {before} -> {after}", flush=True)
