"""Small fixed costs of an isolated case, one at a time, on one thread: what is left to cut.

    OMP_NUM_THREADS=1 python reports/scripts/case_costs.py

- the float64 readout's GEMM (`pairs.Readout`) at a typical `moe_aggregate.aligned` case: 37 tokens,
  hidden 128, vocabulary 512, as GMAC/s (this machine's float64 peak bounds it);
- sending the message that carries a case to the worker through a `multiprocessing` pipe and
  receiving it (the serialisation and the pipe's system calls, in one process: no scheduling);
- reading and restoring the process-wide settings around a case (`execute.process_state`).
"""
import time


def per_call(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from harness import Case
    from harness.execute import process_state, restore_process_state
    from harness.pairs import _readout_weight

    t, h, v = 37, 128, 512
    x = torch.randn(t, h, dtype=torch.float64)
    w = _readout_weight(h, v, "cpu")
    gemm = per_call(lambda: x @ w, 2000)
    print(f"readout GEMM ({t}x{h}) @ ({h}x{v}) float64: {gemm * 1e6:.1f} us, {t * h * v / gemm / 1e9:.1f} GMAC/s")
    case = Case(seed=123456789, seq_lens=(12, 7, 18), seq_ids=(1, 2, 3), n_experts=8, top_k=2, tie_fraction=0.3,
                tie_gap=1e-4, logit_scale=3.3)
    from multiprocessing import Pipe

    msg = ("case", "moe_aggregate.aligned", "targets.ops.moe_aggregate", case, 1e-3)
    send, recv = Pipe()

    def round_trip() -> None:
        send.send(msg)
        recv.recv()

    print(f"case message through a pipe, sent and received: {per_call(round_trip, 20000) * 1e6:.1f} us")
    state = per_call(lambda: restore_process_state("x", process_state()), 20000)
    print(f"process state read and restored: {state * 1e6:.1f} us")


if __name__ == "__main__":
    main()
