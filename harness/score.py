"""`harness score`: judge rollouts an RL framework recorded, with a trainer.

Input: a JSONL file (one sample per line) or a Parquet file (one sample per row; needs pyarrow),
each sample holding the prompt's token ids, the response's token ids, the rollout's log-probability
of every response token and, optionally, the experts the rollout routed every token to. Field names
(the first one found wins):

    prompt     prompt_ids | prompt_token_ids | prompts        list[int], non-empty (BOS included if used)
    response   response_ids | response_token_ids | responses  list[int], non-empty
    logprobs   rollout_logprobs | rollout_log_probs | logprobs list[float], one per response token, <= 0
    experts    routed_experts | rollout_routed_experts         optional [positions][layers][top_k] ints,
                                                               positions = prompt + response (or one less),
                                                               layers = the MoE layers, or every decoder
                                                               layer (a dense one's entry is not read)
    id         id | uid | index                                optional sample id, echoed in the output
    sampling   temperature, top_p, top_k, min_p, the penalties  optional: the row's own settings (top level or in
                                                               a `sampling_params` object; top_k -1 or 0: off),
                                                               over the command's (`row_sampling`)

slime's samples (`Sample.tokens` = prompt + response, `response_length`) are read as they are:
`tokens` and `response_length` stand in for prompt/response. verl's batches are padded tensors:
unpad them first (`prompts[i][attention_mask[i, :P] == 1]`, `responses[i][response_mask[i] == 1]`,
`rollout_log_probs[i][response_mask[i] == 1]`, and `routed_experts` when router replay records them).
Rows that look padded (a prompt starting with a run of a pad id; a response ending with a run, >= 2,
of one id recorded at exactly 0.0 or exactly -1, what verl pads log-probs with) are scored as they
are and named in one warning, with how to unpad.

The trainer is a registered Hugging Face pair (`--pair NAME`, its trainer path and numerics) or a
local checkpoint (`--model PATH`, float32 sdpa). Each sample becomes a case carrying the recording
(`targets/hf`: the rollout path returns the recording, the trainer scores it in one forward), so
the metrics are exactly those `harness replay` recomputes. Per-token metrics are exact (k3, log-prob
differences, ratios); the rollout's full distribution is not recorded, so `kl` here is the KL of the
two-outcome coarsening {sampled token, everything else}: a lower bound of the exact KL.

Output: per-sample metrics (`samples.csv`), batch metrics under verl's rollout-correction names
(`summary.json`, printed), the flagged samples (see below), the worst of them
written as repros (`corpora/<pair>/<id>.json`; the recording lives in the case: the whole prompt and
the response cut to MAX_REPRO_TOKENS tokens in all, at least one response token, which leaves the scores
of the tokens kept unchanged because the trainer is causal; a prompt is never cut, since that would
change what every response token is conditioned on; when the divergence lies past the cut, the repro
scores the worst token alone with the response before it moved into the prompt), a histogram of per-sample k3 (`k3_hist.png`), and an
MLflow campaign run. `flip_rate` and `tie_flip_rate` are empty in samples.csv for a sample that recorded
no experts (n/a on the console, NaN in the batch when none did). Bad rows (missing fields, an empty
prompt, ragged lengths, NaN or +inf log-probs (-inf, log 0, is judged: a sampled token at probability
0), ids out of the vocabulary, malformed experts, a prompt + response longer than the model's
`max_position_embeddings`, times its RoPE scaling factor where one extends it) are reported by line
and field, with what to do; the rest of the file is scored. A checkpoint folder with no weight file,
or a trainer that cannot be built, is one error before anything is scored. Progress:
a bar on a terminal from PROGRESS_FROM samples on; elsewhere (a job's log) a plain line on stderr
every PROGRESS_EVERY seconds. Ctrl-C or SIGTERM writes the samples scored so far (no repro), then
exits 130. A sample under the line with tokens whose probability ratio is outside [1/2, 2] (where a
rollout-correction token mask acts) is named in a note (`ratio_outliers`).

A sample is flagged by the case's own verdict: the mean k3 of its recorded tokens, or the KL of the
two-outcome coarsening (a lower bound of the exact KL), above the threshold.

Exit codes: 0 every sample scored and under the threshold, 1 some above it, 2 usage or input error
(no file, no scorer, a checkpoint without weights, no valid row; or bad rows beside samples that were all
under the threshold); 3 a flagged sample's repro could not be written.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import click

from .case import NEUTRAL, PENALTY_BOUNDS, finite_number
from .clitypes import FiniteFloat
from .errors import UsageError
from .metrics import LOG_ZERO
from .pairs import SAMPLING_AXES

MAX_REPRO_TOKENS = 1024  # prompt + response tokens a recorded repro keeps (a longer prompt: whole, + 1 response token;
# a divergence past them: its worst token, the response before it as prompt, `write_repro`)
OUT_OF_VOCAB = "is outside the model's vocabulary"  # a bad row's words for an id past it (counted when all are)
PROGRESS_FROM = 50  # show a progress bar from this many samples on (on a terminal)
PROGRESS_EVERY = 20.0  # seconds between plain progress lines when stderr is not a terminal (a job's log)
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")  # what transformers loads a checkpoint folder's weights from
# verl pads a batch's rollout_log_probs with 0.0 (its agent loop) or -1 (its vLLM rollout): a response
# ending in a run of one id recorded at exactly one of these is a row that was not unpadded
PAD_LOGPROBS = (0.0, -1.0)

ALIASES = {
    "prompt": ("prompt_ids", "prompt_token_ids", "prompts"),
    "response": ("response_ids", "response_token_ids", "responses"),
    "logprobs": ("rollout_logprobs", "rollout_log_probs", "logprobs"),
    "experts": ("routed_experts", "rollout_routed_experts"),
    "id": ("id", "uid", "index"),
}


@dataclass
class Sample:
    line: int  # 1-based line (JSONL) or row (Parquet)
    id: str
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    experts: list | None = None  # [positions][MoE layers][k]
    expert_layers: tuple[int, ...] | None = None  # the decoder layer of each MoE-layer entry (None: 0, 1, ...)
    # the row's own sampling settings (case field -> value: temperature, top_p, sample_top_k, min_p, the
    # penalties), over the command's; {} where the row records none
    sampling: dict = field(default_factory=dict)
    unapplied: list = field(default_factory=list)  # settings it records that the scorer does not apply (`row_sampling`)
    raw_mode: bool = False  # its `logprobs_mode` says raw: scored at the unprocessed distribution


@dataclass
class BadRow:
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"line {self.line}, field {self.field!r}: {self.message}"


def _cut_tokens(sc: Any) -> int:
    """A scored sample's recorded tokens its trainer gives probability 0 (log at or below LOG_ZERO)."""
    import numpy as np

    pt = getattr(getattr(sc.evaluation, "divergence", None), "per_token", None) or {}
    lt = pt.get("logp_trainer")
    return 0 if lt is None else int(np.sum(np.asarray(lt, dtype=np.float64) <= LOG_ZERO))


def _finite_gap(scored: list) -> tuple[float, int]:
    """The mean over samples of mean(logp_rollout - logp_trainer) over the tokens both paths give a
    finite log-probability above LOG_ZERO, and how many tokens the trainer gives probability 0 (left out)."""
    import numpy as np

    gaps, cut = [], 0
    for sc in scored:
        pt = getattr(getattr(sc.evaluation, "divergence", None), "per_token", None) or {}
        if "logp_trainer" not in pt or "logp_rollout" not in pt:
            continue
        lt = np.asarray(pt["logp_trainer"], dtype=np.float64)
        lr = np.asarray(pt["logp_rollout"], dtype=np.float64)
        ok = np.isfinite(lt) & np.isfinite(lr) & (lt > LOG_ZERO) & (lr > LOG_ZERO)
        cut += int(np.sum(lt <= LOG_ZERO))
        if ok.any():
            gaps.append(float(np.mean(lr[ok] - lt[ok])))
    return (float(np.mean(gaps)) if gaps else 0.0), cut


@dataclass
class Scored:
    sample: Sample
    metrics: dict[str, Any]
    evaluation: Any
    case: Any


@dataclass
class ScoreResult:
    scored: list[Scored] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)
    batch: dict[str, float] = field(default_factory=dict)
    flagged: list[Scored] = field(default_factory=list)
    repros: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    out_dir: Path | None = None
    seconds: float = 0.0
    unsaved: int = 0  # flagged samples whose repro could not be written (the exit code says so: 3)
    ignored_rows: int = 0  # rows whose own sampling settings were not read (`row_settings=False`)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
