"""The `Case`: one fuzz input, an RL batch as pure data.

A case is everything a target pair needs to rebuild its tensors: a seed and the knobs the fuzzer
draws. It holds no tensors. `pair.build(case, device)` draws every tensor from the case's seed, so a
repro file is a few hundred bytes of JSON and replays bit-for-bit.

An RL batch (schema 2): each sequence j is a prompt of `prompt_lens[j]` tokens and a response of
`seq_lens[j]` tokens. The rollout prefills the prompt and decodes every response token from its KV
cache, sampling with the case's `temperature` / `top_p` / `sample_top_k` / `min_p` (and penalties);
the trainer scores the response tokens in one teacher-forced forward over the packed prompt+response rows. Outcome rows
are the response tokens, `n_tokens = sum(seq_lens)`, in case order. Op pairs have no prompt
(`prompt_lens = ()`, every prompt empty) and see `seq_lens` as before. Sequences may share a prompt
(`prompt_ids`: a group of samples of one prompt, as GRPO draws them): what lies at a shared prompt's
positions comes from the prompt id's stream (`prompt_generator`), the responses from their own.

Streams. Tensors come from named streams of the seed. Schema-2 cases give each sequence its own
stream, keyed by its stable id `seq_ids[j]` (`seq_generator`, `token_randn`, `prompt_tokens`), and
draw token rows one at a time, so dropping a sequence, or the last token of one, leaves every other
row bit-identical: the shrinker moves one knob at a time. A schema-1 repro loads as schema 2 with
`streams="single"`: the same helpers then draw from the schema-1 single stream, so it replays
bit-for-bit. `harness corpus upgrade DIR` rewrites schema-1 files in the schema-2 format (still
`streams="single"`, same tensors); a repro re-found by a new campaign is recorded with per-sequence
streams.

What "smaller" means (why a minimal case is minimal): fewer sequences, shorter responses, shorter
prompts, and every knob at its neutral value: temperature 1.0, top-p 1.0, top-k 0, min-p 0 and penalties off, right
padding, one packed row in the given order, no forced router ties, every prompt its own, logit
scale at its lower bound, the first listed dtype. `smaller_neighbours()` lists the cases one removal away; `simpler_neighbours(axes)`
adds one knob moved to neutral within the pair's axes. A minimal repro diverges and none of its
simpler neighbours does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)  # schema 1 (an op case: no prompts, no sampling fields) loads upgraded
STREAMS = ("sequence", "single")
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "sample_top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0, "pad_side": "right"}  # knob -> neutral
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
PENALTY_BOUNDS = (-2.0, 2.0)  # the presence and frequency penalties' range (vLLM's)
# sampling fields a repro's JSON leaves out at their neutral value (added after schema 2 was first
# written: a case that does not use them keeps the key, and so the ID, it had, and older harnesses read it)
OMITTED_WHEN_NEUTRAL = ("min_p", *PENALTIES)

DTYPES = ("float32", "bfloat16", "float16", "float64")
PAD_SIDES = ("right", "left")
MAX_TIE_GAP = 1.0  # a gap above this is no longer "near" a tie for any score scale we fuzz

ParamValue = int | float | str | bool


class CaseError(ValueError):
    """A case field breaks a rule. The message names the field, the value and the rule."""


def _fail(name: str, value: Any, rule: str) -> None:
    raise CaseError(f"case field '{name}' = {value!r} is invalid: {rule}.")



def brief_value(value: Any, limit: int = 120) -> Any:
    """A string param longer than `limit` characters (a recorded sample's params hold thousands of
    numbers) as its first 4 and last 2 items and its counts, for display; any other value as it is."""
    text = str(value)
    if not isinstance(value, str) or len(text) <= limit:
        return value
    items = text.split()
    if len(items) > 8:
        return f"{' '.join(items[:4])} ... {' '.join(items[-2:])} ({len(items)} items, {len(text)} characters in the file)"
    return f"{text[:60]}...{text[-20:]} ({len(text)} characters in the file)"

@dataclass(frozen=True)
class Case:
    # --- identity -----------------------------------------------------------------------------
    seed: int  # every tensor of the case is drawn from this (0 <= seed < 2**63)
    # --- batch layout -------------------------------------------------------------------------
    seq_lens: tuple[int, ...] = (8,)  # response (scored) tokens per sequence; batch size = len(seq_lens)
    probe: int = 0  # index of the probe sequence: the one whose placement in the batch is fuzzed
    # --- packing ------------------------------------------------------------------------------
    row_capacity: int = 0  # trainer: tokens per packed row; 0 = one row holding every sequence
    order: tuple[int, ...] = ()  # trainer: order sequences are packed in; () = as given
    pad_side: str = "right"  # rollout: side padding goes on in the padded batch
    # --- near-tie routing ---------------------------------------------------------------------
    n_experts: int = 8  # experts in the router
    top_k: int = 2  # experts chosen per token
    tie_fraction: float = 0.0  # fraction of tokens forced to sit at the top-k boundary
    tie_gap: float = 0.0  # score gap between the k-th and (k+1)-th expert of a forced token
    # --- output distribution ------------------------------------------------------------------
    logit_scale: float = 1.0  # peakedness: logits are scaled by this (larger = lower entropy)
    dtype: str = "bfloat16"  # the low-precision dtype of the rollout path, where a pair fuzzes it
    # --- free per-pair parameters -------------------------------------------------------------
    params: Mapping[str, ParamValue] = field(default_factory=dict)
    # --- RL batch (schema 2) ------------------------------------------------------------------
    prompt_lens: tuple[int, ...] = ()  # prompt (unscored, prefilled) tokens per sequence; () = no prompts
    seq_ids: tuple[int, ...] = ()  # each sequence's stream id; () = 0..n-1. Kept when others are dropped
    temperature: float = 1.0  # sampling temperature (> 0); neutral 1.0
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; neutral 1.0 (off)
    sample_top_k: int = 0  # sampling top-k; 0 = off (neutral). `top_k` above is the router's
    min_p: float = 0.0  # min-p: tokens below min_p x the most likely token's probability are cut; 0 = off
    # penalties on the raw logits, by each row's token history (`harness.sampling.penalize`); neutral = off
    repetition_penalty: float = 1.0  # > 0: tokens of the prompt and the output so far, positive logits / it
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once for each token the output holds so far
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output so far
    streams: str = "sequence"  # "sequence": per-sequence streams; "single": an upgraded schema-1 repro
    # each sequence's prompt: the stream id of the sequence whose prompt it shares (a group of samples of
    # one prompt, as GRPO draws them); () = every sequence its own prompt
    prompt_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in SEQUENCE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (list, tuple)):
                object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "params", dict(self.params))
        self.validate()

    # ------------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def n_tokens(self) -> int:
        """Scored (response) tokens: the rows of both outcomes."""
        return sum(self.seq_lens)

    @property
    def response_lens(self) -> tuple[int, ...]:
        return self.seq_lens

    def prompt_len(self, j: int) -> int:
        return self.prompt_lens[j] if self.prompt_lens else 0

    def size_text(self) -> str:
        """'4 sequence(s), 56 scored token(s) + 453 prompt = 509 in all' (without prompts: the first two):
        a size threshold on total tokens (a workspace switch past 512) reads off it."""
        text = f"{self.batch_size} sequence(s), {self.n_tokens} scored token(s)"
        prompt = sum(self.prompt_len(j) for j in range(self.batch_size))
        text += f" + {prompt} prompt = {self.n_tokens + prompt} in all" if prompt else ""
        prompts = {self.prompt_len(j) for j in range(self.batch_size)}
        if self.batch_size > 1 and len(prompts) > 1:  # (a padded prefill holds more than the tokens)
            text += (f"; padded to the longest prompt, a prefill holds {self.batch_size} x {max(prompts)} = "
                     f"{self.batch_size * max(prompts)} prompt positions")
        return text

    def total_len(self, j: int) -> int:
        """Prompt plus response tokens of sequence j (what a packed trainer row holds of it)."""
        return self.prompt_len(j) + self.seq_lens[j]

    @property
    def total_lens(self) -> tuple[int, ...]:
        return tuple(self.total_len(j) for j in range(self.batch_size))

    @property
    def ids(self) -> tuple[int, ...]:
        """Each sequence's stream id, with the default (0..n-1) made explicit."""
        return self.seq_ids or tuple(range(self.batch_size))

    def prompt_id(self, j: int) -> int:
        """The stream id sequence j's prompt comes from: its own id, or the id of the sequence whose
        prompt it shares (`prompt_ids`)."""
        return self.prompt_ids[j] if self.prompt_ids else self.ids[j]

    @property
    def groups(self) -> list[list[int]]:
        """The sequences that share a prompt, each group in batch order (a sequence with a prompt of its
        own is a group of one), groups in the order of their first sequence."""
        out: dict[int, list[int]] = {}
        for j in range(self.batch_size):
            out.setdefault(self.prompt_id(j), []).append(j)
        return list(out.values())

    @property
    def offsets(self) -> list[int]:
        """The first outcome row of each sequence."""
        out, at = [], 0
        for n in self.seq_lens:
            out.append(at)
            at += n
        return out

    @property
    def sampling(self) -> dict[str, float | int]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.sample_top_k, "min_p": self.min_p,
                **{name: getattr(self, name) for name in PENALTIES}}

    @property
    def penalties(self) -> dict[str, float]:
        """The penalties away from neutral (name -> value); {} when off."""
        return {name: getattr(self, name) for name in PENALTIES if getattr(self, name) != NEUTRAL[name]}

    @property
    def packing_order(self) -> tuple[int, ...]:
        """The trainer's packing order, with the default (as given) made explicit."""
        return self.order or tuple(range(self.batch_size))

    @property
    def capacity(self) -> int:
        """The trainer's row capacity, with the default (one row) made explicit."""
        return self.row_capacity or sum(self.total_lens)

    def packed_rows(self) -> list[list[int]]:
        """Sequences per trainer row: first-fit in packing order, a new row when one is full
        (a sequence counts its prompt and its response)."""
        rows: list[list[int]] = [[]]
        used = 0
        for i in self.packing_order:
            n = self.total_len(i)
            if rows[-1] and used + n > self.capacity:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows

    def validate(self) -> None:
        per_seq = (f"; seq_lens sets how many sequences there are ({self.batch_size}): edit seq_ids, prompt_lens and "
                   "order with it, one entry per sequence (or empty them), and keep probe below the count")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            _fail("seed", self.seed, "must be an integer in [0, 2**63)")
        if not self.seq_lens:
            _fail("seq_lens", self.seq_lens, "must hold at least one sequence length")
        for n in self.seq_lens:
            if not _int(n) or n < 1:
                _fail("seq_lens", self.seq_lens, "every length must be an integer >= 1")
        if not _int(self.probe) or not 0 <= self.probe < self.batch_size:
            _fail("probe", self.probe, f"must index a sequence, 0 <= probe < {self.batch_size}" + per_seq)
        if self.prompt_lens:
            if len(self.prompt_lens) != self.batch_size:
                _fail("prompt_lens", self.prompt_lens,
                      f"must be empty or hold one length per sequence ({self.batch_size})" + per_seq)
            for n in self.prompt_lens:
                if not _int(n) or n < 0:
                    _fail("prompt_lens", self.prompt_lens, "every prompt length must be an integer >= 0")
        if self.seq_ids:
            if len(self.seq_ids) != self.batch_size:
                _fail("seq_ids", self.seq_ids, f"must be empty or hold one id per sequence ({self.batch_size})" + per_seq)
            for n in self.seq_ids:
                if not _int(n) or not 0 <= n < 2**32:
                    _fail("seq_ids", self.seq_ids, "every id must be an integer in [0, 2**32)")
        if self.prompt_ids:
            if len(self.prompt_ids) != self.batch_size:
                _fail("prompt_ids", self.prompt_ids,
                      f"must be empty or hold one prompt id per sequence ({self.batch_size})" + per_seq)
            for n in self.prompt_ids:
                if not _int(n) or not 0 <= n < 2**32:
                    _fail("prompt_ids", self.prompt_ids, "every id must be an integer in [0, 2**32)")
            if self.streams != "sequence":
                _fail("prompt_ids", self.prompt_ids, "needs per-sequence streams (streams = 'sequence')")
            lens: dict[int, int] = {}
            for j, pid in enumerate(self.prompt_ids):
                if lens.setdefault(pid, self.prompt_len(j)) != self.prompt_len(j):
                    _fail("prompt_ids", self.prompt_ids, f"sequences that share a prompt (id {pid}) must have the "
                          f"same prompt length; prompt_lens = {list(self.prompt_lens)}")
        if not _int(self.row_capacity) or self.row_capacity < 0:
            _fail("row_capacity", self.row_capacity, "must be an integer >= 0 (0 = one row)")
        longest = max(self.total_len(j) for j in range(self.batch_size))
        if self.row_capacity and self.row_capacity < longest:
            _fail("row_capacity", self.row_capacity,
                  f"must be 0 or at least the longest sequence ({longest}) counting prompt + response")
        if not finite_number(self.temperature) or self.temperature <= 0:
            _fail("temperature", self.temperature, "must be a finite number > 0 (1.0 = neutral)")
        if not finite_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "must be a number in (0, 1] (1.0 = off)")
        if not _int(self.sample_top_k) or self.sample_top_k < 0:
            _fail("sample_top_k", self.sample_top_k, "must be an integer >= 0 (0 = off)")
        if not finite_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "must be a number in [0, 1] (0.0 = off)")
        if not finite_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "must be a finite number > 0 (1.0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not finite_number(value) or not PENALTY_BOUNDS[0] <= value <= PENALTY_BOUNDS[1]:
                _fail(name, value, "must be a number in [-2, 2] (0.0 = off)")
        if self.streams not in STREAMS:
            _fail("streams", self.streams, f"must be one of {STREAMS}")
        if self.order and (not all(_int(i) for i in self.order)
                           or sorted(self.order) != list(range(self.batch_size))):
            _fail("order", self.order, f"must be empty or a permutation of 0..{self.batch_size - 1}" + per_seq)
        if not isinstance(self.pad_side, str) or self.pad_side not in PAD_SIDES:
            _fail("pad_side", self.pad_side, f"must be one of {PAD_SIDES}")
        if not _int(self.n_experts) or self.n_experts < 1:
            _fail("n_experts", self.n_experts, "must be an integer >= 1")
        if not _int(self.top_k) or not 1 <= self.top_k <= self.n_experts:
            _fail("top_k", self.top_k, f"must be an integer with 1 <= top_k <= n_experts ({self.n_experts})")
        if not finite_number(self.tie_fraction) or not 0.0 <= self.tie_fraction <= 1.0:
            _fail("tie_fraction", self.tie_fraction, "must be a number in [0, 1]")
        if not finite_number(self.tie_gap) or not 0.0 <= self.tie_gap <= MAX_TIE_GAP:
            _fail("tie_gap", self.tie_gap, f"must be a number in [0, {MAX_TIE_GAP}] (0 = exact tie)")
        if not finite_number(self.logit_scale) or self.logit_scale <= 0:
            _fail("logit_scale", self.logit_scale, "must be a finite number > 0")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"must be one of {DTYPES}")
        for key, value in self.params.items():
            if not isinstance(key, str) or not key:
                _fail("params", key, "keys must be non-empty strings")
            if not isinstance(value, (int, float, str, bool)) or (
                isinstance(value, float) and not math.isfinite(value)
            ):
                _fail(f"params.{key}", value, "values must be finite numbers, strings or booleans")

    # --- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in SEQUENCE_FIELDS:
            out[name] = list(getattr(self, name))
        out["params"] = dict(sorted(self.params.items()))
        if not self.prompt_ids:  # (left out when no prompt is shared: a repro readable by harnesses before groups)
            del out["prompt_ids"]
        for name in OMITTED_WHEN_NEUTRAL:
            if out[name] == NEUTRAL[name]:
                del out[name]
        return {"schema": SCHEMA_VERSION, **out}

    @classmethod
    def from_json(cls, data: Any) -> "Case":
        if not isinstance(data, dict):
            raise CaseError(f"a case must be a JSON object, got {type(data).__name__}.")
        schema = data.get("schema", 1)
        if type(schema) is not int or schema not in READABLE_SCHEMAS:
            raise CaseError(
                f"case schema {schema!r} is not supported (this harness reads schemas {READABLE_SCHEMAS}); "
                "re-record the repro with this version of the harness."
            )
        names = {f.name for f in dataclasses.fields(cls)}
        if schema == 1:  # an op case of schema 1: no prompts, no sampling, one stream per named tensor
            names -= set(SCHEMA2_FIELDS)
        unknown = sorted(set(data) - names - {"schema"})
        if unknown:
            raise CaseError(f"case has unknown field(s) {unknown}; known fields are {sorted(names)}.")
        if "seed" not in data:
            raise CaseError("case field 'seed' is missing; every case needs the seed its tensors come from.")
        kwargs = {k: v for k, v in data.items() if k != "schema"}
        if schema == 1:
            kwargs["streams"] = "single"
        for seq_field in SEQUENCE_FIELDS:
            if seq_field in kwargs and not isinstance(kwargs[seq_field], (list, tuple)):
                _fail(seq_field, kwargs[seq_field], "must be a list of integers")
        if "params" in kwargs and not isinstance(kwargs["params"], dict):
            _fail("params", kwargs["params"], "must be a JSON object")
        try:
            return cls(**kwargs)
        except TypeError as e:  # pragma: no cover - guarded by the checks above
            raise CaseError(f"case could not be built: {e}.") from None

    def key(self) -> str:
        """A canonical string for the case: equal cases have equal keys."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def __hash__(self) -> int:  # (the generated one hashes `params`, a dict: a case in a set or a cache key)
        # the field values as `==` compares them (1 == 1.0, and so are their hashes; `key()`'s JSON is not)
        return hash(tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in vars(self).values()))

    def one_line(self, brief: bool = False) -> str:
        """The case in one line, only the fields that differ from the defaults (`seq_ids` too: the
        sequences' streams, which every tensor is drawn from). `brief`: long string params (a
        recorded sample's thousands of numbers) cut by `brief_value`, for notes a person reads."""
        default = Case(seed=0)
        parts = [f"seed={self.seed}", f"seq_lens={list(self.seq_lens)}"]
        for f in dataclasses.fields(self):
            if f.name in ("seed", "seq_lens"):
                continue
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                if brief and f.name == "params":
                    value = {k: brief_value(v) for k, v in value.items()}
                parts.append(f"{f.name}={list(value) if isinstance(value, tuple) else value!r}")
        return " ".join(parts)

    # --- randomness ---------------------------------------------------------------------------
    def derived_seed(self, *salt: Any) -> int:
        """A stable 63-bit seed for one named stream of this case's randomness."""
        text = "/".join([str(self.seed), *map(str, salt)])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def generator(self, *salt: Any):
        """A CPU torch.Generator for one named stream (draw on CPU, then move: same on every device)."""
        import torch

        g = torch.Generator(device="cpu")
        g.manual_seed(self.derived_seed(*salt))
        return g

    def randn(self, shape: tuple[int, ...], *salt: Any, device: str = "cpu"):
        """A float32 standard-normal tensor from one named stream, drawn on CPU then moved."""
        import torch

        return torch.randn(*shape, generator=self.generator(*salt)).to(device)

    def seq_generator(self, j: int, *salt: Any):
        """A CPU torch.Generator for sequence j's own stream (keyed by its id, not its position).
        For an upgraded schema-1 case (streams="single") there is one stream: `generator(*salt)`."""
        if self.streams == "single":
            return self.generator(*salt)
        return self.generator("seq", self.ids[j], *salt)

    def token_randn(self, width: int | tuple[int, ...], *salt: Any, device: str = "cpu"):
        """(T, *width) float32 standard normal, one row per scored token in case order.

        Sequence j's rows come from its own stream, drawn one row at a time, so removing a sequence
        or the last token of one leaves every other row bit-identical. For a schema-1 case this is
        exactly `randn((T, *width), *salt)`, the schema-1 draw."""
        import torch

        shape = (width,) if isinstance(width, int) else tuple(width)
        if self.streams == "single":
            return self.randn((self.n_tokens, *shape), *salt, device=device)
        width_n = math.prod(shape)
        blocks = []
        for j, n in enumerate(self.seq_lens):
            g = self.seq_generator(j, *salt)
            if width_n % 16 == 0:  # torch's CPU normal fills 16 values at a time: a block of whole
                blocks.append(torch.randn(n, *shape, generator=g))  # rows equals the rows drawn one by one
            else:
                blocks.append(torch.stack([torch.randn(*shape, generator=g) for _ in range(n)]))
        return torch.cat(blocks).to(device)

    def prompt_generator(self, j: int, *salt: Any):
        """A CPU torch.Generator for what sequence j's prompt positions hold (its tokens, a context
        before them, their router ties): the stream of its prompt id, so the sequences of a group get
        the same prompt, bit for bit; without groups the sequence's own stream (`seq_generator`)."""
        if self.streams == "single" or not self.prompt_ids:
            return self.seq_generator(j, *salt)
        return self.generator("seq", self.prompt_id(j), *salt)

    def seq_randn(self, j: int, shape: tuple[int, ...], *salt: Any, device: str = "cpu"):
        """A float32 standard-normal tensor of sequence j's own stream."""
        import torch

        return torch.randn(*shape, generator=self.seq_generator(j, "seq_randn", *salt)).to(device)

    def prompt_tokens(self, j: int, vocab: int, *salt: Any, low: int = 0):
        """(prompt_len(j),) int64 token ids in [low, vocab) from the stream of sequence j's prompt
        (`prompt_generator`: the prompt id's, so the sequences of a group that share a prompt get the
        same tokens, bit for bit; without groups sequence j's own), one draw per token, so a shorter
        prompt is a prefix of a longer one."""
        import torch

        g = self.prompt_generator(j, "prompt", *salt)  # (a group's shared prompt: its prompt id's stream)
        return torch.randint(low, vocab, (self.prompt_len(j),), generator=g)  # drawn serially: prefix-stable

    def tie_forced(self, j: int, n: int, salt: str = "ties", prompt_positions: int | None = None):
        """(n,) bool: which of the first n positions of sequence j (prompt included: positions as the
        path counts them) the case forces to a router's top-k boundary (a `tie_fraction` of them),
        from the sequence's own stream, so a position's flag is the same in every layout (packed
        trainer rows, a decode step's batch) and whatever the other sequences are. For the `forced=`
        argument of `strategies.near_tie_hidden` / `near_tie_logits` in a router's forward hook; the
        Hugging Face backend's router hooks force these positions too. The first `prompt_positions`
        (default `prompt_len(j)`; a path that puts a first token before the prompt counts it) are the
        prompt's: a group that shares a prompt shares their flags too (`prompt_generator`)."""
        import torch

        flags = torch.rand(n, generator=self.seq_generator(j, salt)) < self.tie_fraction  # serial: prefix-stable
        p = min(self.prompt_len(j) if prompt_positions is None else prompt_positions, n)
        if self.prompt_ids and self.prompt_id(j) != self.ids[j] and p:  # a shared prompt's positions: its flags
            flags[:p] = torch.rand(p, generator=self.prompt_generator(j, salt)) < self.tie_fraction
        return flags

    def token_uniforms(self, *salt: Any):
        """(T,) float64 uniforms in [0, 1), sequence j's from its own stream (for sampling tokens or
        choosing forced tokens). For a schema-1 case: one stream."""
        import torch

        if self.streams == "single":
            return torch.rand(self.n_tokens, generator=self.generator(*salt), dtype=torch.float64)
        parts = [torch.rand(n, generator=self.seq_generator(j, *salt), dtype=torch.float64)  # serial: prefix-stable
                 for j, n in enumerate(self.seq_lens)]
        return torch.cat(parts)

    def smaller_neighbours(self) -> list["Case"]:
        """The cases one removal away: one sequence (batch row) dropped, or one token dropped from the
        end of one response or of one prompt (the shorter one is a prefix of it; a shared prompt's for
        its whole group), or from every prompt (response) of one length at once, all else equal."""
        out: list[Case] = []
        n = self.batch_size
        for i in range(n if n > 1 else 0):
            out.append(self.drop_sequence(i))
        for i, m in enumerate(self.seq_lens):
            if m > 1:
                lens = self.seq_lens[:i] + (m - 1,) + self.seq_lens[i + 1:]
                out.append(self._with_lens(lens, self.prompt_lens))
        for group in self.groups:  # (a shared prompt is shortened for every sequence of its group)
            m = self.prompt_len(group[0])
            if m > 0:
                prompts = tuple(p - 1 if i in group else p for i, p in enumerate(self.prompt_lens))
                out.append(self._with_lens(self.seq_lens, prompts if any(prompts) else ()))
        # every prompt (response) of one length one token shorter together, where two or more hold it
        for m in {self.prompt_len(g[0]) for g in self.groups}:
            if m > 0 and sum(self.prompt_len(g[0]) == m for g in self.groups) > 1:
                prompts = tuple(p - 1 if p == m else p for p in self.prompt_lens)
                out.append(self._with_lens(self.seq_lens, prompts if any(prompts) else ()))
        for m in set(self.seq_lens):
            if m > 1 and self.seq_lens.count(m) > 1:
                out.append(self._with_lens(tuple(k - 1 if k == m else k for k in self.seq_lens), self.prompt_lens))
        return out

    def simpler_neighbours(self, axes: Any = None) -> list["Case"]:
        """`smaller_neighbours()` plus one knob moved to its neutral value (sampling off, right
        padding, one packed row in the given order, no forced router ties). With `axes` (the pair's),
        the neutral values its axes allow, as shrinking moves them (`shrink.neutral_within`: a pair
        that always left-pads keeps its left padding), and one response token of a sequence given to
        its prompt (the same positions, one scored token fewer), within the axes' prompt lengths."""
        from .shrink import _with, neutral_within, within_sizes

        out = [c for c in self.smaller_neighbours() if axes is None or within_sizes(c, axes)]
        max_prompt = axes.prompt_len[1] if axes is not None else 0
        for j, n in enumerate(self.seq_lens):  # (a sequence that shares its prompt keeps it as the group has it)
            if n > 1 and self.prompt_len(j) + 1 <= max_prompt and len(self.group_of(j)) == 1:
                out.append(_with(self, j, prompt=self.prompt_len(j) + 1, response=n - 1))
        if self.prompt_ids:
            out.append(self.replace(prompt_ids=()))  # every sequence its own prompt
        for name, neutral in neutral_within(axes).items():
            if getattr(self, name) != neutral:
                out.append(self.replace(**{name: neutral}))
        if self.row_capacity:
            out.append(self.replace(row_capacity=0))
        if self.order:
            out.append(self.replace(order=()))
        if self.tie_fraction > 0:
            out.append(self.replace(tie_fraction=0.0))
        return out

    def drop_sequence(self, i: int) -> "Case":
        """This case without sequence i; every other sequence keeps its id (and so its tensors)."""
        return self.keep_sequences([j for j in range(self.batch_size) if j != i])

    def first_sequences(self, m: int) -> "Case":
        """This case's first m sequences (each keeps its id, and so its tensors)."""
        return self.keep_sequences(list(range(min(m, self.batch_size))))

    def keep_sequences(self, keep: list[int]) -> "Case":
        """This case with only the sequences `keep` (ascending indices), each keeping its id (and so
        its tensors), its prompt and its place in the packing order."""
        new = {j: n for n, j in enumerate(keep)}
        lens = tuple(self.seq_lens[j] for j in keep)
        prompts = tuple(self.prompt_lens[j] for j in keep) if self.prompt_lens else ()
        order = tuple(new[j] for j in self.order if j in new)
        probe = new.get(self.probe, 0)
        ids = tuple(self.ids[j] for j in keep) if self.streams == "sequence" else ()
        pids = tuple(self.prompt_ids[j] for j in keep) if self.prompt_ids else ()
        if pids == tuple(self.ids[j] for j in keep):  # (every prompt its own now: no group left)
            pids = ()
        if ids == tuple(range(len(keep))):
            ids = ()
        total = sum(lens) + sum(prompts)
        cap = self.row_capacity if self.row_capacity < total else 0
        return self.replace(seq_lens=lens, prompt_lens=prompts if any(prompts) else (), order=order,
                            probe=probe, row_capacity=cap, seq_ids=ids, prompt_ids=pids)

    def group_of(self, j: int) -> list[int]:
        """The sequences that share sequence j's prompt, j included, in batch order."""
        pid = self.prompt_id(j)
        return [i for i in range(self.batch_size) if self.prompt_id(i) == pid]

    def _with_lens(self, lens: tuple[int, ...], prompts: tuple[int, ...]) -> "Case":
        totals = [a + (prompts[j] if prompts else 0) for j, a in enumerate(lens)]
        cap = self.row_capacity if max(totals) <= self.row_capacity < sum(totals) else 0
        return self.replace(seq_lens=lens, prompt_lens=prompts, row_capacity=cap)

    def replace(self, **changes: Any) -> "Case":
        return dataclasses.replace(self, **changes)


SCHEMA2_FIELDS = ("prompt_lens", "seq_ids", "temperature", "top_p", "sample_top_k", "streams", "prompt_ids", "min_p",
                  *PENALTIES)
SEQUENCE_FIELDS = ("seq_lens", "order", "prompt_lens", "seq_ids", "prompt_ids")  # lists in JSON, tuples here


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def finite_number(x: Any) -> bool:
    """A finite int or float (an int too large for a float, as JSON may hold one, is not)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False
