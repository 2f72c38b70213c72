import pytest
import torch
from hypothesis import HealthCheck, settings

import kvcache_ext

# CI runs on 2 cores: a moderate number of examples per property, no deadline (first calls JIT-warm).
settings.register_profile("ci", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("ci")

DEVICES = ["cpu"]
if torch.cuda.is_available() and kvcache_ext.build_info()["cuda"]:
    DEVICES.append("cuda")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread is faster than handing work to two, and immune to OpenMP
    spinning when the machine is busy. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer) of the default model, loaded once per test run (about 20 s)."""
    from kvcache_ext.hf.models import load_model
    return load_model()


def filled_store(B, H, D, dtype, device, lens, page_size=16, seed=0):
    """A store whose segment s holds lens[s] tokens at positions 0 .. lens[s] - 1."""
    gen = torch.Generator().manual_seed(seed)
    L = max(lens)
    store = kvcache_ext.RaggedKVStore(B, H, D, dtype=dtype, device=device, page_size=page_size)
    k, v = ((torch.randn(B, H, L, D, generator=gen) * 0.5).to(dtype) for _ in range(2))
    valid = (torch.arange(L) < torch.tensor(lens).view(B, H, 1))
    store.append(k.to(device), v.to(device), torch.arange(L), valid.to(device))
    return store
