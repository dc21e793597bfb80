"""Your own checkpoint as trainer/rollout pairs: harness fuzz 'mine.*' --plugin this_file.py"""
import os

from harness import register
from targets.hf import BF16, FP32, hf_pair, hf_pairs

CHECKPOINT = os.environ.get("MY_CHECKPOINT", "checkpoints/my-model")  # a save_pretrained() folder

# The standard set: aligned, bf16_rollout, eager_vs_sdpa (+ bf16_rollout.replay for MoE models).
for pair in hf_pairs("mine", CHECKPOINT):
    register(pair)

# Or choose exactly what differs: here a bf16 engine whose LM head stays in float32.
register(hf_pair("mine.bf16_body", CHECKPOINT, trainer=FP32, rollout=BF16.replace(lm_head="float32"),
                 expected="diverges"))
