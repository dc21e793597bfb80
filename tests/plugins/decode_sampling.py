"""An example prompt/decode/sampling pair: a tiny causal LM (each position's state is the running
mean of the token embeddings so far) decoded token by token from a cache by the rollout and scored
in one teacher-forced pass by the trainer. `example.decode` is aligned; `example.decode_topk_default`
plants an engine default: the rollout samples from top-k 20 and reports those log-probabilities."""
import torch

from harness import Axes, Outcome, TargetPair, register
from harness.sampling import process_logits, sample_rows

VOCAB, HIDDEN = 256, 32
AXES = Axes(n_seqs=(1, 8), seq_len=(1, 48), prompt_len=(0, 16), logit_scale=(1.0, 16.0),
            temperature=(0.5, 2.0), top_p=(0.8, 1.0), sample_top_k=(0, 64),
            pad_sides=("right",))  # (each sequence decodes on its own: no padded batch)


def build(case, device):
    g = torch.Generator().manual_seed(1234)  # the model's weights: fixed, like a checkpoint
    emb = torch.randn(VOCAB, HIDDEN, generator=g)  # (V, H)
    head = torch.randn(HIDDEN, VOCAB, generator=g) * (case.logit_scale / HIDDEN**0.5)  # (H, V)
    prompts = [case.prompt_tokens(j, VOCAB) for j in range(case.batch_size)]
    return {"case": case, "emb": emb, "head": head, "prompts": prompts, "u": case.token_uniforms("sample")}


def sampling(case, logits, engine_top_k=0):
    return process_logits(logits, case.temperature, engine_top_k or case.sample_top_k, case.top_p)


def rollout(inp, engine_top_k=0):  # prefill the prompt, then decode each response token from the cache
    case, rows, tokens = inp["case"], [], []
    for j, n in enumerate(case.seq_lens):
        seq = [0, *inp["prompts"][j].tolist()]  # BOS + prompt
        total = inp["emb"][seq].sum(0)  # (H,) the cache: a running sum
        for i in range(n):
            lp = sampling(case, (total / len(seq)) @ inp["head"], engine_top_k)  # (V,)
            tok = int(sample_rows(lp[None], inp["u"][case.offsets[j] + i:][:1])[0])
            rows.append(lp), tokens.append(tok), seq.append(tok)
            total = total + inp["emb"][tok]
    return Outcome(logprobs=torch.stack(rows), tokens=torch.tensor(tokens))


def trainer(inp, rollout_outcome):  # one teacher-forced pass over prompt + response
    case, out = inp["case"], []
    for j, n in enumerate(case.seq_lens):
        resp = rollout_outcome.tokens[case.offsets[j]:case.offsets[j] + n]
        seq = torch.cat([torch.zeros(1, dtype=torch.long), inp["prompts"][j], resp])  # (1 + P + n,)
        states = inp["emb"][seq].cumsum(0) / torch.arange(1, len(seq) + 1)[:, None]  # (L, H)
        out.append(sampling(case, states[-n - 1:-1] @ inp["head"]))  # the states that produced the response
    return Outcome(logprobs=torch.cat(out))


register(TargetPair(name="example.decode", kind="model", expected="aligned", build=build, trainer=trainer,
                    rollout=rollout, axes=AXES, description="prefill + cached decode vs teacher-forced pass"))
register(TargetPair(name="example.decode_topk_default", kind="model", expected="diverges", build=build,
                    trainer=trainer, rollout=lambda inp: rollout(inp, engine_top_k=20), axes=AXES,
                    description="the engine samples from top-k 20 by default; the trainer scores the full distribution"))
