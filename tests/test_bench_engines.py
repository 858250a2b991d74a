"""`python -m bench sglang` and `python -m bench vllm` without the engines: the engines' python found, the rounds
alternated, the rows, ratios and token comparisons, the tables, the worker's protocol, and the rows of an engine that
is not installed. No engine starts here (tests/engines runs them); no timing is asserted."""

import json

import pytest

from bench import engine_worker, engines
from bench.peers import ENGINES_PYTHON, Engine, PeerError
from bench.run import main, markdown


class Fake:
    """A row's method: generate returns `tokens` and the next of `seconds`, and records the calls."""

    def __init__(self, name, calls, tokens, seconds, fail_at=None):
        self.name, self.calls, self.tokens, self.seconds, self.fail_at = name, calls, tokens, list(seconds), fail_at

    def generate(self, prompts, new_tokens):
        self.calls.append(self.name)
        if len(self.calls) == self.fail_at:
            raise PeerError("the worker exited, see log")
        return dict(tokens=self.tokens, seconds=self.seconds.pop(0), first_token_seconds=[0.01, 0.03])


def test_engines_python_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENGINES_PYTHON, "/somewhere/python")
    assert engines.default_engines_python() == "/somewhere/python"
    monkeypatch.delenv(ENGINES_PYTHON)
    assert engines.default_engines_python() == str(engines.ROOT / ".venv-engines" / "bin" / "python")


