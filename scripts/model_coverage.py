"""Which of transformers' causal LMs `hybrid_ops.generate` serves: every type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
on a tiny random config (tests/helpers/models.py), greedy, eager, through a page budget that preempts, against
transformers' own generate on each prompt alone.

Results (bench/results/models.md):
    identical                 the same tokens for every prompt (detail: the preemptions; a model with state: what
                              a request's state slot counts for in the budget)
    refused (reason)          hybrid_ops raised HybridInputError before generating
    mismatch                  different tokens and no error: a bug, the one result that must never appear
    error (what)              something else raised (often the tiny config or transformers' own generate)
    not-attention-interface   the model never calls transformers' AttentionInterface, so "hybrid" cannot apply

    python scripts/model_coverage.py [model_type ...]   (all types when none is named)
"""

import signal
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.models import (  # noqa: E402
    hybrid_tokens,
    make_model,
    preempting_pages,
    reference_tokens,
    state_pages,
    tiny_config,
)

import hybrid_ops  # noqa: E402

OUT = ROOT / "bench" / "results" / "models.md"
NO_INTERFACE = "does not run through transformers' AttentionInterface"  # check_servable's reason
SECONDS_PER_MODEL = 60  # gemma4 takes about 25 s on a loaded 2-core machine


def _timeout(signum, frame):
    raise TimeoutError(f"took over {SECONDS_PER_MODEL} s")


def check(model_type):
    """(result, detail) for one model type."""
    try:
        config = tiny_config(model_type)
        model = make_model(config)
    except Exception as e:
        return "error", f"tiny config or model: {type(e).__name__}: {_first_line(e)}"
    try:
        served, stats = make_model(config), hybrid_ops.GenerationStats()
        pages = preempting_pages(served)
        tokens = hybrid_tokens(served, num_pages=pages, stats=stats)
    except hybrid_ops.HybridInputError as e:
        if NO_INTERFACE in str(e):
            return "not-attention-interface", ""
        return "refused", _first_line(e)
    except Exception as e:
        return "error", f"hybrid_ops: {type(e).__name__}: {_first_line(e)}"
    try:
        expected = reference_tokens(model)
    except Exception as e:
        return "error", f"transformers' generate: {type(e).__name__}: {_first_line(e)}"
    if tokens != expected:
        return "mismatch", f"{tokens} != {expected}"
    detail = f"{stats.preemptions} preemption{'s' * (stats.preemptions != 1)}"
    slot = state_pages(served)
    return "identical", detail + (f"; a state slot counts as {slot} page{'s' * (slot != 1)}" if slot else "")


def _first_line(e):
    return (str(e).strip().splitlines() or [""])[0][:200].replace("|", "/")


def main(model_types):
    rows, totals = [], Counter()
    for model_type in model_types:
        start = time.perf_counter()
        signal.alarm(SECONDS_PER_MODEL)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result, detail = check(model_type)
        except TimeoutError as e:
            result, detail = "error", str(e)
        finally:
            signal.alarm(0)
        totals[result] += 1
        rows.append((model_type, result, detail))
        print(f"{model_type}: {result} {detail} ({time.perf_counter() - start:.1f} s)", flush=True)
    summary = ", ".join(f"{n} {r}" for r, n in totals.most_common())
    lines = [
        "# transformers causal LMs through hybrid_ops.generate",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}: {len(rows)} model types of "
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, each on a tiny random config (tests/helpers/models.py), greedy, eager, "
        "through a page budget that preempts (the longest request's pages and two state slots), against "
        "transformers' own generate on each prompt alone. Made by `python scripts/model_coverage.py`.",
        "",
        f"**Totals:** {summary}.",
        "",
        "| model type | result | detail |",
        "|---|---|---|",
        *(f"| {t} | {r} | {d} |" for t, r, d in rows),
        "",
    ]
    if len(model_types) == len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        OUT.write_text("\n".join(lines))
    print(summary)
    return totals


if __name__ == "__main__":
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _timeout)
    main(sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
