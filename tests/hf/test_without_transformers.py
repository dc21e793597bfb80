"""Without transformers: `import harness`, `harness list` and the rest work; no HF pair is
registered; `harness score` says what to install. transformers is hidden from a subprocess."""

from __future__ import annotations

import subprocess
import sys

HIDE = "import sys; sys.modules['transformers'] = None; "


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE + code], capture_output=True, text=True, timeout=300)


def test_registry_loads_without_transformers_and_registers_no_hf_pair():
    p = run("from harness import REGISTRY; REGISTRY.load_builtins(); names = [q.name for q in REGISTRY.all()]; "
            "print(len(names), sum(n.startswith('hf.') for n in names))")
    assert p.returncode == 0, p.stderr
    total, hf = map(int, p.stdout.split())
    assert total > 20 and hf == 0


def test_score_without_transformers_says_what_to_install(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"prompt_ids": [1], "response_ids": [2], "rollout_logprobs": [-0.1]}\n')
    p = run(f"from harness.cli import main; main(['score', {str(f)!r}, '--pair', 'x', '--no-tracking'])")
    assert p.returncode == 2, p.stderr
    assert "needs transformers" in p.stderr and "pip install" in p.stderr and "Traceback" not in p.stderr
