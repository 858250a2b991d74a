import importlib.util
import os
import random
import zlib

import pytest
import torch
from hypothesis import Phase, settings

# Property tests draw the same examples on every run (a failure reruns as it failed) and keep no database. Mutation
# runs (scripts/mutants.py) only ask whether a test fails, so they skip shrinking the failing example.
settings.register_profile("default", derandomize=True, database=None)
settings.register_profile(
    "mutants", parent=settings.get_profile("default"), phases=[Phase.explicit, Phase.reuse, Phase.generate]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# The engines' tests (tests/engines) run in the engines' own environment, which .ci/run builds; this one has neither.
collect_ignore = [] if importlib.util.find_spec("sglang") or importlib.util.find_spec("vllm") else ["engines"]

# Each pytest-xdist worker takes its share of the cores, and the processes it starts inherit it: with torch's default
# (a thread per core in every worker) the workers' OpenMP threads spin against each other: test_transformers.py and the
# fast tier of test_cpu.py took 2.5 times as long on 2 cores. (test_cpu.py's thread-count tests set their own counts.)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // WORKERS)))
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton kernels run on the CPU through the interpreter; it must be on before a kernel is decorated.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def seed_from_test_id(request):
    """Seed `random` and torch from the test's id (crc32: the same in every process, unlike `hash()` of a string),
    so each test draws the same inputs on every run and alone or in any selection."""
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture
def deterministic():
    """Batch invariance on for the test (`hybrid_ops.set_deterministic`)."""
    import hybrid_ops

    with hybrid_ops.set_deterministic(True):
        yield


@pytest.fixture
def validation_on():
    """Metadata value checks on for the test (`hybrid_ops.set_validation`)."""
    import hybrid_ops

    with hybrid_ops.set_validation(True):
        yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches empty before and after the test: its compile counts and recompiles are its own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(items):
    """The slow tier first: with several workers (pytest-xdist) the short tests then fill in at the end, instead of
    one worker finishing a long test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
