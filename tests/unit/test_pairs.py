import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

import harness
from harness import Axes, Outcome, PairError, RoutingAxes, TargetPair
from harness.errors import UsageError
from harness.pairs import REGISTRY, Registry


def _pair(**kw):
    base = dict(name="t.ok", kind="op", expected="aligned", build=lambda case, device: None,
                trainer=lambda inputs: Outcome(), rollout=lambda inputs: Outcome())
    base.update(kw)
    return TargetPair(**base)


@pytest.mark.parametrize("changes,words", [
    ({"name": "Bad Name"}, "rename it"),
    ({"kind": "layer"}, "kind='op' or 'model'"),
    ({"expected": "maybe"}, "'aligned' for pairs"),
    ({"build": lambda case: None}, "build(case, device)"),
    ({"trainer": lambda a, b, c: None}, "trainer(inputs) or trainer(inputs, rollout_outcome)"),
    ({"rollout": 3}, "rollout must be a function"),
    ({"axes": Axes(seq_len=(4, 2))}, "axes.seq_len"),
    ({"axes": Axes(dtypes=("int4",))}, "axes.dtypes"),
    ({"axes": Axes(routing=RoutingAxes(n_experts=(4, 8), top_k=(4, 4)))}, "so a boundary exists"),
    ({"devices": ("tpu",)}, "devices"),
    ({"axes": Axes(params={"temperature": (0.5, 2.0)})}, "not a Hypothesis strategy; write e.g."),
    ({"axes": Axes(params={"": st.integers()})}, "non-empty string"),
    ({"axes": Axes(n_seqs=4)}, "axes.n_seqs=4 must be a tuple"),
    ({"axes": Axes(dtypes="bfloat16")}, "axes.dtypes"),
    ({"axes": Axes(temperature=(0.0, 2.0))}, "axes.temperature"),
    ({"axes": Axes(top_p=(0.5, 1.5))}, "axes.top_p"),
    ({"axes": Axes(sample_top_k=(-1, 4))}, "axes.sample_top_k"),
    ({"axes": Axes(prompt_len=(4, 2))}, "axes.prompt_len"),
    ({"axes": Axes(pad_sides=("up",))}, "axes.pad_sides"),
    ({"axes": Axes(routing=(4, 8))}, "axes.routing must be a harness.RoutingAxes"),
    ({"axes": Axes(routing=RoutingAxes(tie_fraction=(0.5, 2.0)))}, "axes.routing.tie_fraction"),
    # cases larger than a repro may be: a finding the campaign could write but not replay
    ({"axes": Axes(n_seqs=(1, 6000), seq_len=(1, 1))}, "6000 sequences (n_seqs high), above the limit of 4096"),
    ({"axes": Axes(n_seqs=(1, 64), seq_len=(1, 2048))}, "$HARNESS_MAX_TOKENS"),
    ({"axes": Axes(routing=RoutingAxes(n_experts=(4, 5000)))}, "routing.n_experts high"),
])
def test_registration_validates_eagerly_with_the_fix(changes, words):
    with pytest.raises(PairError) as err:
        Registry().register(_pair(**changes))
    assert words in str(err.value)


def test_duplicate_names_from_different_sources_clash():
    reg = Registry()
    reg.register(_pair(source="a.py"))
    with pytest.raises(PairError, match="clashes"):
        reg.register(_pair(source="b.py"))


def test_get_loaded_loads_nothing():
    reg = Registry()
    assert reg.get_loaded("linear.aligned") is None and not reg._loaded_builtins  # no built-in imported
    pair = reg.register(_pair())
    assert reg.get_loaded("t.ok") is pair


def test_trainer_reading_the_rollout_is_detected():
    assert _pair(trainer=lambda inputs, rollout: Outcome()).trainer_reads_rollout
    assert not _pair().trainer_reads_rollout


