"""Peak memory of `harness score` on long recordings at a real vocabulary: this checkout against an
earlier revision, side by side.

    python reports/scripts/score_memory.py [--baseline REV] [--vocab 151936] [--samples 4]
                                           [--prompt 16] [--response 1024]

Saves a small Qwen3-MoE checkpoint (hidden 64, 2 layers, 8 experts top-2) with the given vocabulary
to a temporary folder, writes a JSONL of recorded samples (random token ids and log-probabilities:
the scores do not matter here, the sizes do), and runs `harness score FILE --model DIR --no-tracking`
once with the harness of a `git worktree` at REV (default HEAD~1) and once with this checkout's.
Prints each run's peak resident memory (the child's own `ru_maxrss`, from `os.wait4`), wall time and
exit code. The model's own forward ((rows, width, V) float32 logits) is the floor both pay.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkpoint(folder: Path, vocab: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                               max_position_embeddings=4096, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


def recordings(path: Path, vocab: int, samples: int, prompt: int, response: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(samples):
            f.write(json.dumps({"id": f"s{i}", "prompt_ids": [rng.randrange(vocab) for _ in range(prompt)],
                                "response_ids": [rng.randrange(vocab) for _ in range(response)],
                                "rollout_logprobs": [-rng.random() * 12 for _ in range(response)]}) + "\n")


def run(checkout: Path, file: Path, model: Path, out: Path) -> tuple[float, float, int]:
    cmd = [sys.executable, "-m", "harness", "score", str(file), "--model", str(model), "--no-tracking",
           "--out", str(out), "--corpus", str(out / "corpus"), "--max-repros", "0"]
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace")
    rc = os.waitstatus_to_exitcode(status)
    if rc not in (0, 1):
        sys.exit(f"{' '.join(cmd)} (PYTHONPATH={checkout}) exited {rc}:\n{err[-2000:]}")
    return usage.ru_maxrss / 2**20, wall, rc  # (ru_maxrss is KiB on Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="HEAD~1", help="git revision to compare with (default HEAD~1)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=1024)
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="harness-score-memory-") as tmp:
        tmp = Path(tmp)
        base = tmp / "baseline"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            checkpoint(tmp / "model", args.vocab)
            recordings(tmp / "samples.jsonl", args.vocab, args.samples, args.prompt, args.response)
            print(f"harness score: {args.samples} samples of {args.prompt} + {args.response} tokens, vocab "
                  f"{args.vocab}, Qwen3-MoE hidden 64 (torch threads 1)")
            print("| harness | peak RSS GiB | wall s | exit |\n|---|---:|---:|---:|")
            for name, checkout in ((rev, base), ("this checkout", ROOT)):
                rss, wall, rc = run(checkout, tmp / "samples.jsonl", tmp / "model", tmp / f"out-{name.replace(' ', '-')}")
                print(f"| {name} | {rss:.2f} | {wall:.1f} | {rc} |", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
