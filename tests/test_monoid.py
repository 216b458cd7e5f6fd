"""Monoid laws of (m, S, W), tested directly."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elsa_surgery import monoid


def _state_of(scores, v):
    return monoid.from_scores(scores.double(), v.double())


def _rand_state(g, rows=6, dv=5, masked_rows=()):
    s = torch.randn(rows, 7, generator=g, dtype=torch.float64) * 3
    for r in masked_rows:
        s[r] = float("-inf")
    return _state_of(s, torch.randn(7, dv, generator=g, dtype=torch.float64))


def _close(a, b, tol=1e-12):
    out_a, lse_a = monoid.finalize(a)
    out_b, lse_b = monoid.finalize(b)
    assert torch.equal(torch.isinf(lse_a), torch.isinf(lse_b))
    fin = torch.isfinite(lse_a)
    assert torch.allclose(out_a, out_b, rtol=tol, atol=tol)
    assert torch.allclose(lse_a[fin], lse_b[fin], rtol=tol, atol=tol)


def test_identity_is_neutral_exactly():
    g = torch.Generator().manual_seed(0)
    a = _rand_state(g, masked_rows=(2,))
    e = monoid.identity((6,), 5, dtype=torch.float64)
    for merged in (monoid.merge(a, e), monoid.merge(e, a)):
        for x, y in zip(merged, a):
            assert torch.equal(x, y)


def test_identity_with_identity_has_no_nan():
    e = monoid.identity((3,), 4)
    ee = monoid.merge(e, e)
    assert not any(torch.isnan(t).any() for t in ee)
    out, lse = monoid.finalize(ee)
    assert torch.count_nonzero(out) == 0 and torch.isinf(lse).all()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), parts=st.integers(1, 9))
def test_partitions_merge_to_the_whole_in_any_order(seed, parts):
    g = torch.Generator().manual_seed(seed)
    n = 40
    s = torch.randn(5, n, generator=g, dtype=torch.float64) * 4
    s[1, :] = float("-inf")  # a fully masked row
    s[2, :20] = float("-inf")  # a row masked in early partitions only
    v = torch.randn(n, 3, generator=g, dtype=torch.float64)
    whole = _state_of(s, v)
    cuts = sorted(torch.randperm(n - 1, generator=g)[: parts - 1].add(1).tolist())
    bounds = list(zip([0] + cuts, cuts + [n]))
    states = [_state_of(s[:, a:b], v[a:b]) for a, b in bounds]
    order = torch.randperm(len(states), generator=g).tolist()
    _close(monoid.merge_all(states), whole)
    _close(monoid.merge_all([states[i] for i in order]), whole)
    # left fold == tree
    acc = monoid.identity((5,), 3, dtype=torch.float64)
    for st_ in states:
        acc = monoid.merge(acc, st_)
    _close(acc, whole)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_associativity_up_to_rounding(seed):
    g = torch.Generator().manual_seed(seed)
    a, b, c = (_rand_state(g, masked_rows=(i,)) for i in range(3))
    _close(monoid.merge(monoid.merge(a, b), c), monoid.merge(a, monoid.merge(b, c)))


def test_fold_scores_equals_merge_of_block_state():
    g = torch.Generator().manual_seed(1)
    a = _rand_state(g, masked_rows=(0,))
    s = torch.randn(6, 7, generator=g, dtype=torch.float64)
    s[3] = float("-inf")
    v = torch.randn(7, 5, generator=g, dtype=torch.float64)
    _close(monoid.fold_scores(a, s.clone(), v), monoid.merge(a, monoid.from_scores(s, v)))


def test_from_output_round_trips_and_merges():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(4, 10, generator=g, dtype=torch.float64)
    s[0] = float("-inf")
    v = torch.randn(10, 3, generator=g, dtype=torch.float64)
    left, right = _state_of(s[:, :6], v[:6]), _state_of(s[:, 6:], v[6:])
    via_outputs = monoid.merge(monoid.from_output(*monoid.finalize(left)), monoid.from_output(*monoid.finalize(right)))
    _close(via_outputs, _state_of(s, v))


def test_nan_propagates_through_merge():
    g = torch.Generator().manual_seed(3)
    a, b = _rand_state(g), _rand_state(g)
    a = monoid.State(a.m.clone(), a.S, a.W)
    a.m[0] = float("nan")
    out, _ = monoid.finalize(monoid.merge(a, b))
    assert torch.isnan(out[0]).all()


def test_in_place_merge_equals_merge_bitwise_on_views():
    g = torch.Generator().manual_seed(3)
    a, b = _rand_state(g, masked_rows=(1,)), _rand_state(g, masked_rows=(1, 4))
    big = monoid.identity((10,), 5, dtype=torch.float64)
    for x, y in zip(big, a):
        x[2:8].copy_(y)
    view = monoid.State(big.m[2:8], big.S[2:8], big.W[2:8])
    monoid.merge_(view, b)
    for x, y in zip(view, monoid.merge(a, b)):
        assert torch.equal(x, y)
    assert torch.isinf(big.m[:2]).all() and torch.count_nonzero(big.W[8:]) == 0  # rows outside the view untouched