def test_builtins_are_registered_and_selected_by_glob():
    names = [p.name for p in REGISTRY.select(["moe_aggregate.*", "router_topk.bf16"])]
    assert names[:2] == ["moe_aggregate.aligned", "moe_aggregate.bf16"] and "router_topk.bf16" in names
    with pytest.raises(UsageError, match="harness list"):
        REGISTRY.get("no.such.pair")
    with pytest.raises(UsageError, match="no registered pair matches") as e:
        REGISTRY.select(["zzz*"])
    assert "Did you mean" not in str(e.value)
    with pytest.raises(UsageError, match=r"no registered pair matches 'atention\.\*'\. Did you mean 'attention\.\*'\?"):
        REGISTRY.select(["atention.*"])  # (a glob's typo: the same glob over the close family)
    with pytest.raises(UsageError, match=r"Did you mean moe_aggregate\.order,"):  # a typo: its closest first
        REGISTRY.get("moe_aggregate.ordr")
    assert [p.name for p in REGISTRY] == [p.name for p in REGISTRY.all()] and len(REGISTRY) == len(REGISTRY.all())
    assert "router_topk.bf16" in REGISTRY and "no.such.pair" not in REGISTRY


def test_plugin_from_file_and_bad_plugins(tmp_path):
    good = tmp_path / "my_pairs.py"
    good.write_text(
        "from harness import TargetPair, Outcome, register\n"
        "register(TargetPair(name='plug.ok', kind='op', expected='aligned', build=lambda c, d: None,\n"
        "    trainer=lambda i: Outcome(), rollout=lambda i: Outcome()))\n")
    REGISTRY.load_plugin(str(good))
    assert REGISTRY.get("plug.ok").source == str(good)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(UsageError, match="failed to import: ModuleNotFoundError"):
        REGISTRY.load_plugin(str(broken))
    with pytest.raises(UsageError, match="does not exist"):
        REGISTRY.load_plugin(str(tmp_path / "missing.py"))
    with pytest.raises(UsageError, match="neither a file nor an importable module .no module named 'no_such_package'"):
        REGISTRY.load_plugin("no_such_package.pairs")
    with pytest.raises(UsageError, match=r"is a folder; pass the Python file in it .* \(broken.py, my_pairs.py are"):
        REGISTRY.load_plugin(str(tmp_path))
    # a plugin file whose name does not end in .py is Python source all the same (it had failed with
    # "'NoneType' object has no attribute 'loader'", and advice to run a file that runs fine)
    (tmp_path / "pairs_noext").write_text("from harness import REGISTRY\nREGISTRY.noext_loaded = True\n")
    REGISTRY.load_plugin(str(tmp_path / "pairs_noext"))
    assert getattr(REGISTRY, "noext_loaded", False)
    del REGISTRY.noext_loaded
    # a module that exists but imports something missing: its own error, and how to see it in full
    (tmp_path / "pkg_with_missing_dep.py").write_text("import not_a_module_anywhere\n")
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(UsageError, match="failed to import: ModuleNotFoundError.*python -c 'import pkg_with"):
            REGISTRY.load_plugin("pkg_with_missing_dep")
    finally:
        sys.path.remove(str(tmp_path))


