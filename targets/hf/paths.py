"""The two execution paths of a Hugging Face pair: a KV-cache rollout and a packed trainer forward.

See `targets/hf/backend.py` for what each path does and why (the packed-mask trap, our own decode
loop). Layout of sequence j (positions): 0 = a first token from the sequence's stream, 1..P_j = prompt, P_j+1..P_j+R_j = response.
Response token i (position P_j+1+i) is scored by the output at position P_j+i; a position's key is
j * stride + position, the index of per-position tables (near-tie flags, recorded experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness import Outcome, Routing
from harness.pairs import ROW_POSITIONS
from harness.sampling import sample_rows

from .backend import RECORDED_KEYS, TIE_FLOOR, CallContext, HFModel, Numerics, ReplayError, Sampling, path_logprobs, \
    path_model, reported_logprobs


# ---------------------------------------------------------------------------------------------
# Case helpers (schema-2 API, with schema-1 fallbacks)
# ---------------------------------------------------------------------------------------------
def prompt_lens(case: Any) -> list[int]:
    p = tuple(getattr(case, "prompt_lens", ()) or ())
    return list(p) if p else [0] * len(case.seq_lens)


def seq_generator(case: Any, j: int, *salt: Any) -> Any:
    if hasattr(case, "seq_generator"):
        return case.seq_generator(j, *salt)
    return case.generator(*salt, j)


def prompt_tokens(case: Any, j: int, vocab: int, n: int) -> Any:
    import torch

    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    if hasattr(case, "prompt_tokens"):
        return case.prompt_tokens(j, vocab, "prompt").to(torch.int64)
    return torch.randint(vocab, (n,), generator=case.generator("prompt", j))


def first_token(case: Any, j: int, vocab: int) -> Any:
    """Position 0 of sequence j: a token from its prompt's stream (an RL prompt is never empty, and a
    fixed BOS would make a case with no prompt tokens the same for every seed); a group that shares a
    prompt shares it."""
    import torch

    g = case.prompt_generator(j, "first") if hasattr(case, "prompt_generator") else seq_generator(case, j, "first")
    return torch.randint(vocab, (1,), generator=g)


def sampling(case: Any) -> Sampling:
    return Sampling.of(case)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
@dataclass
class HFInputs:
    case: Any
    spec: HFModel
    device: str
    prompts: list  # per sequence: (1 + P_j,) int64: the first token, then the prompt
    resp_lens: list[int]  # R_j
    stride: int  # key stride: longest sequence + 1
    forced: Any  # (B * stride,) bool: near-tie positions
    tie_layer: int  # -1: no near ties
    gap: float
    recorded: list | None = None  # recorded samples (harness score), one per sequence: tokens, logprobs, experts
    # natural router near ties under TIE_FLOOR raised to it (backend.Runner); off where a rollout is
    # recorded or a recording is scored: those see the model as it is, as an engine would
    tie_floor: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def n_seqs(self) -> int:
        return len(self.prompts)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split()] if text.strip() else []


def encode_recorded(samples: list[dict]) -> dict[str, str]:
    """Case params carrying recorded samples (dicts with prompt_ids, response_ids, rollout_logprobs
    and optionally routed_experts [position][layer][k], with routed_layers: the decoder layer of each
    entry, default 0, 1, ...); sequences are separated by ",". Floats are
    written with repr, so they round-trip exactly."""
    params = {"rec_prompt": ",".join(" ".join(map(str, s["prompt_ids"])) for s in samples),
              "rec_response": ",".join(" ".join(map(str, s["response_ids"])) for s in samples),
              "rec_logprobs": ",".join(" ".join(repr(float(v)) for v in s["rollout_logprobs"]) for s in samples)}
    if all(s.get("routed_experts") for s in samples):
        params["rec_experts"] = ",".join(
            "|".join(f"layers.{name}:" + ";".join(" ".join(map(str, pos[i])) for pos in s["routed_experts"])
                     for i, name in enumerate(s.get("routed_layers") or range(len(s["routed_experts"][0]))))
            for s in samples)
    return params


def is_recorded(case: Any) -> bool:
    """Whether a case carries recorded samples (`harness score`) in its params, without reading them."""
    return all(k in case.params for k in RECORDED_KEYS)


def recorded_sample(case: Any) -> list[dict] | None:
    """The recorded samples a `harness score` case carries in its params (one per sequence), or None."""
    p = case.params
    if not is_recorded(case):
        return None
    import torch

    prompts, responses = str(p["rec_prompt"]).split(","), str(p["rec_response"]).split(",")
    logprobs = str(p["rec_logprobs"]).split(",")
    experts = str(p["rec_experts"]).split(",") if p.get("rec_experts") else [None] * len(prompts)
    out = []
    for pr, rs, lp, ex in zip(prompts, responses, logprobs, experts):
        table = None
        if ex:  # "layers.i:e e;e e;...|layers.j:..." -> {layer: (positions, k)}
            table = {}
            for part in ex.split("|"):
                layer, rows = part.split(":", 1)
                table[layer] = torch.tensor([_ints(r) for r in rows.split(";")], dtype=torch.int64)
        out.append({"prompt": _ints(pr), "response": _ints(rs), "logprobs": [float(v) for v in lp.split()],
                    "experts": table})
    return out


def make_inputs(case: Any, spec: HFModel, device: str) -> HFInputs:
    import torch

    vocab = spec.vocab
    rec = recorded_sample(case)
    if rec is not None:
        prompts = [torch.tensor(r["prompt"], dtype=torch.int64) for r in rec]  # as recorded (BOS included if used)
        resp = [len(r["response"]) for r in rec]
    else:
        plens = prompt_lens(case)
        prompts = [torch.cat([first_token(case, j, vocab), prompt_tokens(case, j, vocab, plens[j])])
                   for j in range(len(case.seq_lens))]
        resp = list(case.seq_lens)
    stride = max(len(p) + r for p, r in zip(prompts, resp)) + 1
    moe = spec.moe()
    tie_layer, forced = -1, None
    if moe and case.tie_fraction > 0 and rec is None:
        tie_layer = int(case.params.get("tie_layer", 0)) % moe[2]
        forced = torch.cat([case.tie_forced(j, stride, prompt_positions=len(p))  # positions keyed by j (a
                            for j, p in enumerate(prompts)])  # shared prompt's: by its prompt id)
    return HFInputs(case=case, spec=spec, device=device, prompts=prompts, resp_lens=resp, stride=stride,
                    forced=forced, tie_layer=tie_layer, gap=max(float(case.tie_gap), TIE_FLOOR), recorded=rec,
                    tie_floor=rec is None)


def _ctx(inp: HFInputs, keys: Any, replay: dict | None = None, phase: str = "",
         floor_at: dict | None = None, pairs_at: dict | None = None) -> CallContext:
    return CallContext(keys=keys, forced=inp.forced, tie_layer=inp.tie_layer, gap=inp.gap, replay=replay,
                       floor=inp.tie_floor, phase=phase, floor_at=floor_at, pairs_at=pairs_at,
                       sampling=sampling(inp.case))


def _pairs(parts: dict) -> dict:
    """{(kind, layer): (keys (m,), pairs (rounds, m, 2))}: the expert pairs the rollout's tie nudges
    moved between, over all its forwards (`CallContext.pairs`)."""
    import torch

    return {k: (torch.cat([p[0] for p in v]), torch.cat([p[1] for p in v], 1)) for k, v in parts.items()}


def _raised(parts: dict) -> dict:
    """{(kind, layer): (n,) int64 keys} the rollout raised to the tie floor, over all its forwards."""
    import torch

    return {k: torch.cat(v) for k, v in parts.items()}


def _routing(captured: dict, keys_wanted: Any, n_keys: int, top_k: int | None = None) -> tuple[dict, dict]:
    """Per layer: Routing at the wanted keys (case order), and the dense (n_keys, k) experts table."""
    import torch

    routing, tables = {}, {}
    for layer, parts in captured.items():
        keys = torch.cat([p[0] for p in parts])
        idx = torch.cat([p[1] for p in parts])
        logits = torch.cat([p[2] for p in parts])
        table = torch.full((n_keys, idx.shape[-1]), -1, dtype=torch.int64)
        table[keys] = idx.to(torch.int64)
        where = torch.full((n_keys,), -1, dtype=torch.int64)
        where[keys] = torch.arange(len(keys))
        rows = where[keys_wanted]
        if bool((rows < 0).any()):
            continue
        routing[layer] = Routing(experts=idx[rows].to(torch.int64), scores=logits[rows])
        tables[layer] = table
    return routing, tables


def scored_keys(inp: HFInputs) -> Any:
    """(T,) keys of the positions whose outputs score the response tokens, in case order."""
    import torch

    return torch.cat([j * inp.stride + len(p) - 1 + torch.arange(r)
                      for j, (p, r) in enumerate(zip(inp.prompts, inp.resp_lens))])


def routed_keys(inp: HFInputs) -> Any:
    """The keys whose routing the flip rate compares: for a recording with experts (`harness
    score`), every position they were recorded for (prompt and response: a prompt position routed
    otherwise than recorded changes what the response attends to, and router replay would force
    it); else the positions that score the response tokens (`scored_keys`)."""
    import torch

    rec = inp.recorded
    if rec is None or not all(r["experts"] for r in rec):
        return scored_keys(inp)
    keys = []
    for j, (p, n, r) in enumerate(zip(inp.prompts, inp.resp_lens, rec)):
        recorded = min(len(ex) for ex in r["experts"].values())  # (positions recorded, per layer)
        keys.append(j * inp.stride + torch.arange(min(recorded, len(p) + n, inp.stride)))
    return torch.cat(keys)


# ---------------------------------------------------------------------------------------------
# Rollout: left-padded prefill + KV-cache decode, seeded inverse-CDF sampling
# ---------------------------------------------------------------------------------------------
def rollout(inp: HFInputs, nx: Numerics) -> Outcome:
    import torch

    if inp.recorded is not None:
        return recorded_outcome(inp)
    run = path_model(inp.spec, nx.model_key, inp.device)
    case, dev = inp.case, inp.device
    smp = sampling(case)
    b = inp.n_seqs
    lens = [len(p) for p in inp.prompts]
    lp_max = max(lens)
    ids = torch.zeros(b, lp_max, dtype=torch.int64)
    mask = torch.zeros(b, lp_max, dtype=torch.int64)
    keys = torch.full((b, lp_max), -1, dtype=torch.int64)
    for j, p in enumerate(inp.prompts):
        ids[j, lp_max - len(p):] = p
        mask[j, lp_max - len(p):] = 1
        keys[j, lp_max - len(p):] = j * inp.stride + torch.arange(len(p))
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    ctx = _ctx(inp, keys.reshape(-1).to(dev), phase="prefill")
    if nx.head_rows == "scored":  # (B, 1): the head at each prompt's last position (`as_rollout` says so)
        ctx.keep = torch.arange(b)[:, None] * lp_max + lp_max - 1
    out = run(ctx, input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev), use_cache=True)
    cache = _cache_of(out)
    logits = out.logits[:, -1].float()  # (B, V)
    captured, raised, pairs = ctx.captured, ctx.raised, ctx.pairs
    steps = max(inp.resp_lens)
    u = [torch.rand(r, generator=seq_generator(case, j, "sample")) for j, r in enumerate(inp.resp_lens)]
    lp_rows: list[list] = [[] for _ in range(b)]
    tok_rows: list[list] = [[] for _ in range(b)]
    seen = counts = None
    if smp.penalized:  # each sequence's token history, for the penalties: its prompt, then what it sampled
        vocab = logits.shape[-1]
        seen = torch.zeros(b, vocab, dtype=torch.bool)
        counts = torch.zeros(b, vocab, dtype=torch.float32)
        for j, p in enumerate(inp.prompts):
            seen[j, p] = True
    for i in range(steps):
        lp = path_logprobs(nx, logits, smp, seen, counts)  # (B, V)
        ui = torch.tensor([float(u[j][i]) if i < inp.resp_lens[j] else 0.5 for j in range(b)])
        tok = sample_rows(lp, ui).to(torch.int64).cpu()  # (B,)
        lp = reported_logprobs(nx, logits, lp)  # (drawn from the processed rows; reported as the path says)
        for j in range(b):
            if i < inp.resp_lens[j]:
                lp_rows[j].append(lp[j])
                tok_rows[j].append(tok[j])
                if counts is not None:
                    counts[j, tok[j]] += 1.0
                    seen[j, tok[j]] = True
        if i == steps - 1:
            break
        active = torch.tensor([i + 1 < r for r in inp.resp_lens])
        step_keys = torch.tensor([j * inp.stride + lens[j] + i for j in range(b)])
        step_keys = torch.where(active, step_keys, torch.full_like(step_keys, -1))
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.int64)], dim=1)
        pos = torch.tensor([[lens[j] + i] for j in range(b)])
        ctx = _ctx(inp, step_keys.to(dev), phase="decode")
        ctx.captured, ctx.raised, ctx.pairs = captured, raised, pairs
        out = run(ctx, input_ids=tok[:, None].to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                  cache=cache, use_cache=True)
        cache = _cache_of(out)
        logits = out.logits[:, -1].float()
    logprobs = torch.stack([row for rows in lp_rows for row in rows])  # (T, V) case order
    tokens = torch.stack([t for rows in tok_rows for t in rows])  # (T,)
    routing, tables = _routing(captured, scored_keys(inp), inp.n_seqs * inp.stride)
    # which forward (the prefill, then decode step i), batch row and position produced each row (triage)
    where = torch.tensor([(i, j, lp_max - 1 if i == 0 else 0) for j, r in enumerate(inp.resp_lens) for i in range(r)],
                         dtype=torch.int64).reshape(-1, 3)
    return Outcome(logprobs=logprobs, tokens=tokens, routing=routing,
                   intermediates={"route_table": tables, "tie_floor_at": _raised(raised), "tie_pairs_at": _pairs(pairs),
                                  ROW_POSITIONS: where})


# ---------------------------------------------------------------------------------------------
# Trainer: packed rows, per-sequence positions, one teacher-forced forward
# ---------------------------------------------------------------------------------------------
def trainer(inp: HFInputs, rollout_outcome: Outcome, nx: Numerics, replay: bool = False) -> Outcome:
    import torch

    run = path_model(inp.spec, nx.model_key, inp.device)
    if replay and not run.gates:
        raise ReplayError(
            f"router replay: no router of this model ({type(run.model).__name__}) is one the HF backend hooks "
            "(a `mlp.gate` or `*TopKRouter` module with `top_k` and `weight` that returns (logits, weights, "
            "experts), as in transformers' Qwen-MoE, Mixtral, OLMoE, DeepSeek, GLM-4.5, ERNIE, GraniteMoE, PhiMoE "
            "and gpt-oss models), so there are no "
            "experts to replay; run this model without replay (hf_pair(..., replay=False)).")
    case, dev = inp.case, inp.device
    tokens = rollout_outcome.tokens.cpu().to(torch.int64)
    full, start = [], 0
    for p, r in zip(inp.prompts, inp.resp_lens):
        full.append(torch.cat([p, tokens[start:start + r]]))
        start += r
    rows = case.packed_rows() if nx.packing == "packed" else [[j] for j in range(len(full))]
    width = max(sum(len(full[j]) for j in row) for row in rows)
    longest = max(len(f) for f in full)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    pos = torch.zeros(len(rows), width, dtype=torch.int64)
    keys = torch.full((len(rows), width), -1, dtype=torch.int64)
    at: dict[int, tuple[int, int]] = {}  # sequence -> (row, offset)
    for r, row in enumerate(rows):
        o = 0
        for j in row:
            n = len(full[j])
            ids[r, o:o + n] = full[j]
            pos[r, o:o + n] = torch.arange(n)
            keys[r, o:o + n] = j * inp.stride + torch.arange(n)
            at[j] = (r, o)
            o += n
        # padding: fake sequences of their own, no longer than the longest real one (so no position
        # past what the case's axes, and the model's max_position_embeddings, allow)
        pos[r, o:] = torch.arange(width - o) % longest
    table = None
    if replay:
        table = {k: v.to(dev) for k, v in (rollout_outcome.intermediates.get("route_table") or {}).items()}
    # the tie floor where the rollout applied it (its decisions, not this path's own: see CallContext)
    floor_at = (rollout_outcome.intermediates or {}).get("tie_floor_at")
    pairs_at = (rollout_outcome.intermediates or {}).get("tie_pairs_at")  # (and the expert pairs its nudges moved)
    sel_r, sel_c = [], []
    for j, (p, rlen) in enumerate(zip(inp.prompts, inp.resp_lens)):
        r, o = at[j]
        sel_r += [r] * rlen
        sel_c += list(range(o + len(p) - 1, o + len(p) - 1 + rlen))
    sel_r, sel_c = torch.tensor(sel_r, dtype=torch.int64), torch.tensor(sel_c, dtype=torch.int64)
    ctx = _ctx(inp, keys.reshape(-1).to(dev), table, phase="trainer", floor_at=floor_at, pairs_at=pairs_at)
    if nx.head_rows == "scored":  # (1, T): the head at the positions that score the response tokens only
        ctx.keep = (sel_r * width + sel_c)[None]
    kwargs = {"use_cache": False} if nx.use_cache == "off" else {}
    out = run(ctx, input_ids=ids.to(dev), position_ids=pos.to(dev), attention_mask=None, **kwargs)
    # (T, V) in case order (rows cut by the head, or picked from every position: head_rows "all", or a
    # model that bypasses its output-embeddings module)
    logits = (out.logits[0] if ctx.kept else out.logits[sel_r, sel_c]).float()
    del out
    smp = sampling(case)
    routing, _ = _routing(ctx.captured, routed_keys(inp), inp.n_seqs * inp.stride)
    if inp.recorded is not None:
        # only the recorded tokens' log-probabilities are kept: rows are processed a chunk at a time, so
        # a long recording costs one chunk of (rows, V) beyond the model's logits, not (T, V) twice
        step = max(1, RECORDED_CHUNK_ELEMS // logits.shape[-1])
        lp_token = torch.cat([reported_logprobs(nx, logits[a:a + step], path_logprobs(
                                  nx, logits[a:a + step], smp,
                                  *_history_rows(inp, tokens, a, min(a + step, len(logits)), smp, logits)))
                              .gather(1, tokens[a:a + step, None].to(logits.device)).squeeze(1).cpu()
                              for a in range(0, len(logits), step)])
        return Outcome(logprobs=two_outcome(lp_token), routing=routing)
    logprobs = reported_logprobs(nx, logits, path_logprobs(  # (T, V)
        nx, logits, smp, *_history_rows(inp, tokens, 0, len(logits), smp, logits)))
    where = torch.stack([torch.zeros_like(sel_r), sel_r, sel_c], -1)  # (its one forward; for triage)
    return Outcome(logprobs=logprobs, routing=routing, intermediates={ROW_POSITIONS: where})


# ---------------------------------------------------------------------------------------------
# Recorded samples (harness score)
# ---------------------------------------------------------------------------------------------
RECORDED_CHUNK_ELEMS = 1 << 24  # logits elements the trainer processes at a time when it scores a recording


def _history_rows(inp: HFInputs, tokens: Any, first: int, last: int, smp: Sampling, logits: Any) -> tuple[Any, Any]:
    """(seen, counts) of outcome rows first..last-1 (case order; `harness.sampling.history`), on the
    logits' device, where a penalty is on; (None, None) where none is."""
    if not smp.penalized:
        return None, None
    import torch

    from harness.sampling import history

    seen, counts, start = [], [], 0
    for p, r in zip(inp.prompts, inp.resp_lens):
        lo, hi = max(first, start), min(last, start + r)
        if lo < hi:
            s, c = history(p, tokens[start:start + r], logits.shape[-1], lo - start, hi - start)
            seen.append(s)
            counts.append(c)
        start += r
    return torch.cat(seen).to(logits.device), torch.cat(counts).to(logits.device)