def read_rows(path: Path) -> tuple[int, Iterator[tuple[int, Any]]]:
    """(number of rows, iterator of (line, dict or BadRow))."""
    if not path.exists():
        raise UsageError(f"rollout file {str(path)!r} does not exist; pass a JSONL (one sample per line) or Parquet "
                         "file of recorded samples.")
    if path.suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError(f"{str(path)!r} is Parquet, which needs pyarrow: pip install pyarrow (or the `hf` extra), "
                             "or convert the file to JSONL.") from None
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - any unreadable file is an input error
            raise UsageError(f"{str(path)!r} is not a readable Parquet file ({type(e).__name__}: {e}).") from None

        def parquet_rows() -> Iterator[tuple[int, Any]]:
            n = 0  # rows are numbered from 1 in file order, as lines are
            for g in range(pf.num_row_groups):
                size, first = pf.metadata.row_group(g).num_rows, n + 1
                try:  # one row group at a time, in batches: a damaged one is reported, the others are scored
                    for batch in pf.iter_batches(batch_size=256, row_groups=[g]):
                        for row in batch.to_pylist():
                            n += 1
                            yield n, row
                except Exception as e:  # noqa: BLE001 - pyarrow's errors for damaged data are of many types
                    yield n + 1, BadRow(n + 1, "(row group)", f"row group {g} (rows {n + 1} to {first + size - 1}) "
                                        f"could not be read ({type(e).__name__}: {str(e)[:200]}); the other row groups "
                                        "are scored")
                    n = first + size - 1

        return pf.metadata.num_rows, parquet_rows()
    try:
        with path.open("rb") as fh:
            total = sum(1 for line in fh if line.strip())
    except OSError as e:
        raise UsageError(f"cannot read {str(path)!r}: {e}.") from None

    def jsonl_rows() -> Iterator[tuple[int, Any]]:
        with path.open(encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.rstrip("\r\n"))  # (a cut line's error at its own end, not "line 2 column 1")
                except json.JSONDecodeError as e:
                    yield n, BadRow(n, "(line)", f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
                    continue
                except (ValueError, RecursionError) as e:  # an integer of thousands of digits; nesting too deep
                    yield n, BadRow(n, "(line)", "not JSON this reader takes ("
                                    + ("nested too deeply" if isinstance(e, RecursionError) else str(e)) + ")")
                    continue
                if not isinstance(row, dict):
                    yield n, BadRow(n, "(line)", f"a sample must be a JSON object, got {type(row).__name__}")
                    continue
                yield n, row

    return total, jsonl_rows()


def _pick(row: dict, what: str) -> tuple[str | None, Any]:
    for name in ALIASES[what]:
        if name in row and row[name] is not None:
            return name, row[name]
    return None, None


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _int_list(line: int, name: str, value: Any, vocab: int) -> list[int] | BadRow:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        if isinstance(value, (list, tuple)) and name in ALIASES["prompt"]:
            return BadRow(line, name, "is empty: the first response token is scored from the last prompt position, so a "
                          "prompt needs at least one token; record the prompt ids the engine prefilled (its BOS or chat "
                          "template included)")
        return BadRow(line, name, "must be a non-empty list of token ids")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            else:
                return BadRow(line, name, f"entry {i} is {_short(v)}, not an integer token id")
        if not 0 <= v < vocab:
            return BadRow(line, name, f"token id {_short(v)} at index {i} {OUT_OF_VOCAB} [0, {vocab})")
        out.append(v)
    return out


def position_limit(fields: dict) -> tuple[int, str] | None:
    """(longest prompt + response the model's positions cover, how the config says so), from its
    `max_position_embeddings` (`n_positions` in GPT-2-style configs) and, where a RoPE scaling extends
    it, as vLLM counts it (`rope_scaling` or transformers 5's `rope_parameters`: the factor times the
    table, yarn's times its `original_max_position_embeddings`; llama3 and longrope already state the
    extended length); None when the config names no limit."""
    name = "max_position_embeddings" if fields.get("max_position_embeddings") else "n_positions"
    try:
        table = int(fields.get(name) or 0)
    except (TypeError, ValueError):
        return None
    if table <= 0:
        return None
    rope = fields.get("rope_scaling") or fields.get("rope_parameters")
    if isinstance(rope, dict) and "factor" not in rope:  # (per layer type: {"full_attention": {...}, ...})
        rope = next((v for v in rope.values() if isinstance(v, dict) and "factor" in v), rope)
    if isinstance(rope, dict) and "factor" in rope:
        kind = rope.get("rope_type", rope.get("type"))
        try:
            factor = float(rope["factor"])
            base = int(rope.get("original_max_position_embeddings") or table) if kind == "yarn" else table
        except (TypeError, ValueError):
            factor, base = 1.0, table
        if kind not in ("default", "su", "longrope", "llama3") and int(base * factor) > table:
            return int(base * factor), (f"positions ({int(base * factor)}: {base} x its {kind} RoPE scaling factor "
                                        f"{factor:g})")
    return table, f"{name} ({table})"


def parse_sample(line: int, row: dict, vocab: int, moe: tuple[int, int, int] | None,
                 positions: tuple[int, str] | None = None, moe_layers: Any = None) -> Sample | BadRow:
    """A validated sample, or the first thing wrong with the row (naming line and field). `positions`:
    the model's `position_limit` (a longer prompt + response is a bad row). `moe_layers`: the decoder
    layers that route (a tuple, or a function giving it, called only for a row with experts; None:
    every layer): routed experts may hold one entry per MoE layer, or one per decoder layer (a dense
    layer's entry, a placeholder, is not read)."""
    if "tokens" in row and "response_length" in row and _pick(row, "prompt")[0] is None:  # slime
        toks, rl = row["tokens"], row["response_length"]
        if hasattr(toks, "tolist"):
            toks = toks.tolist()
        if not isinstance(rl, int) or not isinstance(toks, list) or not 0 < rl < len(toks):
            return BadRow(line, "response_length", "must be an integer with 0 < response_length < len(tokens)")
        row = {**row, "prompt_ids": toks[:-rl], "response_ids": toks[-rl:]}
    got = {}
    for what in ("prompt", "response", "logprobs"):
        name, value = _pick(row, what)
        if name is None:
            return BadRow(line, ALIASES[what][0], f"is missing (accepted names: {', '.join(ALIASES[what])})")
        got[what] = (name, value)
    prompt = _int_list(line, got["prompt"][0], got["prompt"][1], vocab)
    if isinstance(prompt, BadRow):
        return prompt
    response = _int_list(line, got["response"][0], got["response"][1], vocab)
    if isinstance(response, BadRow):
        return response
    if positions is not None and len(prompt) + len(response) > positions[0]:
        limit, what = positions
        why = ("positions past it are ones the model was never built for, so the trainer's log-probs there would say "
               "nothing about the engine")
        if len(prompt) >= limit:  # (no response token fits: a prompt is never cut)
            return BadRow(line, got["prompt"][0], f"the prompt alone holds {len(prompt)} tokens, which leaves no "
                          f"position for a response token within the model's {what}: {why}; drop the sample, or score "
                          "it with a model made for longer sequences")
        return BadRow(line, got["response"][0], f"{len(prompt)} prompt + {len(response)} response = "
                      f"{len(prompt) + len(response)} tokens, longer than the model's {what}: {why}; cut the "
                      f"response (and its log-probs and experts) to its first {limit - len(prompt)} token(s), or drop "
                      "the sample")
    lname, lps = got["logprobs"]
    if hasattr(lps, "tolist"):
        lps = lps.tolist()
    if not isinstance(lps, (list, tuple)):
        return BadRow(line, lname, "must be a list of log-probabilities")
    if len(lps) != len(response):
        return BadRow(line, lname, f"holds {len(lps)} values for {len(response)} response tokens (ragged); "
                                   "record one log-probability per response token")
    logprobs = []
    for i, v in enumerate(lps):
        # -inf (log 0, JSON's -Infinity) is a value an engine reports for a token it gives probability 0: one it
        # sampled is the clearest sign it samples from another distribution than it reports, judged (k3 inf), not
        # refused as a bad row
        if not finite_number(v) and not (isinstance(v, float) and v == -math.inf):
            return BadRow(line, lname, f"entry {i} is {_short(v)}: log-probabilities must be numbers <= 0 (finite, or "
                                       "-inf for probability 0)")
        if float(v) > 1e-6:
            return BadRow(line, lname, f"entry {i} is {v!r} > 0: not a log-probability")
        logprobs.append(float(v))
    ename, experts = _pick(row, "experts")
    if experts is not None:
        if hasattr(experts, "tolist"):
            experts = experts.tolist()
        if moe is None:
            return BadRow(line, ename, "the scoring model has no experts (not a MoE model); drop the field")
        n_experts, top_k, layers = moe
        routed = tuple(moe_layers() if callable(moe_layers) else moe_layers or range(layers))
        total = len(prompt) + len(response)
        if not isinstance(experts, list) or len(experts) not in (total, total - 1):
            return BadRow(line, ename, f"needs one entry per position (prompt + response = {total}, or {total - 1}), "
                                       f"got {len(experts) if isinstance(experts, list) else type(experts).__name__}")
        width = len(experts[0]) if experts and isinstance(experts[0], list) else -1
        if width not in (len(routed), layers):
            dense = (f"; its decoder layers {', '.join(str(i) for i in range(layers) if i not in routed)} are dense"
                     if len(routed) < layers else "")
            return BadRow(line, ename, f"position 0 holds {width if width >= 0 else 'no list of'} layer entries; a "
                                       f"position holds one entry per MoE layer ({len(routed)}: layers "
                                       f"{', '.join(map(str, routed))}{dense}), or one per decoder layer ({layers}, a "
                                       "dense layer's entry not read), each of "
                                       f"{top_k} expert ids")
        kept = routed if width == layers and len(routed) < layers else range(width)  # (entries to read)
        out = []
        for p, per_pos in enumerate(experts):
            if not isinstance(per_pos, list) or len(per_pos) != width or any(
                    not isinstance(per_pos[i], list) or len(per_pos[i]) != top_k for i in kept):
                return BadRow(line, ename, f"position {p} must hold {width} layer entries, as position 0 does, with "
                                           f"{top_k} expert ids at each MoE layer")
            per_pos = [per_pos[i] for i in kept]
            out.append(per_pos)
            for layer, e in zip(routed, per_pos):
                for x in e:
                    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n_experts:
                        return BadRow(line, ename, f"position {p}: expert id {x!r} is not in [0, {n_experts})")
                if len(set(e)) != len(e):
                    return BadRow(line, ename, f"position {p}, layer {layer}: expert ids {e} repeat; a router picks "
                                               f"{top_k} distinct experts")
        experts = out
    settings = row_sampling(line, row)
    if isinstance(settings, BadRow):
        return settings
    _, sid = _pick(row, "id")
    return Sample(line, str(sid) if sid is not None else str(line), prompt, response, logprobs, experts,
                  None if experts is None else routed, *settings)


# A row's own sampling settings (vLLM's `SamplingParams` names), read at the row's top level or inside a
# `sampling_params` object: row field -> (case field, rule, check)
ROW_SAMPLING = {
    "temperature": ("temperature", "a number > 0 (0, greedy, has no temperature to divide by: record 1 for "
                                   "the raw distribution's log-probs)", lambda v: v > 0),
    "top_p": ("top_p", "a number in (0, 1]", lambda v: 0 < v <= 1),
    "top_k": ("sample_top_k", "an integer >= 0, or -1 (off, as vLLM writes it)", lambda v: v == int(v) and v >= -1),
    "min_p": ("min_p", "a number in [0, 1]", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("repetition_penalty", "a number > 0 (1: off)", lambda v: v > 0),
    "presence_penalty": ("presence_penalty", "a number in [-2, 2] (0: off)",
                         lambda v: PENALTY_BOUNDS[0] <= v <= PENALTY_BOUNDS[1]),
    "frequency_penalty": ("frequency_penalty", "a number in [-2, 2] (0: off)",
                          lambda v: PENALTY_BOUNDS[0] <= v <= PENALTY_BOUNDS[1]),
}


# sampling settings an engine may record that the scorer does not apply (vLLM's SamplingParams names): a row
# holding one away from its default is noted, since its log-probs then differ from the trainer's by it
UNAPPLIED = {"logit_bias": None, "typical_p": 1.0, "min_tokens": 0, "bad_words": None, "allowed_token_ids": None,
             "top_a": 0.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "tfs": 1.0, "mirostat_mode": 0,
             "length_penalty": 1.0}
RAW_MODES = ("raw_logprobs", "raw_logits")  # vLLM's logprobs_mode values of the unprocessed distribution
NEUTRAL_SAMPLING = {k: NEUTRAL[k] for k in SAMPLING_AXES}  # case fields: the unprocessed distribution
ROW_NAME = {case_field: name for name, (case_field, _, _) in ROW_SAMPLING.items()}  # case field -> row / csv name


def row_sampling(line: int, row: dict) -> tuple[dict, list[str], bool] | BadRow:
    """(the row's sampling settings as case fields; the settings it records that the scorer does not
    apply or cannot read, each as "name" or "name (did you mean X?)"; whether it says its log-probs are
    the raw distribution's: `logprobs_mode` raw_logprobs / raw_logits), or what is wrong (a setting
    out of range, or one given twice, at the top level and in `sampling_params`, with two values)."""
    import difflib

    sub = row.get("sampling_params")
    if sub is not None and not isinstance(sub, dict):
        return BadRow(line, "sampling_params", "must be an object of sampling settings (temperature, top_p, top_k, "
                                               "min_p, as vLLM's SamplingParams names them)")
    got, where_of, odd = {}, {}, []
    for where, src in (("", row), ("sampling_params.", sub or {})):
        for name, (case_field, rule, ok) in ROW_SAMPLING.items():
            if name not in src or src[name] is None:
                continue
            v = src[name]
            if not finite_number(v) or not ok(v):
                return BadRow(line, where + name, f"is {_short(v)}: the engine's sampling setting must be {rule}")
            v = max(int(v), 0) if name == "top_k" else float(v)
            if case_field in got and got[case_field] != v:
                return BadRow(line, where + name, f"is {_short(src[name])}, and {where_of[case_field]}{name} is "
                                                  f"{_short(got[case_field])}: record the setting once (or the same "
                                                  "value in both places)")
            got[case_field], where_of[case_field] = v, where
        for key, value in src.items():
            if key in ROW_SAMPLING or not isinstance(key, str):
                continue
            if key in UNAPPLIED:
                if value is not None and value != UNAPPLIED[key] and value not in ({}, []):
                    odd.append(where + key)
                continue
            close = difflib.get_close_matches(key, list(ROW_SAMPLING), n=1, cutoff=0.85)
            if close:
                odd.append(f"{where}{key} (did you mean {close[0]}?)")
            elif where and key not in SAMPLING_PARAMS_READ_NOTHING:
                odd.append(where + key)
    mode = row.get("logprobs_mode", (sub or {}).get("logprobs_mode"))
    return got, odd, isinstance(mode, str) and mode in RAW_MODES


# `sampling_params` entries that do not change the distribution a token is drawn from (lengths, stops,
# what is returned, the draw's seed): not noted
SAMPLING_PARAMS_READ_NOTHING = frozenset({
    "n", "best_of", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "seed",
    "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "detokenize",
    "output_kind", "truncate_prompt_tokens", "logprobs_mode", "guided_decoding", "structured_outputs",
    "extra_args", "use_beam_search", "flat_logprobs"})


def padding_hint(prompt: list[int], response: list[int], logprobs: list[float], pads: set[int],
                 pad: Any = ...) -> str | None:
    """What makes a row look like one of a verl batch that was not unpadded, or None: a prompt that
    starts with a run (>= 2) of a pad id (`pads`: the config's pad_token_id, and the ids found padding
    responses), or a response that ends with a run (>= 2) of one id whose recorded log-probs are all
    exactly 0.0, or all exactly -1 (what verl pads rollout_log_probs with). A single certain last
    token (log-prob 0.0), or a repeated one with real log-probs, is not flagged. `pad`: the response's
    `_response_pad`, when already computed."""
    parts = []
    m = next((i for i, t in enumerate(prompt) if t != prompt[0]), len(prompt))
    if m >= 2 and prompt[0] in pads:
        parts.append(f"the prompt starts with {m} copies of token {prompt[0]}")
    pad = _response_pad(response, logprobs) if pad is ... else pad
    if pad is not None:
        parts.append(f"the response ends with {pad[1]} copies of token {pad[0]} recorded at log-prob {pad[2]!r}")
    return "; ".join(parts) or None


def _trainer_agrees(sc: Any, run: tuple[int, int, float] | None) -> bool:
    """A response's trailing run recorded at log-prob 0.0 that the trainer also finds near certain
    (every one of its tokens above probability 1/2): a confident model repeating a token (a bf16
    engine rounds such log-probs to 0.0), not padding, which the trainer gives a low probability."""
    if run is None or run[2] != 0.0:
        return False
    div = getattr(sc.evaluation, "divergence", None)
    lt = (getattr(div, "per_token", None) or {}).get("logp_trainer")
    n = run[1]
    if lt is None or len(lt) < n or len(lt) != len(sc.sample.response):  # (a response cut short: not known)
        return False
    import numpy as np

    return bool((np.asarray(lt[-n:], dtype=np.float64) > -math.log(2)).all())


def _response_pad(response: list[int], logprobs: list[float]) -> tuple[int, int, float] | None:
    """(id, run length, log-prob) of a response's trailing run (>= 2) of one id recorded at exactly one
    of PAD_LOGPROBS (an EOS the pad id repeats, recorded at its own log-prob, is not counted)."""
    if len(response) < 2 or logprobs[-1] not in PAD_LOGPROBS:
        return None
    tail, value, n = response[-1], logprobs[-1], 0
    while n < len(response) and response[-1 - n] == tail and logprobs[-1 - n] == value:
        n += 1
    return (tail, n, float(value)) if n >= 2 else None


# ---------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------
# mean nats per token by which the trainer finds the recorded tokens less likely than the rollout
# recorded them, above which the samples look like another model's (precision moves it by ~0.01-0.1)
WRONG_MODEL_GAP = 2.0
SHARPER = 0.05  # mean nats per token the rollout gives its own tokens above the trainer, for the sampling note
EXPERT_FLIP_NOTE = 0.1  # recorded vs trainer expert sets differing (not at a tie) on more tokens than this


def resolve_scorer(model: str | None, pair_name: str | None, replay: bool) -> tuple[Any, Any, dict]:
    """(pair, HFModel, extra case params) for --model PATH or --pair NAME."""
    if (model is None) == (pair_name is None):
        raise UsageError("harness score needs exactly one trainer: --model PATH (a local checkpoint directory) or "
                         "--pair NAME (a registered Hugging Face pair, e.g. hf.qwen3_moe.aligned).")
    try:
        import targets.hf.pairs as hfp
    except ImportError:  # pragma: no cover - targets ships with the harness
        raise UsageError("harness score needs the Hugging Face backend (targets/hf).") from None
    from targets.hf import AVAILABLE

    if not AVAILABLE:
        raise UsageError("harness score needs transformers, which is not installed: pip install -e '.[hf]' "
                         "(transformers, and pyarrow for Parquet files).")
    from .pairs import REGISTRY

    if model is not None:
        from targets.hf.backend import HFModel

        spec = HFModel.from_pretrained(model)
        check_weights(spec)
        if replay and not spec.moe():
            raise UsageError(f"--replay: the model at {model} has no experts (a dense model), so there is no routing "
                             "to replay; leave --replay out.")
        pair = REGISTRY.get("hf.recorded.replay" if replay else "hf.recorded")
        return pair, spec, {"rec_model": spec.path, "rec_model_id": spec.fingerprint()}
    pair = REGISTRY.get(pair_name)
    prof = getattr(pair, "profiles", None)
    if getattr(pair, "cannot_run", None):  # an HF pair whose checkpoint folder is not there
        raise UsageError(f"pair {pair_name!r} cannot score here: {pair.cannot_run}")
    if not isinstance(prof, hfp.HFProfiles) or prof.model is None:
        raise UsageError(f"pair {pair_name!r} cannot score recorded rollouts: only Hugging Face pairs (hf.*, or made "
                         "with targets.hf.hf_pair) take token ids; pass --model PATH or one of those.")
    if replay and not prof.replay:
        variant = f"{pair_name}.replay" if REGISTRY.get_loaded(f"{pair_name}.replay") is not None else None
        raise UsageError(f"--replay: pair {pair_name!r} does not replay routing; "
                         + (f"score with its replay variant, --pair {variant}" if variant else
                            "register one that does (`hf_pair(name, model, ..., replay=True)`; `hf_pairs` registers "
                            "`<prefix>.bf16_rollout.replay`), or score with `--model CHECKPOINT --replay`")
                         + ", or leave --replay out.")
    check_weights(prof.model)  # (a pair made with a checkpoint folder)
    return pair, prof.model, {}


def check_weights(spec: Any) -> None:
    """A checkpoint folder with a config.json but no weight file: one UsageError before anything is
    scored (transformers would raise the same OSError for every sample)."""
    root = Path(getattr(spec, "path", "") or "")
    if not getattr(spec, "path", "") or not root.is_dir() or any(next(root.glob(g), None) for g in WEIGHT_FILES):
        return
    held = sorted(q.name for q in root.iterdir())
    raise UsageError(f"the checkpoint folder {str(root)!r} has a config.json but no weights (no *.safetensors or "
                     f"pytorch_model*.bin file; it holds {', '.join(held[:6])}{', ...' if len(held) > 6 else ''}), so "
                     "there is no trained model to score with and nothing was scored: copy the weight files that "
                     "`model.save_pretrained(...)` wrote next to its config.json, or pass the folder that holds them.")


def ratio_outliers(ev: Any) -> tuple[int, float, int] | None:
    """(tokens whose |log-prob difference| trainer vs recording exceeds log 2, the largest difference,
    the response token it is at), or None when there are none (or no per-token values)."""
    import numpy as np

    pt = getattr(getattr(ev, "divergence", None), "per_token", None) or {}
    lt, lr = pt.get("logp_trainer"), pt.get("logp_rollout")
    if lt is None or lr is None or not len(lt):
        return None
    with np.errstate(invalid="ignore"):
        d = np.abs(np.asarray(lt, dtype=np.float64) - np.asarray(lr, dtype=np.float64))
    d = np.where(np.isnan(d), 0.0, d)  # (log 0 on both sides: no ratio to act on; inf: log 0 on one side)
    n = int((d > math.log(2)).sum())
    return (n, float(d.max()), int(np.argmax(d))) if n else None


def worst_token(ev: Any) -> int | None:
    """The response token (0-based) a flagged sample's verdict reads most of (`metrics.per_token_judged`:
    the larger of its expected k3 and exact KL, a drawn token at probability 0 first). Alone, it is
    over the line whenever the sample's mean is; None without per-token values."""
    import numpy as np

    from .metrics import per_token_judged

    got = per_token_judged(getattr(ev, "divergence", None))
    if got is None:
        return None
    row, drawn_inf = got
    return int(np.argmax(np.where(drawn_inf, np.inf, np.where(np.isnan(row), -np.inf, row))))


def sample_case(s: Sample, extra: dict, sampling: dict, limit: int | None = None) -> tuple[Any, bool]:
    """The case carrying a recorded sample (response cut to `limit` total tokens when given, keeping at
    least one response token: a prompt is never cut)."""
    from targets.hf.paths import encode_recorded

    from .case import Case

    response, logprobs, experts = s.response, s.logprobs, s.experts
    cut = False
    if limit is not None and len(s.prompt) + len(response) > limit:
        keep = max(1, limit - len(s.prompt))
        response, logprobs, cut = response[:keep], logprobs[:keep], True
        if experts is not None:
            experts = experts[:len(s.prompt) + keep]
    params = {**encode_recorded([{"prompt_ids": s.prompt, "response_ids": response, "rollout_logprobs": logprobs,
                                  "routed_experts": experts, "routed_layers": s.expert_layers}]), **extra}
    return Case(seed=0, seq_lens=(len(response),), prompt_lens=(len(s.prompt),), params=params,
                **{**sampling, **s.sampling}), cut


def batch_metrics(scored: list[Scored]) -> dict[str, float]:
    """Batch metrics under verl's rollout-correction names, with its weighting: token means over every
    scored token of the batch (`k3_kl`, `kl`, `chi2_token`, `pearson`: a long sample weighs more;
    `flip_rate` and `tie_flip_rate`: over every routed position of the batch, prompts included, as each
    sample's own),
    sequence means (`log_ppl_diff`, `ppl_ratio`: each sample's own mean first), maxima over tokens
    (`max_abs_dlogp`, `probs_diff_max`) and over samples (`k3_seq_max`)."""
    import numpy as np

    if not scored:
        return {}
    with np.errstate(all="ignore"):  # (a recorded log-prob of -1e30, a probability 0: inf metrics, no warning)
        return _batch_metrics(scored, np)


def _batch_metrics(scored: list[Scored], np: Any) -> dict[str, float]:
    from .metrics import k3_of

    lt = np.concatenate([np.asarray(s.evaluation.divergence.per_token["logp_trainer"], dtype=np.float64)
                         for s in scored])
    lr = np.concatenate([np.asarray(s.evaluation.divergence.per_token["logp_rollout"], dtype=np.float64)
                         for s in scored])
    d = lt - lr
    k3 = k3_of(d)  # (its Taylor series for a small log-ratio: expm1(d) - d loses digits there)
    kl = np.concatenate([np.asarray(s.evaluation.divergence.per_token["kl"], dtype=np.float64) for s in scored])
    per_seq = [float(np.mean(np.asarray(s.evaluation.divergence.per_token["logp_trainer"]) -
                             np.asarray(s.evaluation.divergence.per_token["logp_rollout"]))) for s in scored]
    pt, pr = np.exp(lt), np.exp(lr)
    pearson = float(np.corrcoef(pt, pr)[0, 1]) if len(pt) > 1 and pt.std() > 0 and pr.std() > 0 else float("nan")
    # expert flips over every routed position (prompt and response, each layer), as each sample's own rate
    layers = [v for s in scored for v in (getattr(s.evaluation.divergence, "flips_per_layer", None) or {}).values()]
    flips, ties = sum(v["flips"] for v in layers), sum(v["tie_flips"] for v in layers)
    routed = sum(v["tokens"] for v in layers)
    recorded = any(s.sample.experts for s in scored)
    return {
        "k3_kl": float(k3.mean()),
        "k3_seq_max": float(max(s.metrics["k3_kl"] for s in scored)),
        "kl": float(kl.mean()),  # the exact KL per position, averaged over every position
        "log_ppl_diff": float(np.mean(per_seq)),
        "ppl_ratio": float(np.mean(np.exp(per_seq))),
        "chi2_token": float(np.exp(2 * d).mean() - 1),
        "max_abs_dlogp": float(np.abs(d).max()),
        "probs_diff_max": float(np.abs(pt - pr).max()),
        "pearson": pearson,
        # (no sample recorded its experts: nothing to compare the trainer's routing with)
        # (away from exact ties, as each sample's `flip_rate`; those at a tie in `tie_flip_rate`)
        "flip_rate": (flips / routed if routed else 0.0) if recorded else math.nan,
        "tie_flip_rate": (ties / routed if routed else 0.0) if recorded else math.nan,
        "samples": float(len(scored)),
        "tokens": float(len(d)),
    }


FLIP_RATES = ("flip_rate", "tie_flip_rate")  # per sample: empty in samples.csv when it recorded no experts
PER_SAMPLE = ("k3_kl", "kl", "log_ppl_diff", "ppl_ratio", "chi2_token", "max_abs_dlogp", "probs_diff_max",
              "flip_rate", "tie_flip_rate", "n_tokens")


def score(path: Path, *, model: str | None = None, pair_name: str | None = None, replay: bool = False,
          threshold: float = 1e-3, device: str = "cpu", corpus: Path = Path("corpora"), out_dir: Path | None = None,
          max_repros: int = 3, sampling: dict | None = None, tracker: Any = None, progress: bool = True,
          log: Any = None, logprobs_mode: str = "processed", row_settings: bool = True) -> ScoreResult:
    """`logprobs_mode`: "processed" (the log-probs are of the distribution the engine sampled from:
    scored with the command's sampling settings, or a row's own) or "raw" (of the unprocessed one,
    vLLM's default: every sample scored at temperature 1 without cut or penalty; a row whose own
    `logprobs_mode` says raw is scored so too). `row_settings`: read a row's own sampling settings
    (False: the command's for every row, noted where a row records others)."""
    from .execute import run_case
    from .metrics import verdict_mean

    log = log or (lambda m: click.echo(m, err=True))
    t0 = time.monotonic()
    pair, spec, extra = resolve_scorer(model, pair_name, replay)
    sampling = dict(sampling or {})
    vocab, moe = spec.vocab, spec.moe()
    routers: list = []

    def moe_layers() -> tuple[int, ...]:
        """The decoder layers whose router the model has (a dense first layer has none), from the model the
        trainer runs (built once per process: the first sample builds it anyway)."""
        if not routers:
            from targets.hf.backend import base_model, router_modules

            routers.append(tuple(int(name.split(".")[1]) for name, _ in router_modules(base_model(spec))))
        return routers[0]

    try:  # (a model's position table: a longer sample is a bad row, not scored past it)
        fields = spec.fields()
        positions = position_limit(fields)
        pad_id = fields.get("pad_token_id")
    except (OSError, ValueError, TypeError, AttributeError):
        positions, pad_id = None, None
    total, rows = read_rows(path)
    res = ScoreResult(out_dir=out_dir)
    if tracker is not None:
        cfg = SimpleNamespace(threshold=threshold, device=device, max_examples=None, budget=None, profile="score",
                              shard=None, run_name=f"score {Path(path).name} with {pair.name}")
        tracker.campaign_started(cfg, 0, [pair])

    def scored() -> None:
        def one(item: tuple[int, Any]) -> None:
            line, row = item
            s = row if isinstance(row, BadRow) else parse_sample(line, row, vocab, moe, positions, moe_layers)
            if isinstance(s, BadRow):
                res.bad.append(s)
                return
            if logprobs_mode == "raw" or s.raw_mode:  # the unprocessed distribution: nothing applied
                s.sampling = dict(NEUTRAL_SAMPLING)
            elif not row_settings and s.sampling:
                res.ignored_rows += 1
                s.sampling = {}
            case, _ = sample_case(s, extra, sampling)
            ev = run_case(pair, case, device, threshold)
            if ev.divergence is None:
                err = (ev.error or {}).get("message", ev.symptom.value)
                if getattr(ev, "setup", False) and not res.scored:  # the trainer itself cannot run (a checkpoint
                    # transformers cannot load, a pair's setting): once, not once per line
                    raise UsageError(f"{err.rstrip('. ')}. (Raised scoring line {line}, the first sample the trainer "
                                     "ran: no sample was scored.)")
                res.bad.append(BadRow(line, "(scoring)", f"the trainer failed on this sample: {err}"))
                return
            metrics = {k: v for k, v in ev.divergence.as_dict().items() if k in PER_SAMPLE}
            res.scored.append(Scored(s, metrics, ev, case))

        stopped = False
        try:
            if progress and total >= PROGRESS_FROM and _interactive():
                with click.progressbar(rows, length=total, label=f"scoring {path.name}", file=sys.stderr) as bar:
                    for item in bar:
                        one(item)
            elif progress and not _interactive():  # a job's log: a plain line every PROGRESS_EVERY seconds
                last = first = time.monotonic()
                for n, item in enumerate(rows, 1):
                    one(item)
                    now = time.monotonic()
                    first = now if n == 1 else first  # (the rate from the second row on: the first loads the model)
                    if now - last >= PROGRESS_EVERY:
                        last = now
                        log(f"scoring {path.name}: {n}/{total} rows ({min(100, 100 * n // max(total, 1))}%), "
                            f"{len(res.scored)} scored, {len(res.bad)} bad, {now - t0:.0f} s"
                            + (f", about {(now - first) / (n - 1) * (total - n):.0f} s left" if 1 < n < total else ""))
            else:
                for item in rows:
                    one(item)
        except KeyboardInterrupt:  # Ctrl-C / SIGTERM: what was scored so far is written, then the interrupt goes on
            if not res.scored:
                raise
            stopped = True
            if out_dir is not None:
                log(f"interrupted: the {len(res.scored)} sample(s) scored so far go to {out_dir}/ (samples.csv, "
                    "summary.json); no repro is written")
            res.notes.append(f"interrupted after {len(res.scored)} scored sample(s) ({len(res.scored) + len(res.bad)} of "
                             f"{total} row(s) read): the outputs hold those; no repro was written")
        if not res.scored:
            why = "; ".join(str(b) for b in res.bad[:5]) or "the file holds no samples"
            if len(res.bad) > 5:
                why += f"; and {len(res.bad) - 5} more bad row(s)"
            oov = sum(OUT_OF_VOCAB in str(b) for b in res.bad)
            if oov == len(res.bad) and oov:
                why += (f". Every row has token ids past this model's vocabulary of {vocab}: were these samples "
                        "generated by another model (a larger vocabulary)? Check --model")
            raise UsageError(f"no sample of {str(path)!r} could be scored: {why}.")
        res.batch = batch_metrics(res.scored)
        # rows of a verl batch that was not unpadded: scored as they are, named once
        pads = {pad_id} if isinstance(pad_id, int) and not isinstance(pad_id, bool) else set()
        runs = [None if _trainer_agrees(sc, run) else run
                for sc, run in ((sc, _response_pad(sc.sample.response, sc.sample.logprobs)) for sc in res.scored)]
        pads |= {p[0] for p in runs if p}
        padded = [(sc.sample.line, h) for sc, run in zip(res.scored, runs)
                  if (h := padding_hint(sc.sample.prompt, sc.sample.response, sc.sample.logprobs, pads, run))]
        if padded:
            res.notes.append(
                f"warning: {len(padded)} line(s) look like rows of a verl batch that was not unpadded ("
                + "; ".join(f"line {n}: {h}" for n, h in padded[:4]) + ("; ..." if len(padded) > 4 else "")
                + "). They were scored as they are, padding included, which makes their metrics meaningless (a pad "
                  "token the engine never sampled is one the trainer gives a low probability). Unpad verl batches "
                  "before writing them: prompts[i][attention_mask[i, :P] == 1], responses[i][response_mask[i] == 1], "
                  "rollout_log_probs[i][response_mask[i] == 1] (and routed_experts to prompt + response).")
        gap = -res.batch.get("log_ppl_diff", 0.0)  # mean over samples of mean(logp_rollout - logp_trainer)
        if not math.isfinite(gap):  # tokens the trainer gives probability 0 (a cut the engine did not make)
            gap, cut = _finite_gap(res.scored)
            if cut:
                res.notes.append(
                    f"{cut} recorded token(s) in {sum(1 for sc in res.scored if _cut_tokens(sc))} sample(s) are "
                    "tokens the trainer gives probability 0 (k3 inf): it cuts tokens the engine kept. Check "
                    "--temperature, --top-p, --top-k and --min-p against the engine's settings (a trainer scoring at "
                    "other ones cuts other tokens); the notes below that compare the two paths read the other tokens.")
        replays = replay or bool(getattr(getattr(pair, "profiles", None), "replay", False))
        forced = replays and any(s.sample.experts for s in res.scored)
        if not padded and gap > WRONG_MODEL_GAP:
            res.notes.append(
                f"warning: the trainer gives the recorded tokens a log-probability {gap:.1f} nats lower per token than "
                f"the rollout recorded, on average over the {len(res.scored)} sample(s) (a perplexity {math.exp(min(gap, 700)):.3g}x "
                "higher). Precision differences move it by hundredths of a nat; this is the size of another model "
                "or another tokenizer: check that " + ("--model" if model or not pair_name else
                                                        f"the model of --pair {pair_name}")
                + " is the policy (and vocabulary) that generated these samples, at the weights it had then (the "
                "repros written below are of that mismatch, not regressions of the pair, until it is ruled out)."
                + (" Or the recorded experts: router replay forced them into the trainer, and experts recorded "
                   "wrong (ids offset, another layer order) put every token through other experts; score without "
                   "--replay, which says how often they differ from the trainer's own routing." if forced else ""))
        neutral = all(_neutral({**sampling, **sc.sample.sampling}) for sc in res.scored)
        raw_rows = [sc for sc in res.scored if sc.sample.raw_mode]
        if logprobs_mode == "raw":
            res.notes.append("sampling: --logprobs raw: every sample was scored at temperature 1 without top-k, top-p, "
                             "min-p or penalties (the unprocessed distribution the engine reports in that mode); a "
                             "bug in the engine's sampler does not show in such log-probs")
        elif raw_rows:
            res.notes.append(f"sampling: {len(raw_rows)} sample(s) say logprobs_mode raw_logprobs / raw_logits: "
                             "scored at the unprocessed distribution (temperature 1, no cut or penalty), whatever "
                             "sampling settings they record")
        if res.ignored_rows:
            res.notes.append(f"sampling: {res.ignored_rows} row(s) record their own sampling settings, not read "
                             "(--ignore-row-sampling): scored with the command's")
        odd: dict[str, list[int]] = {}
        for sc in res.scored:
            for name in sc.sample.unapplied:
                odd.setdefault(name, []).append(sc.sample.line)
        if odd:
            res.notes.append(
                "sampling: settings recorded that the scorer does not apply or read: "
                + "; ".join(f"{k} on {len(v)} sample(s) (line {', '.join(map(str, v[:3]))}"
                            f"{', ...' if len(v) > 3 else ''})" for k, v in odd.items())
                + ". Where one changed the distribution the engine sampled from, its samples' log-probs differ "
                  "from the trainer's by it: score them apart, or without it in the engine")
        own = [sc for sc in res.scored if sc.sample.sampling and not (logprobs_mode == "raw" or sc.sample.raw_mode)]
        if own:
            res.notes.append(
                f"sampling: {len(own)} of {len(res.scored)} sample(s) record their own sampling settings ("
                + ", ".join(f"{row_name} on {sum(k in sc.sample.sampling for sc in own)}"
                            for row_name, (k, _, _) in ROW_SAMPLING.items()
                            if any(k in sc.sample.sampling for sc in own))
                + "); each was scored with its own, over the command's")
        penalised = [sc for sc in res.scored if sc.case.penalties]
        if penalised:
            names = sorted({k for sc in penalised for k in sc.case.penalties})
            res.notes.append(
                f"sampling: {len(penalised)} sample(s) were scored with penalties ({', '.join(names)}), applied as vLLM "
                "applies them (repetition over the prompt and the response so far, presence and frequency over the "
                "response so far, before the temperature): that checks the engine's log-probs of its penalised "
                "distribution. An RL trainer that applies no penalty reads those samples off-policy by the penalty "
                "itself; score them without it to see by how much.")
        raw = _raw_logprobs_check(pair, res, sampling, device, threshold) if not padded else None
        if raw is not None:
            res.notes.append(raw)
        shifted = _shift_check(res, threshold) if not padded else None
        if shifted is not None:
            res.notes.append(shifted)
        certain = [sc for sc in res.scored if sc.evaluation.failed and len(sc.sample.logprobs) >= 2
                   and all(v == 0.0 for v in sc.sample.logprobs)]
        if certain:
            res.notes.append(
                f"sampling: {len(certain)} flagged sample(s) record every log-prob as exactly 0.0 (line "
                + ", ".join(str(sc.sample.line) for sc in certain[:4]) + (", ..." if len(certain) > 4 else "")
                + "): probability 1 on each token, what greedy decoding reports. Score greedy samples with --top-k 1; "
                  "where the engine was not asked for greedy decoding, check how it reads 'off' (a top_k of -1 or 0 "
                  "taken as 1)")
        sharper = [sc for sc in res.scored if sc.evaluation.failed and sc.metrics.get("log_ppl_diff", 0.0) < 0]
        if not padded and neutral and SHARPER < gap <= WRONG_MODEL_GAP and len(sharper) >= 0.9 * len(res.scored) >= 1:
            res.notes.append(
                f"sampling: {len(sharper)} of {len(res.scored)} sample(s) are over the line with the rollout giving its "
                f"own tokens more probability than the trainer does ({gap:.2f} nats per token on average), and the "
                "trainer scored with temperature 1, top-p 1 and no top-k or min-p (the defaults). If the engine sampled "
                "with other settings, pass them (--temperature, --top-p, --top-k, --min-p): a rollout sharper than "
                "the trainer on "
                "every sample is what a temperature below 1 left out looks like, or one the engine applied after "
                "the log-softmax.")
        lines_of: dict[str, list[int]] = {}
        for sc in res.scored:
            lines_of.setdefault(str(sc.sample.id), []).append(sc.sample.line)
        dup = {k: v for k, v in lines_of.items() if len(v) > 1}
        if dup:  # (each is scored as its own sample, and each counts in the batch's means)
            res.notes.append(f"sample ids repeated: {len(dup)} id(s) on more than one line ("
                             + ", ".join(f"{k!r} at lines {', '.join(map(str, v[:4]))}" for k, v in list(dup.items())[:4])
                             + "); each line was scored as its own sample and counts in the batch metrics: drop the "
                               "duplicates if one recording was written twice")
        # flagged: the case's own verdict (mean k3 of the recorded tokens, or the coarsened KL, a lower
        # bound of the exact KL, above the threshold), so every flagged sample's repro fails as it did
        res.flagged = sorted((s for s in res.scored if s.evaluation.failed),
                             key=lambda s: -verdict_mean(s.evaluation.divergence)[1])
        masked = [(s.sample.line, *m) for s in res.scored if not s.evaluation.failed
                  and (m := ratio_outliers(s.evaluation)) is not None]
        if masked:  # (a long sample's mean hides one token far off: what RL's token-level correction acts on)
            res.notes.append(
                f"{len(masked)} sample(s) under the line hold tokens whose trainer/rollout probability ratio is "
                f"outside [1/2, 2] (|log-prob difference| > log 2, where a rollout-correction token mask or "
                "truncated importance weight acts; one such token among hundreds leaves the mean k3 under the "
                "line): " + "; ".join(f"line {n}: {k} token(s), the largest difference {d:.3g} at response token {t}"
                                      for n, k, d, t in masked[:4]) + ("; ..." if len(masked) > 4 else ""))
        if replays and not forced:
            res.notes.append("router replay: no scored sample records routed experts (routed_experts / "
                             "rollout_routed_experts), so nothing was replayed: the trainer routed every token itself")
        if not replays:  # recorded experts the trainer's own router disagrees with, beyond near ties
            # (a flagged sample's flips are part of what it is flagged for: an engine's own routing numerics)
            off = [s for s in res.scored if s.sample.experts and not s.evaluation.failed
                   and s.metrics.get("flip_rate", 0.0) > EXPERT_FLIP_NOTE]
            if off:
                worst = sorted(off, key=lambda s: -s.metrics["flip_rate"])[:5]
                res.notes.append(
                    f"recorded experts: {len(off)} sample(s) under the line record experts that differ from the trainer's "
                    f"own routing on "
                    f"more than {EXPERT_FLIP_NOTE:.0%} of routed tokens away from ties ("
                    + ", ".join(f"line {s.sample.line} {s.metrics['flip_rate']:.2f}" for s in worst)
                    + "). Their log-probs are judged as scored, but router replay (--replay) would force those experts "
                      "into the trainer: check how the engine records them, or score with --replay to see the effect.")
        if out_dir is not None:  # first: what was scored is never lost to a repro that cannot be written
            write_outputs(res, path, threshold)
        if stopped:  # (the campaign run ends KILLED below; the command exits 130)
            raise KeyboardInterrupt
        for s in res.flagged[:max_repros]:
            try:
                p = write_repro(s, pair, extra, sampling, path, threshold, device, corpus, len(res.scored), tracker, res)
            except (UsageError, OSError) as e:
                res.notes.append(f"line {s.sample.line}: its repro could not be written: {e}")
                res.unsaved += 1
                continue
            if p is not None:
                res.repros.append(p)

    try:
        scored()
    except BaseException:  # no sample scored, an interrupt, a crash: the campaign run ends (KILLED), not RUNNING
        if tracker is not None:
            tracker.campaign_finished(SimpleNamespace(findings=[], examples=len(res.scored),
                                                      seconds=time.monotonic() - t0, interrupted=True, results=[]))
        raise
    if out_dir is not None and res.flagged and max_repros:  # again, after the repros: them and their notes
        try:
            write_summary(res, path, threshold)
        except OSError as e:
            log(f"warning: {out_dir / 'summary.json'} could not be rewritten with the repros ({e}); they are "
                "listed above")
    res.seconds = time.monotonic() - t0
    if tracker is not None:
        finish_tracking(tracker, res, threshold)
    return res


def _neutral(sampling: dict) -> bool:
    """Whether these sampling settings (case fields; a missing one is off) are the unprocessed distribution."""
    return all(sampling.get(k, v) == v for k, v in NEUTRAL_SAMPLING.items())


RAW_CHECKS = 6  # flagged samples rescored with the unprocessed distribution (`_raw_logprobs_check`)


def _settings_text(sampling: dict) -> str:
    """A sample's sampling settings away from the unprocessed distribution, as a person reads them."""
    return ", ".join(f"{ROW_NAME[k]} {v:g}" for k, v in sampling.items()
                     if k in NEUTRAL_SAMPLING and v != NEUTRAL_SAMPLING[k]) or "none"


def _raw_logprobs_check(pair: Any, res: ScoreResult, sampling: dict, device: str,
                        threshold: float) -> str | None:
    """A note when flagged samples scored with sampling settings (a temperature, a cut, a penalty)
    are under the line scored without them: the engine reported the log-probs of its raw distribution
    while sampling from the processed one, as vLLM does by default (`logprobs_mode="raw_logprobs"`).
    Up to RAW_CHECKS of them are rescored (the worst first); the note counts those that pass, and says
    where the others fail either way (another cause beside it). None where none passes."""
    from .execute import run_case

    flagged = [sc for sc in res.scored if sc.evaluation.failed and not sc.sample.raw_mode
               and not _neutral({**sampling, **sc.sample.sampling})]
    if not flagged:
        return None
    picked = sorted(flagged, key=lambda sc: -sc.metrics.get("k3_kl", 0.0))[:RAW_CHECKS]
    passed, failed = [], 0
    for sc in picked:
        ev = run_case(pair, sc.case.replace(**NEUTRAL_SAMPLING), device, threshold)
        if ev.divergence is None or ev.failed:
            failed += 1
            continue
        passed.append(f"line {sc.sample.line} ({_settings_text({**sampling, **sc.sample.sampling})}): k3 "
                      f"{sc.metrics.get('k3_kl', math.nan):.3g} -> {ev.divergence.k3_kl:.3g}")
    if not passed:
        return None
    return (f"sampling: recorded log-probs of the raw distribution. {len(passed)} of the {len(picked)} flagged "
            f"sample(s) rescored (of {len(flagged)} flagged with sampling settings) are under the line scored at "
            f"temperature 1 without top-k, top-p, min-p or penalties ({'; '.join(passed[:4])}"
            f"{'; ...' if len(passed) > 4 else ''}): the engine sampled from the processed distribution but reported "
            "the log-probs of the unprocessed one, as vLLM does by default (logprobs_mode='raw_logprobs'). An RL "
            "step's importance ratio then reads those settings as a mismatch: have the engine report the processed "
            "log-probs (vLLM: logprobs_mode='processed_logprobs'), or score such a file with --logprobs raw."
            + (f" The other {failed} rescored fail either way: something else differs there too." if failed else ""))


SHIFT_MIN_TOKENS = 3  # a flagged sample's recorded tokens the shift check needs (two pairs at a shift of one)


def _shift_check(res: ScoreResult, threshold: float) -> str | None:
    """A note when the flagged samples' recorded log-probs agree with the trainer's one token over
    (entry i holds response token i+1's log-prob, or i-1's: a list sliced one off, a prompt token's
    log-prob left in front): the mean k3 of the pairs at that shift under the line on at least 90% of
    them. None when they do not, or too few tokens say."""
    import numpy as np

    from .metrics import k3_of

    flagged = [sc for sc in res.scored if sc.evaluation.failed and len(sc.sample.response) >= SHIFT_MIN_TOKENS]
    if not flagged:
        return None
    hits: dict[int, list[str]] = {1: [], -1: []}
    for sc in flagged:
        pt = getattr(sc.evaluation.divergence, "per_token", None) or {}
        lt, lr = pt.get("logp_trainer"), pt.get("logp_rollout")
        if lt is None or lr is None or len(lt) < SHIFT_MIN_TOKENS:
            continue
        lt, lr = np.asarray(lt, dtype=np.float64), np.asarray(lr, dtype=np.float64)
        for shift in (1, -1):  # recorded entry i against the trainer's token i + shift
            a, b = (lr[:-1], lt[1:]) if shift == 1 else (lr[1:], lt[:-1])
            with np.errstate(all="ignore"):
                k3 = float(np.mean(k3_of(b - a)))
            if k3 <= threshold:
                hits[shift].append(f"line {sc.sample.line}: k3 {sc.metrics.get('k3_kl', math.nan):.3g} -> {k3:.3g}")
    shift = max(hits, key=lambda k: len(hits[k]))
    if len(hits[shift]) < max(1, 0.9 * len(flagged)):
        return None
    which = "the next response token's (i + 1)" if shift == 1 else "the previous response token's (i - 1)"
    return (f"log-probs shifted by one token: on {len(hits[shift])} of the {len(flagged)} flagged sample(s) recorded "
            f"entry i agrees with the trainer's log-prob of {which} ({'; '.join(hits[shift][:3])}"
            f"{'; ...' if len(hits[shift]) > 3 else ''}). The engine's list is sliced one off its tokens (a "
            "logits[:, :-1] / labels[:, 1:] alignment done twice or not at all, a prompt token's log-prob left in "
            "front): check where the log-probs are cut from the engine's output.")


def write_repro(s: Scored, pair: Any, extra: dict, sampling: dict, source: Path, threshold: float, device: str,
                corpus: Path, scored: int, tracker: Any, res: ScoreResult) -> Path | None:
    from .corpus import load_repro, record_finding
    from .execute import run_case
    from .fuzz import Finding

    case, cut = sample_case(s.sample, extra, sampling, MAX_REPRO_TOKENS)
    ev = s.evaluation if not cut else run_case(pair, case, device, threshold)
    scored_from, case_cut_to = None, case.seq_lens[0]
    if not ev.failed:  # only a cut response can pass: the uncut case is the one that was flagged
        # its divergence lies past the tokens a repro carries: the repro scores the worst token alone,
        # the response before it moved into the prompt (the same tokens at the same positions: the
        # trainer is causal, so that token's score is the flagged one, float32 noise of the shorter
        # forward apart), longer than MAX_REPRO_TOKENS as a long prompt is
        worst = worst_token(s.evaluation)
        if worst is not None:
            smp = s.sample
            one = dataclasses.replace(smp, prompt=smp.prompt + smp.response[:worst], response=smp.response[worst:worst + 1],
                                      logprobs=smp.logprobs[worst:worst + 1],
                                      experts=None if smp.experts is None else smp.experts[:len(smp.prompt) + worst + 1])
            case, _ = sample_case(one, extra, sampling)
            ev = run_case(pair, case, device, threshold)
            scored_from = worst
        why = (f"line {s.sample.line}: its {len(s.sample.prompt)} prompt + {len(s.sample.response)} response tokens "
               f"are more than the {MAX_REPRO_TOKENS} a repro carries in full, and its response cut to "
               f"{case_cut_to} token(s) is under the line")
        if not ev.failed:
            res.notes.append(f"{why}{', as is its worst token alone' if worst is not None else ''}; no repro written")
            return None
        res.notes.append(f"{why}: the repro scores its worst token (response token {worst}) alone, the {worst} "
                         "response tokens before it moved into the prompt")
    sig = hashlib.sha256(f"{pair.name}|recorded|{case.key()}".encode()).hexdigest()
    finding = Finding(pair=pair.name, expected=pair.expected, symptom=ev.symptom, signature=sig, case=case,
                      evaluation=ev, examples=scored)
    path = record_finding(finding, corpus, threshold, 0, device)
    repro = load_repro(path)
    if "recorded" not in repro.found:
        repro.found["recorded"] = {"file": str(source), "line": s.sample.line, "sample_id": s.sample.id,
                                   "response_cut_to": case.seq_lens[0] if cut and scored_from is None else None,
                                   # (response tokens moved into the prompt: the repro scores the one after them)
                                   "scored_from": scored_from}
        repro.save(path)
    if tracker is not None:
        tracker.finding(finding)
    return path


def write_outputs(res: ScoreResult, source: Path, threshold: float) -> None:
    import csv

    out = res.out_dir
    out.mkdir(parents=True, exist_ok=True)
    with (out / "samples.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["line", "id", "prompt_tokens", "response_tokens", *PER_SAMPLE, "above_threshold",
                    *ROW_NAME.values()])
        for s in res.scored:  # (with the sampling settings each was scored with: the row's own, or the command's)
            w.writerow([s.sample.line, s.sample.id, len(s.sample.prompt), len(s.sample.response),
                        *["" if k in FLIP_RATES and not s.sample.experts else s.metrics[k] for k in PER_SAMPLE],
                        s.evaluation.failed,  # (no recorded experts: no flip rates, as the console's n/a)
                        *[getattr(s.case, k) for k in ROW_NAME]])
    write_summary(res, source, threshold)
    plot_histogram([s.metrics["k3_kl"] for s in res.scored], threshold, out / "k3_hist.png")


def write_summary(res: ScoreResult, source: Path, threshold: float) -> None:
    from .corpus import encode_float

    out = res.out_dir
    batch = {k: encode_float(v) for k, v in res.batch.items()}
    summary = {"file": str(source), "threshold": encode_float(threshold), "batch": batch,  # (NaN as "nan": strict JSON)
               "flagged": [{"line": s.sample.line, "id": s.sample.id, "k3_kl": encode_float(s.metrics["k3_kl"])}
                           for s in res.flagged],
               "bad_rows": [{"line": b.line, "field": b.field, "message": b.message} for b in res.bad],
               "repros": [str(p) for p in res.repros], "notes": res.notes}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable, allow_nan=False) + "\n")