def test_one_plugin_registering_a_name_twice_is_an_error(tmp_path):
    twice = tmp_path / "twice.py"
    twice.write_text(
        "from harness import TargetPair, Outcome, register\n"
        "for scale in (1.0, 2.0):  # a factory loop that forgot to put the setting into the name\n"
        "    register(TargetPair(name='plug.twice', kind='op', expected='aligned', build=lambda c, d: None,\n"
        "        trainer=lambda i: Outcome(), rollout=lambda i: Outcome()))\n")
    out = subprocess.run([sys.executable, "-m", "harness", "list", "--plugin", str(twice)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "registers two target pairs named 'plug.twice'" in out.stderr + out.stdout
    reg = Registry()  # one pair object registered again is not a second pair
    with reg._load("mod"):
        pair = reg.register(_pair())
        assert reg.register(pair) is pair
    # a plugin that imports itself by its own module name runs twice, as two modules: not a clash
    selfimp = tmp_path / "selfimp.py"
    selfimp.write_text(
        "import sys\nsys.path.insert(0, %r)\n"
        "from harness import TargetPair, Outcome, register\n"
        "register(TargetPair(name='plug.selfimp', kind='op', expected='aligned', build=lambda c, d: None,\n"
        "    trainer=lambda i: Outcome(), rollout=lambda i: Outcome()))\n"
        "import selfimp  # e.g. so that pickle finds its functions by that name\n" % str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "harness", "list", "--plugin", str(selfimp)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "plug.selfimp" in out.stdout, out.stderr


def test_a_plugin_that_imports_another_plugin_beside_it_loads_with_it_in_either_order(tmp_path):
    """`--plugin engine.py --plugin more.py` where more.py does `import engine` (kept beside it): one
    module, its pairs registered once (it was run twice, as two modules, and its pairs "clashed")."""
    (tmp_path / "engine.py").write_text(
        "from harness import TargetPair, Outcome, register\n"
        "def make(name):\n"
        "    return TargetPair(name=name, kind='op', expected='aligned', build=lambda c, d: None,\n"
        "        trainer=lambda i: Outcome(), rollout=lambda i: Outcome())\n"
        "register(make('engine.base'))\n")
    (tmp_path / "more.py").write_text("import engine\nfrom harness import register\n"
                                       "register(engine.make('engine.more'))\n")
    for order in (["engine.py", "more.py"], ["more.py", "engine.py"]):
        args = [a for f in order for a in ("--plugin", str(tmp_path / f))]
        out = subprocess.run([sys.executable, "-m", "harness", "list", *args], capture_output=True, text=True)
        assert out.returncode == 0, (order, out.stderr)
        assert "engine.base" in out.stdout and "engine.more" in out.stdout


def test_import_harness_is_light():
    code = ("import sys, harness, harness.cli, harness.fuzz, harness.corpus, harness.execute; "
            "bad = [m for m in ('mlflow', 'onnxruntime', 'onnx') if m in sys.modules]; "
            "import torch; cuda = torch.cuda.is_initialized(); print(bad, cuda)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] False"


def test_public_names():
    for name in ("Case", "TargetPair", "Outcome", "Routing", "Readout", "Axes", "register", "check_pair"):
        assert hasattr(harness, name)


def test_pairs_from_the_entry_point_group(tmp_path):
    """A package exposing a module in the `harness.targets` group is loaded without --plugin."""
    site = tmp_path / "site"
    (site / "acme_pairs-1.0.dist-info").mkdir(parents=True)
    (site / "acme_pairs-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-pairs\nVersion: 1.0\n")
    (site / "acme_pairs-1.0.dist-info" / "entry_points.txt").write_text("[harness.targets]\nacme = acme_pairs\n")
    (site / "acme_pairs.py").write_text(  # an engine whose temperature is off by 10%: caught on any case
        "import torch\n"
        "from harness import Axes, TargetPair, Outcome, register\n"
        "def build(case, device):\n"
        "    return case.token_randn(16, 'hidden', device=device) @ case.randn((16, 64), 'head', device=device)\n"
        "register(TargetPair(name='acme.engine', kind='op', expected='diverges', build=build,\n"
        "    trainer=lambda x: Outcome(logprobs=torch.log_softmax(x, -1)),\n"
        "    rollout=lambda x: Outcome(logprobs=torch.log_softmax(1.1 * x, -1)), axes=Axes(n_seqs=(1, 2), seq_len=(1, 3))))\n")
    import os

    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "harness", "list", "--json"], capture_output=True, text=True,
                         env=env, check=True).stdout
    import json

    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["acme.engine"]["source"] == "entry point acme"
    # a repro's loader names the package and version that provided the pair
    probe = ("from harness.corpus import loader_of; from pathlib import Path; "
             "print(loader_of('entry point acme', Path('.')))")
    loader = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True).stdout
    assert "'package': 'acme-pairs 1.0'" in loader, loader
    # a repro of it records that version; a replay after an upgrade of the package says so
    found = subprocess.run([sys.executable, "-m", "harness", "fuzz", "acme.engine", "--no-tracking", "--max-examples",
                            "3", "--corpus", str(tmp_path / "found")], capture_output=True, text=True, env=env)
    assert found.returncode == 1, found.stderr
    (repro,) = (tmp_path / "found" / "acme.engine").glob("*.json")
    assert json.loads(repro.read_text())["loader"]["package"] == "acme-pairs 1.0"
    (site / "acme_pairs-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-pairs\nVersion: 1.1\n")
    replayed = subprocess.run([sys.executable, "-m", "harness", "replay", str(repro)], capture_output=True, text=True,
                              env=env)
    assert "its pair's package was acme-pairs 1.0 when recorded, acme-pairs 1.1 now" in replayed.stdout, replayed.stdout
    # a package whose entry point fails to load: a warning, the built-in pairs still run, and asking
    # for one of its pairs names why it is missing
    (site / "acme_pairs.py").write_text("raise RuntimeError('half-installed acme')\n")
    listed = subprocess.run([sys.executable, "-m", "harness", "list", "--json"], capture_output=True, text=True,
                            env=env)
    assert listed.returncode == 0 and "warning: the plugin entry point 'acme'" in listed.stderr, listed.stderr
    assert "rmsnorm.aligned" in {r["name"] for r in json.loads(listed.stdout)}
    asked = subprocess.run([sys.executable, "-m", "harness", "fuzz", "acme.engine", "--no-tracking"],
                           capture_output=True, text=True, env=env)
    assert asked.returncode == 2 and "no target pair named 'acme.engine'" in asked.stderr
    assert "half-installed acme" in asked.stderr and "Traceback" not in asked.stderr, asked.stderr
    # a built-in pair named runs; a campaign over a glob (a nightly's '*') that left the package out is not a pass
    corpus = ["--no-tracking", "--max-examples", "2", "--corpus", str(tmp_path / "c")]
    named = subprocess.run([sys.executable, "-m", "harness", "fuzz", "rmsnorm.aligned", *corpus], capture_output=True,
                           text=True, env=env)
    assert named.returncode == 0, named.stderr
    assert named.stderr.count("warning: the plugin entry point 'acme'") == 1, named.stderr  # (not again per worker)
    glob = subprocess.run([sys.executable, "-m", "harness", "fuzz", "rmsnorm.a*", *corpus], capture_output=True,
                          text=True, env=env)
    assert glob.returncode == 2 and "none of its pairs was fuzzed" in glob.stderr, glob.stderr
    # the pytest plugin's session (a nightly's) fails with the reason in its summary
    session = subprocess.run([sys.executable, "-m", "pytest", "--harness-fuzz", "--harness-pairs", "rmsnorm.aligned",
                              "--harness-max-examples", "2", "--harness-no-tracking", f"--harness-out={tmp_path / 'o'}",
                              f"--harness-corpus={tmp_path / 'c'}", "-p", "no:cacheprovider", "-q"],
                             capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2])
    assert session.returncode == 1 and "none of its pairs was fuzzed" in session.stdout, session.stdout[-2000:]
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert "half-installed acme" in summary["broken_plugins"][0]


