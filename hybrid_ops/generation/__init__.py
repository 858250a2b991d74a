"""Continuous-batching generation over a paged KV cache, in parts as serving engines split it.

api.py            HybridGenerator, generate, GenerationStats: the public API
scheduler.py      Scheduler, Request, ScheduledStep: admission, chunked prefill, preemption (no model)
cache_manager.py  KVCacheManager: what the scheduler asks of the PagedKVCache
runner.py         ModelRunner: the compiled forward, warm-up, padding to buckets, tensor-parallel agreement
sampler.py        SamplingParams and transformers' warpers
checks.py         argument checks
"""

from .api import GenerationStats, HybridGenerator, generate
from .cache_manager import KVCacheManager
from .runner import ModelRunner
from .sampler import SamplingParams
from .scheduler import Request, ScheduledStep, Scheduler

__all__ = [
    "generate",
    "GenerationStats",
    "HybridGenerator",
    "KVCacheManager",
    "ModelRunner",
    "Request",
    "SamplingParams",
    "ScheduledStep",
    "Scheduler",
]
