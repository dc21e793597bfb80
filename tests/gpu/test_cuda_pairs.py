"""Every pair that declares CUDA, on CUDA: the contract holds and aligned pairs stay clean.

Skipped, with the reason, where torch sees no CUDA device (this includes every CPU-only CI runner).
The model pairs run their real-size config here (`targets.models.moe_decoder.LARGE`), so the cases
per pair are few; `harness gpucheck` runs these tests, then a short campaign of every CUDA pair
(demonstrations included) and prints its table.
"""

import pytest
import torch

from harness import REGISTRY, check_pair
from harness.fuzz import CampaignConfig, fuzz_pair, pair_seed

CUDA = torch.cuda.is_available()
PAIRS = [p.name for p in REGISTRY.all() if "cuda" in p.devices]
ALIGNED = [p.name for p in REGISTRY.all() if "cuda" in p.devices and p.expected == "aligned"]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA device; torch.cuda.is_available() is False here")]


def _model(name: str) -> bool:
    return REGISTRY.get(name).kind == "model"


@pytest.mark.parametrize("name", PAIRS)
def test_pair_on_cuda_keeps_its_contract(name):
    check_pair(REGISTRY.get(name), n_cases=2 if _model(name) else 3, device="cuda")


@pytest.mark.parametrize("name", ALIGNED)
def test_aligned_pair_stays_clean_on_cuda(name, tmp_path):
    pair = REGISTRY.get(name)
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=6 if _model(name) else 40, device="cuda",
                         corpus=tmp_path, write_corpus=False)
    result = fuzz_pair(pair, cfg, pair_seed(1, name), deadline=None)
    assert result.verdict == "clean", f"{name} on CUDA: {result.verdict}, max k3 {result.max_k3:.3g}, " + "; ".join(
        f"{f.symptom.value} k3={f.k3:.3g} {f.case.one_line()}" for f in result.findings)