def test_a_raised_repro_limit_admits_wider_axes_and_a_lowered_one_refuses_no_pair(monkeypatch):
    monkeypatch.setenv("HARNESS_MAX_SEQUENCES", "8192")
    Registry().register(_pair(axes=Axes(n_seqs=(1, 6000), seq_len=(1, 1))))
    monkeypatch.setenv("HARNESS_MAX_SEQUENCES", "4")  # (its repros above 4 sequences are refused on load)
    Registry().register(_pair(axes=Axes(n_seqs=(1, 32), seq_len=(1, 1))))


def test_the_registry_is_indexed_by_name():
    from harness import REGISTRY
    from harness.errors import UsageError

    assert REGISTRY["rmsnorm.aligned"] is REGISTRY.get("rmsnorm.aligned")
    assert "rmsnorm.aligned" in REGISTRY and "no.such.pair" not in REGISTRY
    with pytest.raises(UsageError, match="Did you mean rmsnorm.aligned"):
        REGISTRY["rmsnorm.aligne"]


@pytest.mark.parametrize("routing,words", [
    (lambda t, k: harness.Routing(experts=torch.zeros(t, k, dtype=torch.int64)), "routing must be a dict"),
    (lambda t, k: {"moe": harness.Routing(experts=torch.zeros(t, k))}, "must be an integer tensor"),
    (lambda t, k: {"moe": harness.Routing(experts=torch.zeros(t + 1, k, dtype=torch.int64))}, "route the same tokens"),
    (lambda t, k: {"moe": harness.Routing(experts=torch.zeros(t, dtype=torch.int64))}, "expected (tokens, k)"),
    (lambda t, k: {"moe": harness.Routing(experts=torch.zeros(t, k, dtype=torch.int64),
                                          scores=torch.zeros(t, k - 1))}, "with E >= k"),
    (lambda t, k: {"moe": harness.Routing(experts=torch.zeros(t, k + 1, dtype=torch.int64))},
     "the same top-k"),
])
def test_a_paths_routing_is_checked_with_a_message_in_the_pairs_terms(routing, words):
    """Wrong routing shapes were numpy broadcast errors inside the metrics, or flip rates over the
    wrong number of tokens, judged clean."""
    from harness import Case, Outcome, TargetPair
    from harness.execute import run_case

    def build(case, device):
        return case.token_randn(8, "x", device=device)

    good = lambda x: Outcome(logprobs=torch.log_softmax(x, -1),  # noqa: E731
                             routing={"moe": harness.Routing(experts=torch.zeros(x.shape[0], 2, dtype=torch.int64),
                                                             scores=torch.zeros(x.shape[0], 4))})
    bad = lambda x: Outcome(logprobs=torch.log_softmax(x, -1), routing=routing(x.shape[0], 2))  # noqa: E731
    case = Case(seed=1, seq_lens=(2, 1))
    twin_only = words in ("the same top-k", "route the same tokens")  # (seen when the trainer's outcome is checked)
    for trainer, rollout in ((bad, good),) if twin_only else ((good, bad), (bad, good)):
        pair = TargetPair(name="x.routing", kind="op", expected="aligned", build=build, trainer=trainer, rollout=rollout)
        ev = run_case(pair, case)
        assert ev.error is not None and words in ev.error["message"], (ev.error, words)
    assert run_case(TargetPair(name="x.ok", kind="op", expected="aligned", build=build, trainer=good, rollout=good),
                    case).error is None
    # numpy expert ids, and every expert chosen (top_k = E: scores (T, k)), are routings too
    as_numpy = lambda x: Outcome(logprobs=torch.log_softmax(x, -1), routing={"moe": harness.Routing(  # noqa: E731
        experts=torch.zeros(x.shape[0], 2, dtype=torch.int64).numpy(), scores=torch.zeros(x.shape[0], 2))})
    assert run_case(TargetPair(name="x.np", kind="op", expected="aligned", build=build, trainer=as_numpy,
                               rollout=as_numpy), case).error is None


