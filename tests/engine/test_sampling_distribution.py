"""The sampler draws from exactly the distribution vLLM's filters define, in vLLM's order: temperature, top-k,
top-p (the smallest set whose mass reaches p), then min-p (relative to the most likely survivor). 20,000 draws
per case through `Sampler` itself, against a distribution computed by hand here, by chi-square; the combined
case is built so that applying the filters in another order gives a different distribution, which the same
test rejects."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.engine.request import Request
from pagedllm.engine.sampler import Sampler, processed_probs
from pagedllm.sampling_params import SamplingParams

LOGITS = [2.0, 1.6, 1.5, 1.0, 0.4, 0.0, -0.5, -3.0]
DRAWS = 20_000


def _softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - max(x))
    return e / e.sum()


def _top_k(p, k):
    keep = np.zeros_like(p, dtype=bool)
    keep[np.argsort(-p, kind="stable")[:k]] = True
    return _renorm(np.where(keep, p, 0))


def _top_p(p, top_p):
    order = np.argsort(-p, kind="stable")
    mass_above = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order[mass_above < top_p]] = True  # the smallest prefix whose mass reaches top_p
    return _renorm(np.where(keep, p, 0))


def _min_p(p, min_p):
    return _renorm(np.where(p >= min_p * p.max(), p, 0))


def _renorm(p):
    return p / p.sum()


def reference(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, order=("top_k", "top_p", "min_p")):
    p = _softmax([x / temperature for x in LOGITS])
    steps = {"top_k": lambda q: _top_k(q, top_k) if top_k else q, "top_p": lambda q: _top_p(q, top_p),
             "min_p": lambda q: _min_p(q, min_p)}
    for name in order:
        p = steps[name](p)
    return p


def draws(params: SamplingParams, seed: int = 0) -> np.ndarray:
    reqs = [Request(str(i), [1], params, frozenset(), 16) for i in range(DRAWS)]
    sampler = Sampler(seed)
    logits = torch.tensor([LOGITS] * DRAWS, dtype=torch.float32)
    tokens = [t.token_id for t in sampler(logits, reqs)]
    return np.bincount(tokens, minlength=len(LOGITS))


def chi_square_ok(counts: np.ndarray, expected_p: np.ndarray) -> bool:
    """Counts drawn from expected_p at the 0.1% level. A count on a token of probability 0 always fails."""
    if counts[expected_p == 0].any():
        return False
    support = expected_p > 0
    expected = expected_p[support] * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return True
    z = 3.09  # upper 0.1% of the standard normal; Wilson-Hilferty for the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.3),
    "combined": dict(temperature=1.5, top_p=0.8, min_p=0.2),  # top-k is checked alone above
}


@pytest.mark.parametrize("case", list(CASES))
def test_draws_follow_the_filtered_distribution(case):
    params = CASES[case]
    counts = draws(SamplingParams(**params, seed=None))
    assert chi_square_ok(counts, reference(**params)), (counts, reference(**params))


def _temperature_last(temperature, top_p, min_p, top_k=0):
    """Another order: the filters on the raw distribution, the temperature after them."""
    q = _softmax(LOGITS)
    q = _top_p(_top_k(q, top_k) if top_k else q, top_p)
    q = _softmax(np.where(q > 0, np.log(np.maximum(q, 1e-300)) / temperature, -np.inf))
    return _min_p(q, min_p)


def test_another_filter_order_would_be_rejected():
    """min-p before top-p, or the temperature after the filters, keeps another set here: the test above can
    tell the orders apart."""
    params = CASES["combined"]
    right = reference(**params)
    wrongs = [reference(**params, order=("top_k", "min_p", "top_p")), _temperature_last(**params)]
    counts = draws(SamplingParams(**params))
    assert chi_square_ok(counts, right)
    for wrong in wrongs:
        assert not np.allclose(right, wrong) and not chi_square_ok(counts, wrong)


def test_a_row_without_top_p_keeps_its_tail_beside_a_top_p_row():
    """Batched with a top-p row, a row without top-p keeps the tokens past where its float running sum rounds to 1
    (they were masked), so its draws do not depend on what else is in the batch."""
    logits = torch.tensor([[30.0, 0.0, -1.0, -2.0]])  # a tail of ~1e-13: the running sum is 1.0 in fp32 before it
    plain, nucleus = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5)
    alone = processed_probs(logits, [plain])
    beside = processed_probs(torch.cat([logits, logits]), [plain, nucleus])
    assert (alone[0] > 0).all() and torch.equal(beside[0], alone[0])
    assert (beside[1] > 0).tolist() == [True, False, False, False]
