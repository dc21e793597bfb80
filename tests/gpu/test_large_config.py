"""The real-size config the model pairs run on CUDA: checked here on any machine (meta tensors, no GPU)."""

import torch

from targets.models import pairs
from targets.models.moe_decoder import LARGE, MoEDecoder


def test_the_cuda_config_is_real_size():
    assert pairs.CONFIGS["cuda"] is LARGE
    assert LARGE.vocab >= 151936 and LARGE.hidden >= 2048
    assert (LARGE.experts, LARGE.top_k) == (64, 8)
    assert LARGE.heads % LARGE.kv_heads == 0


def test_a_largest_case_holds_up_to_4k_tokens():
    """Tokens one forward of the trainer covers for the largest case the model axes draw: per sequence
    BOS, the unscored context, the prompt and the response (all but its last token are inputs)."""
    a = pairs.AXES
    per_sequence = 1 + LARGE.context + a.prompt_len[1] + a.seq_len[1]
    assert 3000 <= a.n_seqs[1] * per_sequence <= 4096


def test_the_weights_fit_an_h200_with_room_for_activations():
    with torch.device("meta"):
        m = MoEDecoder(LARGE)
    params = sum(p.numel() for p in m.parameters())
    assert 1.0e9 < params < 1.6e9  # 4-6.4 GB in float32, of the H200's 141 GB
    # the largest activation: (tokens, vocab) float32 log-probabilities of one trainer forward
    assert 4096 * LARGE.vocab * 4 < 3e9