def test_a_plugin_file_imports_a_module_beside_it_in_the_campaign_and_its_worker(tmp_path, harness_cli):
    """As `python FILE` would: the plugin's folder is importable (after the installed packages), in
    this process and in the isolated worker that loads the plugin again."""
    (tmp_path / "sib_helper.py").write_text("import torch\n\ndef fine(inp):\n"
                                            "    return torch.log_softmax(inp['x'], -1)\n")
    (tmp_path / "plug.py").write_text(
        "import sib_helper\nfrom harness import Axes, Outcome, TargetPair, register\n\n"
        "def build(case, device):\n    return {'x': case.randn((case.n_tokens, 8), 'x', device=device)}\n\n"
        "def path(inp):\n    return Outcome(logprobs=sib_helper.fine(inp))\n\n"
        "register(TargetPair(name='sib.pair', kind='op', expected='aligned', build=build, trainer=path,\n"
        "                    rollout=path, axes=Axes(n_seqs=(1, 2), seq_len=(1, 4))))\n")
    code, out, err = harness_cli("fuzz", "sib.pair", "--plugin", str(tmp_path / "plug.py"), "--max-examples", "3",
                                 "--no-tracking", "--corpus", str(tmp_path / "corpus"), cwd=tmp_path.parent)
    assert code == 0 and "sib.pair: clean" in out + err, out + err


