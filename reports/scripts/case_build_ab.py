"""Per-call cost of building a case, its JSON key and a uniform draw, in one checkout of the harness.

    OMP_NUM_THREADS=1 python reports/scripts/case_build_ab.py <checkout>   # e.g. a worktree of an older commit

Run it alternately on two checkouts (`git worktree add /tmp/old <rev>`): each run imports that
checkout's `harness` only. Best of 5 repeats of 3000 calls each, in microseconds.
"""
import random
import sys
import timeit


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    from harness import REGISTRY
    from harness.case import Case
    from harness.strategies import uniform_cases

    REGISTRY.load_builtins()
    axes = REGISTRY.get("attention.aligned").axes
    rng, n = random.Random(0), 3000

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6

    case = Case(seed=1, seq_lens=(3, 5, 2), temperature=0.7)
    print(f"{sys.argv[1]}: Case() {best(lambda: Case(seed=1, seq_lens=(3, 5, 2), temperature=0.7)):.1f} us, "
          f"key() {best(case.key):.1f} us, uniform_cases {best(lambda: uniform_cases(axes, rng)):.1f} us")


if __name__ == "__main__":
    main()