def test_rounds_alternate_and_a_failing_row_is_dropped():
    """Each method warms up once, then every round runs each once, the order rotated; a method that fails leaves the
    rounds with its reason."""
    calls, notes = [], {}
    methods = {
        "a": Fake("a", calls, [[1]], [1.0] * 4),
        "b": Fake("b", calls, [[1]], [2.0] * 4),
        "c": Fake("c", calls, [[1]], [3.0] * 4, fail_at=10),
    }
    runs = engines.alternate(methods, [[5]], 1, 3, notes)
    assert calls[:3] == ["a", "b", "c"]  # warm-ups
    assert calls[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # the third round starts with c, which fails
    assert [len(r) for r in runs.values()] == [3, 3] and list(runs) == ["a", "b"]
    assert notes == {"c": "the worker exited, see log"}


def test_rows_medians_ratios_per_round_and_tokens():
    """Medians and ranges per method; ratios of the same round's runs; tokens against the first method's, fp32 rows
    that differ marked, bf16 ones explained."""
    same, other = [[7, 8, 9], [4, 5, 6]], [[7, 8, 1], [4, 5, 6]]
    run = lambda tokens, s: dict(tokens=tokens, seconds=s, first_token_seconds=[0.01, 0.03])
    runs = {"theirs": [run(same, 1.0), run(same, 2.0), run(same, 4.0)], "ours": [run(other, 0.5), run(other, 2.0)]}
    runs["ours"].append(run(other, 1.0))
    rows = engines.rows_of("demo", "w", runs, {"amx": "not installed (x)"}, ["theirs", "ours", "amx"], 6, True)
    theirs, ours, amx, ratio = rows
    assert theirs["tokens_per_s"] == 3.0 and theirs["tokens_per_s_range"] == [1.5, 6.0]
    assert theirs["ttft_ms"] == pytest.approx(20.0) and "same_tokens" not in theirs
    assert (ours["same_tokens"], ours["same_requests"], ours["stable_tokens"]) == (5, 1, True)
    assert amx["note"] == "not installed (x)"
    # Per round: 12 / 6, 3 / 3, 6 / 1.5.
    assert ratio["method"] == "ratio ours / theirs"
    assert ratio["tokens_per_s"] == 2.0 and ratio["tokens_per_s_range"] == [1.0, 4.0]
    table = engines.markdown("sglang", dict(rows=rows, setup=dict(reps=3, versions={"sglang": "0.5.23"})))
    assert "| demo | w | ours | 6.0 (3.0-12.0) | 20.0 (20.0-20.0) | 5 / 6, 1 / 2 requests DIFFERENT TOKENS |" in table
    assert "| demo | w | amx | not installed (x) |  |  |" in table
    assert "| demo | w | ratio ours / theirs | 2.00 (1.00-4.00) | 1.00 (1.00-1.00) |  |" in table
    bf16 = engines.rows_of("bf16 model", "w", runs, {}, ["theirs", "ours"], 6, False)
    setup = dict(reps=3, bind="0-1", preload="", versions={})
    table = engines.markdown("vllm", dict(rows=bf16, setup=setup))
    assert "5 / 6, 1 / 2 requests (bf16: engines round differently) |  |" in table


def test_engine_not_installed(tmp_path):
    with pytest.raises(PeerError, match=f"not installed \\(set {ENGINES_PYTHON}\\)"):
        Engine(None, "vllm", "dir", "float32", {}).start()
    missing = Engine(str(tmp_path / "python"), "sglang", "dir", "float32", {})
    with pytest.raises(PeerError, match="not installed: no"):
        missing.start()
    missing.close()


def test_sglang_without_the_engines_python(monkeypatch, tmp_path, capsys):
    """`python -m bench sglang` parses its flags and prints its table, every row saying why it did not run."""
    monkeypatch.setattr("bench.run.read_bandwidth", lambda: 1.0)
    monkeypatch.setattr(engines, "MODELS", ["demo"])
    missing = str(tmp_path / "python")
    results = main(["sglang", "--quick", "--reps", "1", "--engines-python", missing])
    rows = results["sglang"]["rows"]
    assert {r["method"] for r in rows} == set(engines.SGLANG_ROWS)
    assert all(r["note"] == f"not installed: no {missing}" for r in rows)
    out = capsys.readouterr().out
    assert "## sglang (python -m bench sglang): no engine ran; 1 rounds" in out
    assert f"| sglang, hybrid_ops | not installed: no {missing} |  |  |" in out


def test_engine_sections_only_when_named(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "sglang" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["engines"])
    assert "sections must be among" in capsys.readouterr().err


def test_results_markdown_holds_the_engine_tables():
    row = dict(model="demo", workload="w", method="vLLM, CPU_ATTN", tokens=8, note="not installed (set X)")
    section = dict(rows=[row], setup=dict(reps=5, bind="0-1", preload="", versions={}))
    results = dict(date="d", machine="m", read_gbps=1.0, command="c", load=[0.0, 0.0], vllm=section)
    table = markdown(results)
    assert "## vLLM (python -m bench vllm)" in table
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1, LD_PRELOAD=(none)" in table
    assert "| demo | w | vLLM, CPU_ATTN | not installed (set X) |  |  |  |" in table


def test_worker_reports_failures_and_serves_on():
    """The engine worker answers an error line for a request it cannot serve and serves the next."""
    requests = [
        dict(op="generate", prompts=[[1]], new_tokens=1),
        dict(op="start", engine="nope", model_dir="d", dtype="float32"),
        dict(op="other"),
        dict(op="stop"),
    ]
    replies = []
    engine_worker.serve([json.dumps(r) for r in requests], lambda line: replies.append(json.loads(line)))
    assert replies == [
        {"error": "RuntimeError: no engine: start one first"},
        {"error": "KeyError: 'nope'"},
        {"error": "ValueError: unknown op 'other'"},
        {},
    ]


def test_engine_env(tmp_path, monkeypatch):
    """vLLM's recommended CPU setup and sglang's CPU platform, caches in the run's own folder, this checkout first."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    python = str(tmp_path / "venv" / "bin" / "python")
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    env = engines.engine_env("vllm", python, tmp_path)
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")
    assert env["LD_PRELOAD"].split(":")[0] == str(tmp_path / "venv" / "lib" / "libiomp5.so")
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path)) and env["PYTHONPATH"] == str(engines.ROOT)
    env = engines.engine_env("sglang", python, tmp_path)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"].split(":")[0] == str(engines.STAND_INS)