def test_a_path_that_reports_only_its_sampled_tokens_logprobs_is_judged_on_them():
    """An engine asked for the sampled tokens' log-probabilities only (`token_outcome`): the verdict
    reads those tokens' mean k3, the same value as full rows give for the same tokens."""
    import torch

    from harness import Axes, Case, Outcome, TargetPair, token_outcome
    from harness.execute import run_case

    def build(case, device):
        h = case.token_randn(16, "h")
        return {"h": h, "w": torch.randn(16, 64, generator=torch.Generator().manual_seed(2)) * 0.6,
                "u": case.token_uniforms("sample")}

    def rows(inp, low):
        w = inp["w"].bfloat16().float() if low else inp["w"]
        return torch.log_softmax(inp["h"] @ w, -1)

    def rollout_full(inp):  # samples by inverse CDF on the case's uniforms
        lp = rows(inp, low=True)
        c = lp.double().exp().cumsum(-1)
        tok = torch.searchsorted(c, inp["u"][:, None] * c[:, -1:], right=True).squeeze(-1).clamp_(max=63)
        return Outcome(logprobs=lp, tokens=tok)

    def rollout_tokens_only(inp):
        full = rollout_full(inp)
        return token_outcome(full.logprobs.gather(1, full.tokens[:, None])[:, 0], tokens=full.tokens)

    def trainer_tokens_only(inp, rollout):
        return token_outcome(rows(inp, low=False).gather(1, rollout.tokens[:, None])[:, 0])

    axes = Axes(n_seqs=(1, 3), seq_len=(1, 8), pad_sides=("right",), logit_scale=(1.0, 1.0))
    full = TargetPair(name="tok.full", kind="op", expected="diverges", build=build, axes=axes, rollout=rollout_full,
                      trainer=lambda inp: Outcome(logprobs=rows(inp, low=False)))
    only = TargetPair(name="tok.only", kind="op", expected="diverges", build=build, axes=axes,
                      rollout=rollout_tokens_only, trainer=trainer_tokens_only)
    case = Case(seed=7, seq_lens=(8, 5, 3))
    a, b = run_case(full, case).divergence, run_case(only, case).divergence
    assert b.k3_kl == pytest.approx(a.k3_kl, rel=1e-12) and a.k3_kl > 0
    assert math.isnan(b.k3_expected) and b.per_token["token"].tolist() == a.per_token["token"].tolist()
    # the rollout must say which tokens its log-probabilities are of
    nameless = TargetPair(name="tok.nameless", kind="op", expected="diverges", build=build, axes=axes,
                          rollout=lambda inp: token_outcome(torch.zeros(case.n_tokens) - 1.0),
                          trainer=trainer_tokens_only)
    ev = run_case(nameless, case)
    assert ev.symptom.value == "error" and "but not the tokens: pass token_outcome(logp, tokens=" in ev.error["message"]
    # the same pair made from the full one by `sampled_tokens_only`: the same values
    from harness import sampled_tokens_only

    made = sampled_tokens_only(full)
    assert made.name == "tok.full.sampled_only" and made.trainer_reads_rollout
    c = run_case(made, case).divergence
    assert c.k3_kl == b.k3_kl and c.kl == b.kl and c.rows == "two_outcome"
    drawn = sampled_tokens_only(dataclasses.replace(full, rollout=lambda inp: Outcome(logprobs=rows(inp, low=True))))
    ev = run_case(drawn, case)  # (its tokens the harness draws: no engine-sampled token to cut to)
    assert ev.symptom.value == "error" and "needs tok.full's rollout to return the tokens it sampled" in ev.error["message"]
    # the repro says its rows are two-outcome (`show` labels its kl and entropy as of that split)
    from harness.corpus import metrics_json

    assert metrics_json(run_case(only, case))["rows"] == "two_outcome" and "rows" not in metrics_json(run_case(full, case))
    # the contract check takes its tokens as ids of the model's vocabulary, not of the two-column rows
    from harness.conformance import check_pair

    check_pair(dataclasses.replace(only, expected="aligned"), n_cases=4)
    # triage's per-module capture finalizes the trainer beside the rollout, as a case does (it raised
    # "holds its tokens' log-probabilities only ... but not the tokens" on the trainer's outcome)
    from harness.triage import capture

    head_t, head_r = torch.nn.Linear(16, 64), torch.nn.Linear(16, 64)
    exposed = dataclasses.replace(only, name="tok.exposed", build=lambda c, d: {
        **build(c, d), "modules": {"trainer": head_t, "rollout": head_r}})
    assert capture(exposed, case, "cpu") is not None


