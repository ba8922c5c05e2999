"""[BZK18] Tables 3-5 benchmark (benchmarks/smooth_svm_tables.py), not timed: its baselines
compute the right polynomials, the custom backward equals autograd, and the stability table
is computed from the algorithms."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import benchmarks.smooth_svm_tables as tables


@pytest.fixture
def one_thread():
    """One torch thread (the SA loop's many tiny steps are slower on more), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def brute_force_sigma(row: list[float], k: int) -> list[float]:
    """``sigma_0..k(exp(row))`` by enumerating every subset (float64)."""
    e = [math.exp(v) for v in row]
    return [
        math.fsum(math.prod(e[i] for i in subset) for subset in itertools.combinations(range(len(e)), j))
        for j in range(k + 1)
    ]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_summation_and_divide_and_conquer_equal_the_brute_force(k):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k), dtype=torch.float64) * 2
    expected = torch.tensor([brute_force_sigma(row, k) for row in x.tolist()], dtype=torch.float64)
    sa = tables.summation_algorithm(torch.exp(x), k)
    assert torch.allclose(sa, expected, rtol=1e-12, atol=0)
    dc = tables.log_elementary_symmetric(x, k)
    assert torch.allclose(dc, expected.log(), rtol=1e-12, atol=1e-12)
    # the timed quantities: (log sigma_{k-1}, log sigma_k), in float32 as in the paper
    for method in (tables.sa_log_sigma, tables.dc_log_sigma, tables.ours_log_sigma):
        got = method(x.float(), k).double()
        assert torch.allclose(got, expected.log()[:, k - 1 :], rtol=1e-5, atol=1e-5), method.__name__


def test_custom_backward_equals_autograd_through_the_recursion_and_finite_differences():
    k = 3
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2

    def gradient(method):
        leaf = x.clone().requires_grad_(True)
        method(leaf, k).sum().backward()
        return leaf.grad

    autograd, custom = gradient(tables.dc_log_sigma), gradient(tables.ours_log_sigma)
    assert torch.allclose(autograd, custom, rtol=1e-9, atol=1e-12)
    step = 1e-5
    for row, column in [(0, 0), (1, 5), (2, 11)]:
        plus, minus = x.clone(), x.clone()
        plus[row, column] += step
        minus[row, column] -= step
        numeric = (tables.dc_log_sigma(plus, k).sum() - tables.dc_log_sigma(minus, k).sum()) / (2 * step)
        assert custom[row, column].item() == pytest.approx(numeric.item(), rel=1e-6, abs=1e-8)


def test_stability_table_is_computed_and_reproduces_the_published_pattern(one_thread):
    logits = tables.stability_logits()
    # the cells that make the point of Table 5, computed one by one
    assert not tables.is_stable("SA", logits, 0.01, torch.float32)
    assert not tables.is_stable("SA", logits, 0.01, torch.float64)
    assert tables.is_stable("SA", logits, 0.1, torch.float64)
    assert tables.is_stable("SA", logits, 1.0, torch.float32)
    assert tables.is_stable("DC log", logits, 1e-4, torch.float32)
    computed = tables.stability_table(logits)
    assert computed == tables.PUBLISHED_STABLE
    # "stable" is not finite garbage: DC log in float32 stays within float32 precision of float64
    assert max(tables.dc_float32_error(logits).values()) < 1e-6


def test_stability_check_sees_an_overflow_it_is_given():
    logits = torch.zeros(2, 10, dtype=torch.float64)
    logits[0, :6] = 100.0  # sigma_5 of exp(100 / (5 * 0.1)) = exp(200)^5 overflows float64 too
    assert tables.is_stable("SA", logits, 10.0, torch.float32)
    assert not tables.is_stable("SA", logits, 0.1, torch.float64)
    assert tables.is_stable("DC log", logits, 0.1, torch.float32)


def test_the_script_writes_the_three_tables(tmp_path, one_thread):
    assert tables.main(["--batch", "2", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "smooth_svm_tables.md").read_text()
    for title in ("Table 3", "Table 4", "Table 5"):
        assert title in text
    assert "Same pattern as published: yes" in text
    rows = (tmp_path / "smooth_svm_tables.csv").read_text().splitlines()
    assert len(rows) == 1 + 3 * 5  # header, then 3 sizes x 5 timed steps
