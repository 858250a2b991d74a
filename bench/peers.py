"""The peers that need a python of their own, each run by bench/peer_worker.py in a process under that python:
IPEX's paged attention (it needs torch 2.8) for the op rows, llama.cpp (llama-cpp-python) for the end-to-end rows.
docs/benchmarks.md says how to make their environments; without one a peer's rows say "not installed"."""

import json
import math
import subprocess
import tempfile
from pathlib import Path

import torch

from .peer_worker import checksum

WORKER = Path(__file__).resolve().with_name("peer_worker.py")
IPEX_PYTHON = "HYBRID_OPS_IPEX_PYTHON"  # a python with torch 2.8 and intel-extension-for-pytorch
LLAMA_CPP_PYTHON = "HYBRID_OPS_LLAMA_CPP_PYTHON"  # a python with llama-cpp-python and the converter's requirements
LLAMA_CPP_CONVERTER = "HYBRID_OPS_LLAMA_CPP_CONVERTER"  # llama.cpp's convert_hf_to_gguf.py
IPEX_METHOD = "ipex paged attention"


class PeerError(RuntimeError):
    """A peer that cannot give a row: not installed, failed, or wrong (its message is the row's note)."""


class Worker:
    """bench/peer_worker.py under `python`, asked in JSON lines; started at the first question, its stderr in a log."""

    def __init__(self, python):
        self.python, self.process = python, None
        self.log = Path(tempfile.mkdtemp()) / "peer_worker.log"

    def ask(self, **message):
        if self.process is None:
            if not Path(self.python).exists():
                raise PeerError(f"not installed: no {self.python}")
            with open(self.log, "w") as log:
                self.process = subprocess.Popen(
                    [self.python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
                )
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise PeerError(f"the worker exited, see {self.log}")
        answer = json.loads(line)
        if "error" in answer:
            raise PeerError(answer["error"])
        return answer

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait()
            self.process = None


class Ipex:
    """IPEX's rows of the op section: `method(key, batch)` builds `batch`'s case in the worker (checked there against
    float64 attention) and returns a function that times one call there and returns its seconds."""

    def __init__(self, python):
        self.worker = Worker(python) if python else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.worker is not None:
            self.worker.close()

    def method(self, key, batch):
        def make():
            if self.worker is None:
                raise PeerError(f"not installed (set {IPEX_PYTHON})")
            threads = torch.get_num_threads()
            answer = self.worker.ask(op="case", key=key, library="ipex", spec=batch.spec, threads=threads)
            if not math.isclose(answer["checksum"], checksum(batch.case), rel_tol=1e-9):
                raise PeerError("the worker built another case")
            return lambda: self.worker.ask(op="time", key=key)["seconds"]

        return make

    def forget(self):
        """Frees the worker's cases (the next section's are built anew)."""
        if self.worker is not None and self.worker.process is not None:
            self.worker.ask(op="forget")


class LlamaCpp:
    """llama.cpp's rows of the end-to-end section: a model saved with save_pretrained, converted to GGUF by
    llama.cpp's converter in the worker, greedy generation there (a warm-up run, then the measured one)."""

    def __init__(self, python, converter):
        self.worker = Worker(python) if python and converter else None
        self.converter = converter
        self.models = tempfile.TemporaryDirectory()
        self.saved = {}  # id(model) -> its directory in self.models

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.worker is not None:
            self.worker.close()
        self.models.cleanup()

    def generate(self, model, prompts, new_tokens, outtype):
        """{tokens, seconds, first_token_seconds (per request), first_logits (per request, [vocab])}."""
        if self.worker is None:
            raise PeerError(f"not installed (set {LLAMA_CPP_PYTHON} and {LLAMA_CPP_CONVERTER})")
        if id(model) not in self.saved:
            self.saved[id(model)] = f"{self.models.name}/{len(self.saved)}"
            model.save_pretrained(self.saved[id(model)])
        message = dict(
            op="generate",
            model_dir=self.saved[id(model)],
            outtype=outtype,
            converter=self.converter,
            prompts=prompts,
            new_tokens=new_tokens,
            threads=torch.get_num_threads(),
        )
        self.worker.ask(**message)
        return self.worker.ask(**message)
