"""Continuous-batching generation over a paged KV cache, in parts as serving engines split it.

api.py            HybridGenerator, generate, GenerationStats: the public API
scheduler.py      Scheduler, Request, ScheduledStep: admission, chunked prefill, preemption (no model)
cache_manager.py  KVCacheManager: what the scheduler asks of the PagedKVCache
runner.py         StepRunner, ModelRunner: the compiled forward, warm-up, padding to buckets, tensor-parallel agreement
aot.py            package: the forward step exported and compiled ahead of time into a .pt2 file
packaged.py       PackageInfo, load: a package read, checked against this process and served from
graphs.py         CudaGraphStep: a packaged step replayed in a CUDA graph per bucket
sampler.py        SamplingParams and transformers' warpers
checks.py         argument checks
"""

from .aot import package
from .api import GenerationStats, HybridGenerator, generate
from .cache_manager import KVCacheManager
from .packaged import PackageInfo
from .runner import ModelRunner, StepRunner
from .sampler import SamplingParams
from .scheduler import Request, ScheduledStep, Scheduler

__all__ = [
    "generate",
    "GenerationStats",
    "HybridGenerator",
    "KVCacheManager",
    "ModelRunner",
    "package",
    "PackageInfo",
    "Request",
    "SamplingParams",
    "ScheduledStep",
    "Scheduler",
    "StepRunner",
]
