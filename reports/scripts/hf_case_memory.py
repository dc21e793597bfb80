"""Peak memory of one Hugging Face pair case with long prompts at a real vocabulary: this checkout
against an earlier revision, side by side.

    python reports/scripts/hf_case_memory.py [--baseline REV] [--vocab 151936] [--seqs 16]
                                             [--prompt 1024] [--response 16] [--packing packed]

Builds a small Qwen3-MoE from a config (hidden 64, 2 layers, 8 experts top-2, the given vocabulary)
and runs one case of its aligned float32 pair (`hf_pair(..., FP32, FP32)`: KV-cache decode against the
packed (or per-sequence) teacher-forced trainer) with `seqs` sequences of `prompt` prompt and
`response` response tokens, in a fresh process per run: the harness of a `git worktree` at REV
(default HEAD~1), then this checkout's with the trainer's LM head at every position (`head_rows`
"all", the default) and at the scored rows only ("scored"). Prints each run's peak resident memory
(`ru_maxrss` from `os.wait4`), wall time and the judged mean (the same case in every run: the
figures should agree to float32 noise).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from harness import Case
from harness.execute import run_case
from targets.hf import FP32, hf_pair
a = json.loads(sys.argv[1])
cfg = dict(model_type="qwen3_moe", vocab_size=a["vocab"], hidden_size=64, intermediate_size=128,
           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           num_experts=8, num_experts_per_tok=2, max_position_embeddings=8192, tie_word_embeddings=False)
nx = FP32.replace(packing=a["packing"])
trainer = nx.replace(head_rows=a["head_rows"]) if a["head_rows"] else nx
pair = hf_pair("mem.case", cfg, trainer, nx)
case = Case(seed=1, seq_lens=(a["response"],) * a["seqs"], prompt_lens=(a["prompt"],) * a["seqs"])
ev = run_case(pair, case)
print(json.dumps({"score": ev.score, "error": ev.error}))
"""


def run(checkout: Path, args: argparse.Namespace, head_rows: str | None) -> tuple[float, float, dict]:
    spec = json.dumps({**{k: getattr(args, k) for k in ("vocab", "seqs", "prompt", "response", "packing")},
                       "head_rows": head_rows})
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, spec], cwd=checkout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"the case exited {os.waitstatus_to_exitcode(status)} (PYTHONPATH={checkout}):\n{err[-2000:]}")
    return usage.ru_maxrss / 2**20, wall, json.loads(out.strip().splitlines()[-1])  # (ru_maxrss is KiB)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare with (default HEAD~1)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--packing", default="packed", choices=("packed", "per_sequence"))
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="harness-case-memory-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            print(f"one case of an aligned float32 HF pair ({args.packing} trainer): {args.seqs} sequences of "
                  f"{args.prompt} + {args.response} tokens, vocab {args.vocab}, Qwen3-MoE hidden 64 (torch threads 1)")
            print("| harness | peak RSS GiB | wall s | judged mean |\n|---|---:|---:|---:|")
            for name, checkout, rows in ((rev, base, None), ("this checkout, trainer head_rows all", ROOT, "all"),
                                         ("this checkout, trainer head_rows scored", ROOT, "scored")):
                rss, wall, res = run(checkout, args, rows)
                score = f"{res['score']:.3e}" if res["error"] is None else f"error: {res['error']}"
                print(f"| {name} | {rss:.2f} | {wall:.1f} | {score} |", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