NORMALISER_PLUGIN = """
import torch
from harness import Axes, Outcome, TargetPair, register, sampled_tokens_only

def build(case, device):
    return {"logits": case.token_randn(64, "x") * 6.0, "u": case.token_uniforms("sample")}

def rollout(inp):
    lp = torch.log_softmax(inp["logits"], -1)
    c = lp.double().exp().cumsum(-1)
    tok = torch.searchsorted(c, inp["u"][:, None] * c[:, -1:], right=True).squeeze(-1).clamp_(max=63)
    return Outcome(logprobs=lp, tokens=tok)

def trainer(inp):  # a fused log-sum-exp 0.01 off: every token of a row shifted alike
    return Outcome(logprobs=torch.log_softmax(inp["logits"], -1) - 0.01)

AXES = Axes(n_seqs=(1, 3), seq_len=(4, 8), pad_sides=("right",), logit_scale=(1.0, 1.0))
FULL = TargetPair(name="norm.full", kind="op", expected="aligned", build=build, axes=AXES, rollout=rollout,
                  trainer=trainer)
register(FULL)
register(sampled_tokens_only(FULL, name="norm.only"))
"""


def test_a_trainer_off_by_its_normaliser_reads_a_two_outcome_kl_full_rows_do_not_and_show_says_why(
        tmp_path, harness_cli):
    """A fused trainer whose log-sum-exp is off by a little (every token of a row shifted alike): over
    full rows its exact KL normalises the shift away; cut to the sampled tokens, the two-outcome split
    takes the rest of the row as 1 - p and reads a KL over the line on confident tokens while the
    sampled k3 stays under it. `show` says so; a full-row rollout beside a token-only trainer is
    refused with how to cut both."""
    from harness import Case, REGISTRY, TargetPair, token_outcome
    from harness.execute import run_case

    plugin = tmp_path / "norm.py"
    plugin.write_text(NORMALISER_PLUGIN)
    REGISTRY.load_plugin(str(plugin))
    full, only = REGISTRY.get("norm.full"), REGISTRY.get("norm.only")
    case = Case(seed=3, seq_lens=(8, 8, 8))
    a, ev = run_case(full, case), run_case(only, case)
    assert not a.failed and a.divergence.kl < 1e-12 and a.divergence.k3_expected < 1e-3, a.divergence
    assert ev.failed and ev.divergence.kl > 1e-3 and ev.divergence.k3_kl < 1e-3, ev.divergence
    code, out, err = harness_cli("fuzz", "norm.only", "--plugin", str(plugin), "--max-examples", "10", "--seed", "1",
                                 "--corpus", str(tmp_path / "c"), "--no-tracking", cwd=tmp_path)
    assert code == 1, out + err
    [path] = (tmp_path / "c").rglob("*.json")
    code, out, err = harness_cli("show", str(path), "--plugin", str(plugin), cwd=tmp_path)
    assert code == 0 and "the two-outcome KL fired with the sampled tokens' k3 under the line" in out, out + err
    assert "top_k (router) 2" in out, out  # (beside sample_top_k: which top-k is which)
    mixed = TargetPair(name="norm.mixed", kind="op", expected="aligned", build=full.build, axes=full.axes,
                       rollout=full.rollout, trainer=lambda inp, ro: token_outcome(
                           full.trainer(inp).logprobs.gather(1, ro.tokens[:, None])[:, 0]))
    ev = run_case(mixed, case)
    assert ev.symptom.value == "error" and "wrap a full-row pair in `harness.sampled_tokens_only(pair)`" in \
        ev.error["message"], ev.error


def test_groups_of_sequences_without_prompts_to_share_are_rejected_with_the_fix():
    """A trial's `Axes(prompt_group=(2, 4))` with the default prompt_len=(0, 0) drew groups that share
    nothing, silently."""
    from harness import Axes

    [problem] = Axes(prompt_group=(2, 4)).problems()
    assert "prompt_len=(0, 0) gives them none to share" in problem and "prompt_len=(1, 32)" in problem
    assert Axes(prompt_group=(2, 4), prompt_len=(1, 8)).problems() == []