def two_outcome(lp_token: Any) -> Any:
    """(T, 2) float64 rows of the two-outcome coarsening {the sampled token, everything else}: column
    0 holds the token's log-probability lp, column 1 log(1 - p).

    The metrics' sums over a row's vocabulary see exactly these two terms: spread over (T, V) with
    -inf elsewhere they would add only exact zeros, so the values are the same bit for bit, at
    16 bytes per token instead of 8 V (1.2 GB per 1,000 tokens at V = 151936, on each side)."""
    from harness.pairs import token_outcome

    return token_outcome(lp_token).logprobs


def recorded_outcome(inp: HFInputs) -> Outcome:
    import torch

    tokens = torch.tensor([t for r in inp.recorded for t in r["response"]], dtype=torch.int64)
    lp = torch.tensor([v for r in inp.recorded for v in r["logprobs"]], dtype=torch.float64)
    routing, tables = {}, {}
    if all(r["experts"] for r in inp.recorded):
        wanted = routed_keys(inp)
        for layer in inp.recorded[0]["experts"]:
            k = inp.recorded[0]["experts"][layer].shape[-1]
            table = torch.full((inp.n_seqs * inp.stride, k), -1, dtype=torch.int64)
            for j, r in enumerate(inp.recorded):
                ex = r["experts"][layer]  # (positions, k): recorded per position of the sequence
                n = min(len(ex), inp.stride)
                table[j * inp.stride:j * inp.stride + n] = ex[:n]
            tables[layer] = table
            if bool((table[wanted] >= 0).all()):
                routing[layer] = Routing(experts=table[wanted])
    return Outcome(logprobs=two_outcome(lp), tokens=tokens, routing=routing,
                   intermediates={"route_table": tables}, recorded=True)