def _jsonable(x: Any) -> Any:
    return str(x)


def plot_histogram(k3: list[float], threshold: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    vals = np.asarray(k3, dtype=np.float64)
    vals = np.clip(vals[~np.isnan(vals)], 1e-16, 1e6)  # (inf: a recorded token of probability 0)
    if not vals.size:
        vals = np.array([1e-16])
    fig, ax = plt.subplots(figsize=(6, 3.2))
    lo, hi = math.log10(vals.min()), math.log10(max(vals.max(), threshold * 10))
    ax.hist(vals, bins=np.logspace(lo - 0.1, hi + 0.1, 40), color="#4477aa")
    ax.axvline(threshold, color="#cc3311", linestyle="--", label=f"threshold {threshold:g}")
    ax.set_xscale("log")
    ax.set_xlabel("per-sample mean k3 (values < 1e-16 drawn at 1e-16, > 1e6 and inf at 1e6)")
    ax.set_ylabel("samples")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_tracking(tracker: Any, res: ScoreResult, threshold: float) -> None:
    findings = []
    for p in res.repros:
        findings.append(SimpleNamespace(symptom="divergence", path=p))
    tracker.campaign_finished(SimpleNamespace(findings=findings, examples=len(res.scored), seconds=res.seconds,
                                              interrupted=False, results=[]))
    store, run_id = getattr(tracker, "store", None), getattr(tracker, "run_id", None)
    if store is None or not run_id:
        return
    try:  # the score's own figures beside the campaign counters
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        metrics = [Metric(f"score.{k}", float(v), ts, 0) for k, v in res.batch.items() if math.isfinite(float(v))]
        metrics += [Metric("score.flagged", float(len(res.flagged)), ts, 0),
                    Metric("score.bad_rows", float(len(res.bad)), ts, 0)]
        store.client.log_batch(run_id, metrics=metrics)
        if res.out_dir is not None and (res.out_dir / "k3_hist.png").exists():
            store.client.log_artifact(run_id, str(res.out_dir / "k3_hist.png"), "score")
            store.client.log_artifact(run_id, str(res.out_dir / "summary.json"), "score")
    except Exception as e:  # noqa: BLE001 - tracking never fails the score
        click.echo(f"warning: could not log the score metrics to MLflow ({type(e).__name__}: {e}).", err=True)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------
def _interactive() -> bool:
    """Whether stderr is a terminal (a progress bar), or a job's log (plain progress lines)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # (a replaced or closed stream)
        return False


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def default_out_name(file: Path, model: str | None, pair: str | None, replay: bool, threshold: float,
                     temperature: float, top_p: float, top_k: int, min_p: float = 0.0,
                     penalties: tuple[float, float, float] = (1.0, 0.0, 0.0),
                     reading: tuple[str, bool] = ("processed", False)) -> str:
    """`<file name>[.replay]-<8 hex>`: the hex of the file's absolute path and the scoring settings, so
    that a rescore with other settings (or another file of that name) never overwrites the first."""
    settings = [str(file.resolve()), model and str(Path(model).resolve()), pair, replay, threshold,
                temperature, top_p, top_k]
    if min_p or tuple(penalties) != (1.0, 0.0, 0.0):  # (added later: a folder scored without them keeps its name)
        settings.append(min_p)
    if tuple(penalties) != (1.0, 0.0, 0.0) or tuple(reading) != ("processed", False):
        settings.append(list(penalties))
    if tuple(reading) != ("processed", False):
        settings.append(list(reading))
    key = json.dumps(settings)
    return f"{file.name}{'.replay' if replay else ''}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"


def _not_greedy(ctx: Any, param: Any, value: float) -> float:
    """--temperature 0, as vLLM and verl record greedy decoding, says which log-probs to score."""
    if not value >= 0 or value == math.inf:  # (the type is a plain float: its help would say [x>=0], and 0 is refused here)
        raise click.BadParameter(f"{value!r}: a temperature is a finite number > 0 (1 = the distribution as it is).")
    if value == 0:
        raise click.BadParameter(
            "0 is greedy decoding, which has no temperature to divide by. Score what the engine reported: the "
            "log-probs of the unprocessed distribution (vLLM's default for greedy requests) with --temperature 1, "
            "or those of the greedy choice itself (probability 1 on the argmax) with --top-k 1.")
    return value


@click.command("score")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--model", default=None, metavar="PATH", help="Score with this local checkpoint directory (float32).")
@click.option("--pair", "pair_name", default=None, metavar="NAME", help="Score with this registered HF pair's trainer.")
@click.option("--replay", is_flag=True, help="Replay the recorded experts in the trainer (router replay).")
@click.option("--threshold", type=FiniteFloat(0, min_open=True), default=1e-3, show_default=True,
              help="A sample is flagged when the mean k3 of its tokens (or the two-outcome KL) is above this.")
@click.option("--temperature", type=float, default=1.0, show_default=True, callback=_not_greedy,
              help="Sampling temperature the rollout used, > 0 (its log-probs are of the processed distribution).")
@click.option("--top-p", type=FiniteFloat(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(-1), default=0, show_default=True,
              help="Sampling top-k (0 or -1 = off, as vLLM writes it).")
@click.option("--min-p", type=FiniteFloat(0, 1), default=0.0, show_default=True,
              help="Sampling min-p (0 = off): tokens below min-p x the top token's probability were cut.")
@click.option("--repetition-penalty", type=FiniteFloat(0, min_open=True), default=1.0, show_default=True,
              help="The engine's repetition penalty (1 = off), over the prompt and the response so far.")
@click.option("--presence-penalty", type=FiniteFloat(-2, 2), default=0.0, show_default=True,
              help="The engine's presence penalty (0 = off), over the response so far.")
@click.option("--frequency-penalty", type=FiniteFloat(-2, 2), default=0.0, show_default=True,
              help="The engine's frequency penalty (0 = off), over the response so far.")
@click.option("--logprobs", "logprobs_mode", type=click.Choice(["processed", "raw"]), default="processed",
              show_default=True, help="What the engine's log-probs are of: the distribution it sampled from "
                                      "(processed: scored with the sampling settings), or the unprocessed one "
                                      "(raw, vLLM's default logprobs_mode: scored at temperature 1, no cut or penalty).")
@click.option("--ignore-row-sampling", is_flag=True,
              help="Score every row with the command's sampling settings, not the ones a row records.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--corpus", "corpus_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("corpora"),
              show_default=True, help="Where the worst samples are written as repros.")
@click.option("--max-repros", type=click.IntRange(0), default=3, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for samples.csv, summary.json and k3_hist.png (default reports/score/<file name>-<hex>, "
                   "<file name>.replay-<hex> with --replay; <hex>: of the file's path and the scoring settings).")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or the "
                                                   "embedded store).")
@click.option("--no-tracking", is_flag=True, help="Do not log a campaign run to MLflow.")
@click.option("--plugin", "plugins", multiple=True, metavar="FILE.py|MODULE",
              help="Load target pairs from a Python file or an importable module (repeatable).")
def score_command(file: Path, model: str | None, pair_name: str | None, replay: bool, threshold: float,
                  temperature: float, top_p: float, top_k: int, min_p: float, repetition_penalty: float,
                  presence_penalty: float, frequency_penalty: float, logprobs_mode: str, ignore_row_sampling: bool,
                  device: str, corpus_dir: Path, max_repros: int,
                  out_dir: Path | None, tracking_uri: str | None, no_tracking: bool, plugins: tuple[str, ...]) -> None:
    """Score recorded rollouts (JSONL or Parquet) with a trainer: per-sample and batch k3, flagged samples,
    the worst as repros."""
    from .cli import EXIT_FOUND, EXIT_OK, EXIT_UNSAVED, EXIT_USAGE, load_plugins
    from .tracking import make_tracker

    try:
        load_plugins(plugins)
        # (rollouts.jsonl and rollouts.parquet apart; a --replay run beside the plain one, not over it; the
        # same file name in another folder, or scored with another trainer or sampling, in a folder of its own)
        out = out_dir or Path("reports") / "score" / default_out_name(file, model, pair_name, replay, threshold,
                                                                      temperature, top_p, max(top_k, 0), min_p,
                                                                      (repetition_penalty, presence_penalty,
                                                                       frequency_penalty),
                                                                      (logprobs_mode, ignore_row_sampling))
        try:  # (before scoring: a folder that cannot be made would otherwise fail after it)
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"the output folder {str(out)!r} cannot be made ({e.strerror or e}); pass --out with a "
                             "folder you can write.") from None
        tracker = make_tracker(tracking_uri, enabled=not no_tracking)
        from .cli import terminate_like_ctrl_c

        terminate_like_ctrl_c()  # SIGTERM (CI timeouts, Slurm) as Ctrl-C: what was scored is written, exit 130
        res = score(file, model=model, pair_name=pair_name, replay=replay, threshold=threshold, device=device,
                    corpus=corpus_dir, out_dir=out, max_repros=max_repros,
                    logprobs_mode=logprobs_mode, row_settings=not ignore_row_sampling,
                    sampling={"temperature": temperature, "top_p": top_p, "sample_top_k": max(top_k, 0), "min_p": min_p,
                              "repetition_penalty": repetition_penalty, "presence_penalty": presence_penalty,
                              "frequency_penalty": frequency_penalty}, tracker=tracker)
    except UsageError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    for b in res.bad:
        click.echo(f"bad row: {b}", err=True)
    b = res.batch
    click.echo(f"scored {len(res.scored)} sample(s), {int(b['tokens'])} token(s) from {file}"
               + (f"; {len(res.bad)} bad row(s) skipped" if res.bad else "") + f" ({res.seconds:.1f}s)")
    click.echo("batch: " + "  ".join(f"{k} {_fmt(b[k])}" for k in ("k3_kl", "kl", "log_ppl_diff", "ppl_ratio",
                                                                   "chi2_token", "max_abs_dlogp"))
               + ("  flip_rate n/a (no experts recorded)" if math.isnan(b["flip_rate"]) else
                  f"  flip_rate {_fmt(b['flip_rate'])}"))
    if res.flagged:
        click.echo(f"{len(res.flagged)} sample(s) above the threshold {threshold:g}:")
        for s in res.flagged[:10]:
            head = s.evaluation.headline
            low = min(s.sample.logprobs, default=0.0)
            if head == "k3=inf" and low <= LOG_ZERO:  # (the recording, not the trainer, gives a sampled token 0)
                head = (f"k3=inf (the recording gives a token the engine sampled log-probability {low:.3g}, probability "
                        "0: the engine reports another distribution than it samples from, or wrote a fill value "
                        "there)")
            elif head == "k3=inf":  # (a recording: no expected k3 to say which side gives the token probability 0)
                head = ("k3=inf (a recorded token the trainer gives probability 0: it cuts tokens the engine kept; "
                        "check the sampling settings it was scored with, the row's own or --top-p / --top-k / --min-p "
                        "/ --temperature, against the engine's)")
            click.echo(f"  line {s.sample.line} (id {s.sample.id}): {head}"
                       + ("" if head.startswith("k3=") else f", k3 {s.metrics['k3_kl']:.4g}")
                       + (f", flip_rate {s.metrics['flip_rate']:.3g}" if s.sample.experts else
                          ", flip_rate n/a (no experts recorded)") + f", {s.metrics['n_tokens']} tokens")
        if len(res.flagged) > 10:
            click.echo(f"  ... and {len(res.flagged) - 10} more (samples.csv)")
    else:
        click.echo(f"every sample is under the threshold {threshold:g}")
    from .corpus import _display, plugin_flags

    for p in res.repros:
        click.echo(f"repro: {p}  (harness replay{plugin_flags(plugins)} {_display(Path(p))})")
    for n in res.notes:
        if n.startswith("warning: "):  # (rows that look padded: on stderr, beside the bad rows)
            click.echo(n, err=True)
        else:
            click.echo(f"note: {n}")
    click.echo(f"outputs: {res.out_dir}/ (samples.csv, summary.json, k3_hist.png)")
    if res.bad:
        click.echo(f"{len(res.bad)} bad row(s) were not scored (above, by line and field): fix or drop them; the exit "
                   "code is 2 unless a sample was flagged", err=True)
    # (as `harness fuzz`: a flagged sample whose repro is not on disk outranks the rest)
    sys.exit(EXIT_UNSAVED if res.unsaved else EXIT_FOUND if res.flagged else EXIT_USAGE if res.bad else EXIT_OK)
