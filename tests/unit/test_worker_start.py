"""A worker that cannot start: nothing left to join, and a hint for scripts of one's own."""
import multiprocessing.process
import sys
import types

import pytest

from harness import worker as worker_mod


def test_a_worker_whose_process_never_started_closes_cleanly(monkeypatch):
    def refuse(self):
        raise RuntimeError("An attempt has been made to start a new process before the current process "
                           "has finished its bootstrapping phase.")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    w = worker_mod.Worker("cpu", threads=1)
    with pytest.raises(RuntimeError, match="bootstrapping"):
        w.start()
    assert w.proc is None
    w.close()  # (joined a process that never started before: AssertionError)


def test_the_start_failure_names_the_main_guard_only_for_a_script_of_ones_own(monkeypatch, tmp_path):
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "my_campaign.py")
    (tmp_path / "my_campaign.py").write_text("run_campaign(...)\n")
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.setattr(worker_mod, "ENTRY_POINT", [False])
    assert 'if __name__ == "__main__":' in worker_mod._main_hint() and "my_campaign.py" in worker_mod._main_hint()
    monkeypatch.setattr(worker_mod, "ENTRY_POINT", [True])  # `harness ...` or pytest: not the user's script
    assert worker_mod._main_hint() == ""
    monkeypatch.setattr(worker_mod, "ENTRY_POINT", [False])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # an interactive session
    assert worker_mod._main_hint() == ""


def test_a_script_read_from_stdin_can_start_workers():
    """multiprocessing would re-run the main script from "<stdin>", a file that does not exist."""
    import subprocess
    from pathlib import Path

    script = ("from harness import REGISTRY, Case\nfrom harness.worker import Worker\nREGISTRY.load_builtins()\n"
              "with Worker('cpu', threads=1) as w:\n"
              "    print(w.evaluate(REGISTRY.get('rmsnorm.aligned'), Case(seed=1, seq_lens=(3,)), 1e-3).symptom.value)\n")
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "none", out.stderr[-3000:]
