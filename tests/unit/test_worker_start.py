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


def test_the_start_failure_names_the_main_guard_only_for_a_script_of_ones_own(monkeypatch):
    script = types.ModuleType("__main__")
    script.__file__ = "/tmp/my_campaign.py"
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.setattr(worker_mod, "ENTRY_POINT", [False])
    assert 'if __name__ == "__main__":' in worker_mod._main_hint() and "/tmp/my_campaign.py" in worker_mod._main_hint()
    monkeypatch.setattr(worker_mod, "ENTRY_POINT", [True])  # `harness ...` or pytest: not the user's script
    assert worker_mod._main_hint() == ""
    monkeypatch.setattr(worker_mod, "ENTRY_POINT", [False])
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # an interactive session
    assert worker_mod._main_hint() == ""
