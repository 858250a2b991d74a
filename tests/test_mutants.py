"""The mutation check's own contract (scripts/mutants.py): every row of its table applies to today's code, names
tests that exist, and a mutant counts as caught only when a test fails on an assertion or an error the code raises."""

import importlib.util
import re
import shlex

import pytest
from helpers.scripts import ROOT

spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
mutants = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutants)
TABLE = mutants.load_mutants()


def test_every_anchor_occurs_once_and_every_selection_names_test_files():
    for m in TABLE:
        text = (ROOT / m.file).read_text()
        assert text.count(m.original) == 1, f"{m.name}: its text occurs {text.count(m.original)} times in {m.file}"
        assert m.original != m.mutated, m.name
        files = [a.split("::")[0] for a in shlex.split(m.tests) if a.startswith("tests/")]
        assert files and all((ROOT / f).exists() for f in files), f"{m.name}: {m.tests}"
        assert m.needs in (None, *mutants.cpu_has()), f"{m.name}: needs {m.needs!r}"
        assert m.caught_on is None or re.compile(m.caught_on), m.name


def test_mutants_of_every_layer_of_the_library():
    """Options, the backend registry, the scheduler and the stateful path each have mutants, as the kernels do."""
    for file in (
        "hybrid_ops/options.py",
        "hybrid_ops/backends/registry.py",
        "hybrid_ops/generation/scheduler.py",
        "hybrid_ops/integrations/stateful.py",
    ):
        assert sum(m.file == file for m in TABLE) >= 2, file


def pytest_output(*errors):
    return "".join(f"E   {line}\n" for line in errors)


@pytest.mark.parametrize(
    "returncode, errors, expected",
    [
        (0, (), "NOT CAUGHT"),
        (1, ("assert 3 == 4",), "caught"),
        (1, ("AssertionError: Tensor-likes are not close!",), "caught"),
        (1, ("Failed: DID NOT RAISE <class 'hybrid_ops.errors.HybridInputError'>",), "caught"),
        (1, ("hybrid_ops.errors.HybridInputError: seq_lens must be ...",), "caught"),
        (1, ("TypeError: unsupported operand type(s)",), "ERROR (failed on TypeError)"),
        (1, ("IndexError: index 9 is out of bounds",), "ERROR (failed on IndexError)"),
        (2, ("SyntaxError: invalid syntax",), "ERROR (pytest exit 2)"),
        (-1, (), "ERROR (pytest exit -1)"),
        (5, (), "ERROR (no tests selected)"),
    ],
)
def test_a_crash_collection_error_or_timeout_is_not_caught(returncode, errors, expected):
    assert mutants.verdict(returncode, pytest_output(*errors)) == expected


def test_a_row_names_the_other_failure_that_catches_it():
    output = pytest_output("IndexError: index out of range in self")
    assert mutants.verdict(1, output, r"IndexError: index out of range") == "caught"
    assert mutants.verdict(1, output, r"ValueError: q implies") == "ERROR (failed on IndexError)"