def _cache_of(out: Any) -> Any:
    """The KV cache a forward returned (`cache` in newer transformers, `past_key_values` before)."""
    got = getattr(out, "cache", None)
    return got if got is not None else out.past_key_values


def records(inp: HFInputs, outcome: Outcome) -> list[dict]:
    """The rollout's samples as an RL framework records them (the `harness score` input format):
    per sequence the prompt ids (first token included), the response ids, the log-probability of every
    response token under the distribution it was sampled from, and (MoE) the experts routed at every
    position but the last, `[position][layer][k]`."""
    import torch

    tables = outcome.intermediates.get("route_table") or {}
    layers = sorted(tables, key=lambda name: int(name.rsplit(".", 1)[-1]))
    picked = outcome.logprobs.gather(1, outcome.tokens[:, None].to(outcome.logprobs.device)).squeeze(1).cpu()
    out, start = [], 0
    for j, (p, r) in enumerate(zip(inp.prompts, inp.resp_lens)):
        row = {"prompt_ids": p.tolist(), "response_ids": outcome.tokens[start:start + r].tolist(),
               "rollout_logprobs": [float(v) for v in picked[start:start + r].to(torch.float64)]}
        if layers:
            n = len(p) + r - 1
            keys = j * inp.stride + torch.arange(n)
            row["routed_experts"] = torch.stack([tables[name][keys] for name in layers], dim=1).tolist()
        out.append(row)
        start += r
    return out
