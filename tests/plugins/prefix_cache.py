"""A prefix-cache example: GRPO-style groups of samples of one prompt (`Axes(prompt_group=...)`,
`case.prompt_ids`). The rollout engine computes a group's prompt state once and every later sample
of that prompt starts from the cached state (as vLLM's or SGLang's prefix cache does); the trainer
scores each sequence in one teacher-forced pass. `example.prefix_cache` is aligned;
`example.prefix_cache_hit_bug` plants a cache-hit bug: a hit restores the prompt's state but counts
its BOS token twice in its length, so only the second and later samples of a prompt diverge (a
case needs two sequences sharing a prompt to show it). `example.prefix_cache_fp8_hit` keeps the
cached prompt state in fp8 (e4m3, as an fp8 KV cache): a hit's rows are off by the rounding, near the
line, and the first sample of each prompt is exact, so a batch's mean dilutes a hit's divergence by
the clean samples' tokens. It is judged per sequence (`verdict_over="sequence"`), its twin
`example.prefix_cache_fp8_hit.batch` over the batch."""
import torch

from harness import Axes, Outcome, TargetPair, register
from harness.sampling import process_logits, sample_rows

VOCAB, HIDDEN = 256, 32
AXES = Axes(n_seqs=(1, 8), seq_len=(1, 16), prompt_len=(1, 16), prompt_group=(1, 4), logit_scale=(1.0, 16.0),
            temperature=(0.5, 2.0), pad_sides=("right",))  # (each request decodes on its own: no padded batch)


def build(case, device):
    g = torch.Generator().manual_seed(4321)  # the model's weights: fixed, like a checkpoint
    emb = torch.randn(VOCAB, HIDDEN, generator=g)  # (V, H)
    head = torch.randn(HIDDEN, VOCAB, generator=g) * (case.logit_scale / HIDDEN**0.5)  # (H, V)
    prompts = [case.prompt_tokens(j, VOCAB) for j in range(case.batch_size)]  # (a group's: one prompt)
    return {"case": case, "emb": emb, "head": head, "prompts": prompts, "u": case.token_uniforms("sample")}


def rollout(inp, hit_bug=False, fp8_cache=False):
    case, rows, tokens = inp["case"], [], []
    cache = {}  # prompt id -> (state sum, length): the engine's prefix cache
    for j, n in enumerate(case.seq_lens):
        key = case.prompt_id(j)
        if key in cache:  # a later sample of a prompt: the cached prefix
            total, length = cache[key]
            if hit_bug:
                length += 1  # the planted bug: the restored prefix counts its BOS twice
        else:
            seq = [0, *inp["prompts"][j].tolist()]  # BOS + prompt
            total, length = inp["emb"][seq].sum(0), len(seq)
            # (an fp8 cache keeps the state in fp8: a later sample restores it rounded)
            cache[key] = (total.to(torch.float8_e4m3fn).float() if fp8_cache else total, length)
        for i in range(n):
            lp = process_logits((total / length) @ inp["head"], case.temperature, 0, 1.0)  # (V,)
            tok = int(sample_rows(lp[None], inp["u"][case.offsets[j] + i:][:1])[0])
            rows.append(lp), tokens.append(tok)
            total, length = total + inp["emb"][tok], length + 1
    return Outcome(logprobs=torch.stack(rows), tokens=torch.tensor(tokens))


def trainer(inp, rollout_outcome):  # one teacher-forced pass over BOS + prompt + response per sequence
    case, out = inp["case"], []
    for j, n in enumerate(case.seq_lens):
        resp = rollout_outcome.tokens[case.offsets[j]:case.offsets[j] + n]
        seq = torch.cat([torch.zeros(1, dtype=torch.long), inp["prompts"][j], resp])  # (1 + P + n,)
        states = inp["emb"][seq].cumsum(0) / torch.arange(1, len(seq) + 1)[:, None]  # (L, H)
        out.append(process_logits(states[-n - 1:-1] @ inp["head"], case.temperature, 0, 1.0))
    return Outcome(logprobs=torch.cat(out))


register(TargetPair(name="example.prefix_cache", kind="model", expected="aligned", build=build, trainer=trainer,
                    rollout=rollout, axes=AXES, description="a rollout with a prefix cache over groups of samples"))
register(TargetPair(name="example.prefix_cache_hit_bug", kind="model", expected="diverges", build=build,
                    trainer=trainer, rollout=lambda inp: rollout(inp, hit_bug=True), axes=AXES,
                    description="a prefix-cache hit restores the prompt's state but counts its BOS twice"))
for name, over in (("example.prefix_cache_fp8_hit", "sequence"), ("example.prefix_cache_fp8_hit.batch", "batch")):
    register(TargetPair(name=name, kind="model", expected="diverges", build=build, trainer=trainer,
                        rollout=lambda inp: rollout(inp, fp8_cache=True), axes=AXES, verdict_over=over,
                        description=f"a prefix cache that keeps the prompt's state in fp8 (judged per {over})"))
