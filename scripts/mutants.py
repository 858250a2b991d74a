"""Mutation check: small deliberate bugs, each applied alone to a temporary copy of the repository, where the
tests selected for it must fail.

    python scripts/mutants.py                  # every mutant; exit 1 if one survives or its anchor is stale
    python scripts/mutants.py -k truncate      # the mutants whose name contains "truncate" (a regex: "a|b")
    python scripts/mutants.py --list           # the table, without running anything
    python scripts/mutants.py -k capture --tests tests/test_sglang.py \
        -- --deselect tests/test_sglang.py::test_capture_metadata
                                               # other tests than the table's; arguments after -- go to pytest
                                               # (here: does anything else in the file catch it?)

Each row of the table, scripts/mutants.toml, names a file, a text that must occur in it exactly once, the text that
replaces it, and the tests (pytest arguments) that must catch the change: fail on an assertion or an error the code
raises (`CAUGHT_ON`; a crash, a collection error or a timeout is reported as an error, not caught). Edit the table
when the code moves: a missing anchor is reported as stale and fails the check. Needs Python >= 3.11 (tomllib) and
git.
"""

import argparse
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib
import torch

from hybrid_ops.backends.cpu import kernel_capability

ROOT = Path(__file__).resolve().parent.parent

TABLE = ROOT / "scripts" / "mutants.toml"
Mutant = namedtuple("Mutant", "name file original mutated tests needs caught_on python", defaults=(None, None, None))
# The python of the engines' environment (sglang, vLLM), which .ci/run builds: the rows with `python = "engines"` run
# their tests there.
ENGINES_PYTHON = os.environ.get("HYBRID_OPS_ENGINES_PYTHON", str(ROOT / ".venv-engines" / "bin" / "python"))


def python_of(mutant) -> str:
    return ENGINES_PYTHON if mutant.python == "engines" else sys.executable


def load_mutants(path: Path = TABLE) -> list:
    """The table's rows, in order; a row's `needs` is a CPU feature its code runs only with (amx, avx512_vbmi,
    avx512_bf16), its `caught_on` a regex of one more failure that counts as caught for it: an error raised on purpose
    by code not ours (FlashInfer's own checks, the recompile errors a test asks Dynamo for), or the error a check of
    ours exists to replace (the model's IndexError for a token id past its vocabulary); its `python` "engines" for tests
    of the engine integrations (`ENGINES_PYTHON`)."""
    rows = [Mutant(**row) for row in tomllib.loads(path.read_text())["mutant"]]
    names = [m.name for m in rows]
    if len(set(names)) != len(names):
        sys.exit(f"{path}: a mutant's name occurs twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return rows


def cpu_has() -> dict:
    """The CPU features a mutant may need -> whether this machine has them (the tests of its code skip otherwise)."""
    extensions = kernel_capability().split("_")
    return {
        "amx": torch.cpu._is_amx_tile_supported(),
        "avx512_vbmi": "VBMI" in extensions,
        "avx512_bf16": "BF16" in extensions,
    }


def package_dirs(root: Path) -> dict:
    """pyproject.toml's `package-dir`: package name -> the directory it is installed from."""
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})


