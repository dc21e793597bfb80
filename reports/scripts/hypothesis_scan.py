"""Hypothesis's one-off scan of the process's local modules for constants (it draws them now and
then), timed after importing the harness and loading the built-in pairs, as a campaign process has
them; `harness.fuzz.warm_hypothesis` runs it before a campaign's clock starts. Hypothesis keeps what
it found per file under `.hypothesis/constants/` of the working directory, so the first run in a
folder (a fresh CI checkout, pytest's tmp dirs) pays the whole scan: run it twice in an empty folder
to see both.

    cd $(mktemp -d) && PYTHONPATH=<repo> OMP_NUM_THREADS=1 python <repo>/reports/scripts/hypothesis_scan.py
"""
import sys
import time


def main() -> None:
    import harness.cli  # noqa: F401 - (what `harness fuzz` has loaded when its campaign starts)
    import harness.fuzz  # noqa: F401
    from harness.pairs import REGISTRY

    REGISTRY.load_builtins()
    from hypothesis.internal.conjecture import providers

    t = time.perf_counter()
    found = providers._get_local_constants()
    print(f"{len(sys.modules)} modules loaded; local constants scan {time.perf_counter() - t:.3f} s, "
          f"{len(found)} constants")


if __name__ == "__main__":
    main()
