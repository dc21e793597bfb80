"""Every pair that declares CUDA, on CUDA: the contract holds and the expected verdict is kept.

Skipped, with the reason, where torch sees no CUDA device (this includes every CPU-only CI runner).
"""

import pytest
import torch

from harness import REGISTRY, check_pair
from harness.fuzz import CampaignConfig, fuzz_pair, pair_seed

CUDA = torch.cuda.is_available()
PAIRS = [p.name for p in REGISTRY.all() if "cuda" in p.devices]
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device; torch.cuda.is_available() is False here")


@pytest.mark.gpu
@pytest.mark.parametrize("name", PAIRS)
def test_pair_on_cuda_keeps_its_contract_and_verdict(name, tmp_path):
    pair = REGISTRY.get(name)
    check_pair(pair, n_cases=3, device="cuda")
    cfg = CampaignConfig(pairs=[pair], seed=1, max_examples=100, device="cuda", corpus=tmp_path)
    result = fuzz_pair(pair, cfg, pair_seed(1, name), deadline=None)
    assert result.verdict in ("clean", "caught"), f"{name} on CUDA: {result.verdict}, max k3 {result.max_k3:.3g}"