def copy_repository(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files, plus links that place each `package-dir` entry of
    pyproject.toml where Python looks for it (kernels/ as hybrid_ops/kernels), so nothing imports from ROOT."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for name in filter(None, listing.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    for package, directory in package_dirs(dest).items():
        link = dest / package.replace(".", "/")
        if not link.exists():
            link.symlink_to(os.path.relpath(dest / directory, link.parent), target_is_directory=True)


def module_name(file: str, dirs: dict) -> str | None:
    """The module that `file` (a path in the repository) is imported as, or None for a non-module."""
    if not file.endswith(".py"):
        return None
    stem = file[: -len(".py")].removesuffix("/__init__")
    for package, directory in dirs.items():
        if stem == directory or stem.startswith(directory + "/"):
            return package + stem[len(directory) :].replace("/", ".")
    return stem.replace("/", ".")


def check_imports_from(copy: Path, env, files, python=sys.executable) -> None:
    """Every mutated module must import from the copy (an editable install of ROOT would otherwise win)."""
    modules = sorted({m for m in (module_name(f, package_dirs(copy)) for f in files) if m})
    code = "import importlib\n" + "".join(f"print(importlib.import_module({m!r}).__file__)\n" for m in modules)
    result = subprocess.run([python, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"importing the copy's modules failed:\n{result.stderr}")
    for module, path in zip(modules, result.stdout.split()):
        if not Path(path).absolute().is_relative_to(copy):
            sys.exit(f"{module} imports from {path}, not from the copy {copy}")


def run_tests(copy: Path, env, tests: str, extra, python=sys.executable) -> tuple[int, str, float, str]:
    """(pytest's exit status, its summary counts, seconds, its output) for one selection, stopping at the first
    failure."""
    command = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *shlex.split(tests), *extra]
    start = time.perf_counter()
    try:
        result = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return -1, "timed out", time.perf_counter() - start, ""
    counts = re.findall(r"(\d+) (passed|failed|errors?|deselected)", result.stdout)
    summary = ", ".join(f"{n} {word}" for n, word in counts if word != "deselected") or "no summary"
    return result.returncode, summary, time.perf_counter() - start, result.stdout


# What a test may fail on for its mutant to count as caught, read from pytest's "E" lines: an assertion (pytest.raises'
# own included: "Failed: DID NOT RAISE", a message that does not match), or an error the code raises on purpose
# (HybridInputError, under torch.compile too). Anything else (a TypeError, an import or collection error, a timeout,
# a crash) is not a test catching the bug.
CAUGHT_ON = re.compile(r"^(assert |(?:[\w.]+\.)?(AssertionError|Failed|HybridInputError)\b)")


def verdict(returncode: int, output: str = "", caught_on: str | None = None) -> str:
    if returncode == 0:
        return "NOT CAUGHT"
    if returncode == 5:
        return "ERROR (no tests selected)"
    if returncode != 1:  # 2: interrupted (collection), 3-4: pytest's own errors, < 0: timed out or died
        return f"ERROR (pytest exit {returncode})"
    raised = re.findall(r"^E\s+(.*)$", output, re.MULTILINE)
    if any(CAUGHT_ON.search(line) or (caught_on and re.search(caught_on, line)) for line in raised):
        return "caught"
    first = next((line for line in raised if re.match(r"[\w.]+:", line)), "an error")
    return f"ERROR (failed on {first.split(':')[0][:60]})"


def apply_and_test(copy: Path, env, mutant, extra) -> tuple:
    """One mutant in `copy`, undone afterwards -> its table row (name, tests, summary, verdict, seconds)."""
    path = copy / mutant.file
    original = path.read_text()
    if original.count(mutant.original) != 1:
        return (
            mutant.name,
            mutant.tests,
            f"its text occurs {original.count(mutant.original)} times in {mutant.file}",
            "stale anchor",
            0.0,
        )
    path.write_text(original.replace(mutant.original, mutant.mutated))
    try:
        returncode, summary, seconds, output = run_tests(copy, env, mutant.tests, extra, python_of(mutant))
    finally:
        path.write_text(original)
    return mutant.name, mutant.tests, summary, verdict(returncode, output, mutant.caught_on), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="name", default="", help="only mutants whose name this regex finds (re.search)")
    parser.add_argument("-j", dest="jobs", type=int, default=2, help="mutants tested at once, each in its own copy")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip running each selection on the unmutated copy (for a caller that has just run "
        "every test on this tree, as .ci/run has)",
    )
    parser.add_argument("--tests", help="run these tests (pytest arguments) for every mutant instead of the table's")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments for every mutant")
    args = parser.parse_args()
    table = load_mutants()
    mutants = [m if args.tests is None else m._replace(tests=args.tests) for m in table if re.search(args.name, m.name)]
    for feature, present in cpu_has().items():
        if not present:  # the code runs only with it; its tests skip elsewhere
            print(f"skipped (this CPU has no {feature}): " + ", ".join(m.name for m in mutants if m.needs == feature))
            mutants = [m for m in mutants if m.needs != feature]
    if args.list or not mutants:
        for m in table:
            print(f"{m.name:42} {m.file:42} {m.tests}")
        return 0 if mutants else 1

    with tempfile.TemporaryDirectory(prefix="hybrid_ops_mutants_") as tmp:
        # No bytecode: a mutant of the same size written within the same second would reuse a stale .pyc. No
        # shrinking of hypothesis's failing examples: a mutant is caught at its first failure.
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "HYPOTHESIS_PROFILE": "mutants"}

        def env_of(copy):
            python_path = [str(copy)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            return {**env, "PYTHONPATH": os.pathsep.join(python_path)}

        copies = queue.SimpleQueue()  # a job takes a copy of its own and puts it back when done
        for i in range(max(1, args.jobs)):
            copy = Path(tmp, str(i)).resolve()
            copy_repository(copy)
            check_imports_from(copy, env_of(copy), [m.file for m in mutants if m.python is None])
            if any(m.python == "engines" for m in mutants):
                # The engine integrations import their engine, which imports only where the engine's tests set it up.
                check_imports_from(copy, env_of(copy), ["hybrid_ops/__init__.py"], ENGINES_PYTHON)
            copies.put(copy)

        def in_a_copy(work, *work_args):
            copy = copies.get()
            try:
                return work(copy, env_of(copy), *work_args)
            finally:
                copies.put(copy)

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            # The unmutated copy must pass every selection, or a "caught" would mean nothing.
            selections = [] if args.no_baseline else list(dict.fromkeys((m.tests, python_of(m)) for m in mutants))
            baselines = pool.map(lambda s: in_a_copy(run_tests, s[0], args.pytest_args, s[1]), selections)
            for (tests, _), (returncode, summary, seconds, _) in zip(selections, baselines):
                print(f"baseline  {tests:64} {summary:24} {seconds:5.1f} s", flush=True)
                if returncode not in (0, 5):  # 5: --deselect may empty a selection
                    sys.exit(f"the unmutated copy fails `pytest {tests}`: fix the tests or the code first")
            rows = []
            for row in pool.map(lambda m: in_a_copy(apply_and_test, m, args.pytest_args), mutants):
                rows.append(row)
                print(f"{row[3]:12} {row[0]} ({row[4]:.1f} s)", flush=True)

    print("\n| mutant | tests run | result | s |\n|---|---|---|---:|")
    for name, tests, summary, result, seconds in rows:
        print(f"| {name} | `{tests}`: {summary} | {result} | {seconds:.1f} |")
    caught = sum(r[3] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} mutants caught")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
