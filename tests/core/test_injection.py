"""Marker sites, norm-matched injection h' = h + s*||h||*v/||v||, and the marker check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nla_core import find_injection_sites, inject_norm_matched, karvonen_inject, marker_well_formed

FAST = settings(max_examples=40, deadline=None)

MARKER, LEFT, RIGHT = 7, 3, 5
IDS = dict(marker_id=MARKER, left_id=LEFT, right_id=RIGHT)


def loop_sites(input_ids, marker_id=MARKER, left_id=LEFT, right_id=RIGHT):
    out = []
    b, s = input_ids.shape
    for row in range(b):
        for p in range(1, s - 1):
            if (
                input_ids[row, p] == marker_id
                and input_ids[row, p - 1] == left_id
                and input_ids[row, p + 1] == right_id
            ):
                out.append([row, p])
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 2)


def loop_inject64(resid, sites, vectors, scale=1.0):
    out = resid.double().clone()
    for (row, p), v in zip(sites.tolist(), vectors.double()):
        h = out[row, p].clone()
        out[row, p] = h + scale * h.norm() * v / v.norm()
    return out


@st.composite
def token_grids(draw, max_b=4, max_s=9):
    b = draw(st.integers(1, max_b))
    s = draw(st.integers(1, max_s))
    # a small alphabet holding marker and neighbours makes sites (and near-misses) common
    cells = draw(st.lists(st.sampled_from([0, LEFT, MARKER, RIGHT]), min_size=b * s, max_size=b * s))
    return torch.tensor(cells, dtype=torch.long).reshape(b, s)


@st.composite
def resid_with_sites(draw, dtype=torch.float32):
    ids = draw(token_grids())
    d = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    b, s = ids.shape
    resid = (torch.randn(b, s, d, generator=g) * draw(st.sampled_from([0.1, 1.0, 30.0]))).to(dtype)
    sites = loop_sites(ids)
    vectors = torch.randn(sites.shape[0], d, generator=g) * 5
    return ids, resid, sites, vectors


# ---------------------------------------------------------------- find_injection_sites


def test_sites_hand_worked():
    ids = torch.tensor(
        [
            [LEFT, MARKER, RIGHT, 0, LEFT, MARKER, RIGHT],  # two sites: positions 1 and 5
            [MARKER, RIGHT, 0, 0, 0, LEFT, MARKER],  # marker at 0 and at S-1: none
            [0, MARKER, RIGHT, LEFT, MARKER, 0, 0],  # wrong neighbours: none
            [0, 0, LEFT, MARKER, RIGHT, 0, 0],  # one at 3
        ]
    )
    sites = find_injection_sites(ids, **IDS)
    assert sites.dtype == torch.int64
    assert sites.tolist() == [[0, 1], [0, 5], [3, 3]]


@settings(max_examples=60, deadline=None)
@given(token_grids())
@example(torch.tensor([[MARKER]]))  # S = 1
@example(torch.tensor([[LEFT, MARKER]]))  # marker at S-1
@example(torch.tensor([[MARKER, RIGHT]]))  # marker at 0
@example(torch.tensor([[LEFT, MARKER, RIGHT]]))
def test_sites_equal_loop_reference(ids):
    sites = find_injection_sites(ids, **IDS)
    assert sites.dtype == torch.int64 and sites.dim() == 2 and sites.shape[1] == 2
    assert torch.equal(sites, loop_sites(ids))


def test_sites_empty_has_shape_0x2():
    sites = find_injection_sites(torch.zeros(3, 5, dtype=torch.long), **IDS)
    assert sites.shape == (0, 2) and sites.dtype == torch.int64


# ---------------------------------------------------------------- inject_norm_matched


@FAST
@given(resid_with_sites(), st.sampled_from([1.0, 0.5, 2.0]))
def test_equals_loop_reference(data, scale):
    _, resid, sites, vectors = data
    out = inject_norm_matched(resid, sites, vectors, scale=scale)
    assert out.shape == resid.shape and out.dtype == resid.dtype
    torch.testing.assert_close(out.double(), loop_inject64(resid, sites, vectors, scale), rtol=1e-5, atol=1e-5)


@FAST
@given(resid_with_sites(), st.sampled_from([1.0, 0.25, 3.0]))
def test_norm_of_change_is_scale_times_norm_of_h(data, scale):
    _, resid, sites, vectors = data
    out = inject_norm_matched(resid, sites, vectors, scale=scale)
    for (row, p) in sites.tolist():
        h = resid[row, p].double()
        change = (out[row, p].double() - h).norm()
        assert change.item() == pytest.approx(scale * h.norm().item(), rel=1e-5, abs=1e-5)
        # and the change points along v
        v = vectors[sites.tolist().index([row, p])].double()
        if h.norm() > 1e-3:
            cos = torch.dot(out[row, p].double() - h, v) / (change * v.norm())
            assert cos.item() == pytest.approx(1.0, abs=1e-5)


@FAST
@given(resid_with_sites(), st.sampled_from([2.0**-6, 0.5, 2.0, 2.0**10]))
def test_positive_rescaling_of_v_changes_nothing_exactly(data, c):
    # powers of two scale without rounding, so the output is bit-identical
    _, resid, sites, vectors = data
    a = inject_norm_matched(resid, sites, vectors)
    b = inject_norm_matched(resid, sites, c * vectors)
    assert torch.equal(a, b)


@FAST
@given(resid_with_sites(), st.floats(0.01, 100.0))
def test_positive_rescaling_of_v_changes_nothing(data, c):
    _, resid, sites, vectors = data
    a = inject_norm_matched(resid, sites, vectors)
    b = inject_norm_matched(resid, sites, c * vectors)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@FAST
@given(resid_with_sites(), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_non_sites_untouched_bit_exact_and_input_kept(data, dtype):
    _, resid, sites, vectors = data
    resid = resid.to(dtype)
    before = resid.clone()
    out = inject_norm_matched(resid, sites, vectors)
    at_site = torch.zeros(resid.shape[:2], dtype=torch.bool)
    if sites.numel():
        at_site[sites[:, 0], sites[:, 1]] = True
    assert torch.equal(out[~at_site], resid[~at_site])
    assert torch.equal(resid, before)  # out-of-place
    if sites.numel():
        assert out.data_ptr() != resid.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_kept_and_math_in_float32(dtype):
    g = torch.Generator().manual_seed(0)
    resid = torch.randn(2, 5, 16, generator=g).to(dtype)
    sites = torch.tensor([[0, 2], [1, 4]])
    vectors = torch.randn(2, 16, generator=g)
    out = inject_norm_matched(resid, sites, vectors)
    assert out.dtype == dtype
    ref = loop_inject64(resid.float(), sites, vectors)  # the math on the dtype's values
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float64: 1e-6}[dtype]
    torch.testing.assert_close(out.double(), ref.to(dtype).double(), rtol=tol, atol=tol)
    untouched = torch.ones(2, 5, dtype=torch.bool)
    untouched[0, 2] = untouched[1, 4] = False
    assert torch.equal(out[untouched], resid[untouched])


@FAST
@given(resid_with_sites())
def test_gradient_flows_to_resid(data):
    _, resid, sites, vectors = data
    w = torch.linspace(-1, 1, resid.numel()).reshape(resid.shape)
    x = resid.clone().requires_grad_(True)
    (inject_norm_matched(x, sites, vectors) * w).sum().backward()
    x64 = resid.double().requires_grad_(True)
    (loop_inject64(x64, sites, vectors) * w.double()).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4)


def test_no_sites_returns_resid_values():
    resid = torch.randn(2, 3, 4)
    out = inject_norm_matched(resid, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 4))
    assert torch.equal(out, resid)


def test_hand_worked_injection():
    # h = (3, 4), ||h|| = 5; v = (0, 0.1) -> h' = (3, 4 + 5) = (3, 9)
    resid = torch.zeros(1, 3, 2)
    resid[0, 1] = torch.tensor([3.0, 4.0])
    out = inject_norm_matched(resid, torch.tensor([[0, 1]]), torch.tensor([[0.0, 0.1]]))
    assert out[0, 1].tolist() == [3.0, 9.0]
    half = inject_norm_matched(resid, torch.tensor([[0, 1]]), torch.tensor([[0.0, 0.1]]), scale=0.5)
    assert half[0, 1].tolist() == [3.0, 6.5]


# ---------------------------------------------------------------- karvonen_inject


@FAST
@given(resid_with_sites())
def test_karvonen_equals_sites_then_inject(data):
    ids, resid, sites, vectors = data
    out = karvonen_inject(resid, ids, vectors, **IDS)
    assert torch.equal(out, inject_norm_matched(resid, sites, vectors))
    half = karvonen_inject(resid, ids, vectors, **IDS, scale=0.5)
    assert torch.equal(half, inject_norm_matched(resid, sites, vectors, scale=0.5))


def test_karvonen_ignores_markers_at_the_ends():
    # markers at 0 and S-1 (even with a matching neighbour on their one side) are not sites:
    # one vector for the single interior marker is the right count
    ids = torch.tensor([[MARKER, RIGHT, LEFT, MARKER, RIGHT, LEFT, MARKER]])
    resid = torch.randn(1, 7, 4)
    v = torch.randn(1, 4)
    out = karvonen_inject(resid, ids, v, **IDS)
    assert torch.equal(out[0, [0, 1, 2, 4, 5, 6]], resid[0, [0, 1, 2, 4, 5, 6]])
    assert not torch.equal(out[0, 3], resid[0, 3])
    with pytest.raises(ValueError):
        karvonen_inject(resid, ids, torch.randn(3, 4), **IDS)


@pytest.mark.parametrize("n_vectors", [0, 5])
def test_count_mismatch_names_both_counts(n_vectors):
    ids = torch.tensor([[LEFT, MARKER, RIGHT, 0], [0, LEFT, MARKER, RIGHT]])  # 2 sites
    with pytest.raises(ValueError) as ei:
        karvonen_inject(torch.randn(2, 4, 3), ids, torch.randn(n_vectors, 3), **IDS)
    msg = str(ei.value)
    assert "2" in msg and str(n_vectors) in msg


def test_karvonen_gradients_flow():
    ids = torch.tensor([[LEFT, MARKER, RIGHT, 0]])
    resid = torch.randn(1, 4, 3, requires_grad=True)
    karvonen_inject(resid, ids, torch.randn(1, 3), **IDS).sum().backward()
    assert resid.grad is not None and torch.isfinite(resid.grad).all()
    # the norm term makes the site's gradient differ from the identity's
    assert not torch.equal(resid.grad[0, 1], torch.ones(3))
    assert torch.equal(resid.grad[0, [0, 2, 3]], torch.ones(3, 3))


# ---------------------------------------------------------------- bad input


def test_vectors_d_mismatch_names_shapes():
    with pytest.raises(ValueError) as ei:
        inject_norm_matched(torch.randn(2, 5, 7), torch.tensor([[0, 1]]), torch.randn(1, 11))
    msg = str(ei.value)
    assert "7" in msg and "11" in msg
    ids = torch.tensor([[LEFT, MARKER, RIGHT, 0, 0]])
    with pytest.raises(ValueError) as ei:
        karvonen_inject(torch.randn(1, 5, 7), ids, torch.randn(1, 11), **IDS)
    assert "7" in str(ei.value) and "11" in str(ei.value)


def test_sites_vectors_count_mismatch_in_inject():
    with pytest.raises(ValueError):
        inject_norm_matched(torch.randn(2, 5, 4), torch.tensor([[0, 1], [1, 2]]), torch.randn(3, 4))


def test_other_bad_shapes():
    with pytest.raises(ValueError):
        inject_norm_matched(torch.randn(5, 4), torch.tensor([[0, 1]]), torch.randn(1, 4))  # resid not 3-D
    with pytest.raises(ValueError):
        inject_norm_matched(torch.randn(2, 5, 4), torch.tensor([0, 1]), torch.randn(1, 4))  # sites not [M,2]
    with pytest.raises(ValueError):
        inject_norm_matched(torch.randn(2, 5, 4), torch.tensor([[0.0, 1.0]]), torch.randn(1, 4))  # float sites
    with pytest.raises(ValueError):
        find_injection_sites(torch.zeros(5, dtype=torch.long), **IDS)  # not [B, S]
    with pytest.raises(ValueError):
        find_injection_sites(torch.zeros(2, 5), **IDS)  # float ids
    with pytest.raises(ValueError) as ei:
        karvonen_inject(torch.randn(2, 5, 4), torch.zeros(2, 6, dtype=torch.long), torch.randn(0, 4), **IDS)
    assert "6" in str(ei.value)


# ---------------------------------------------------------------- marker_well_formed


def well_formed_reference(ids):
    pos = [i for i, t in enumerate(ids) if t == MARKER]
    return len(pos) == 1 and 0 < pos[0] < len(ids) - 1 and ids[pos[0] - 1] == LEFT and ids[pos[0] + 1] == RIGHT


@pytest.mark.parametrize(
    "ids, ok",
    [
        ([LEFT, MARKER, RIGHT], True),
        ([1, 2, LEFT, MARKER, RIGHT, 9], True),
        ([], False),
        ([MARKER], False),
        ([MARKER, RIGHT], False),  # at the start
        ([LEFT, MARKER], False),  # at the end
        ([RIGHT, LEFT, MARKER], False),  # at the end, no wrap-around to the start
        ([MARKER, RIGHT, LEFT], False),  # at the start, no wrap-around to the end
        ([LEFT, MARKER, RIGHT, LEFT, MARKER, RIGHT], False),  # two markers
        ([0, MARKER, RIGHT], False),  # wrong left
        ([LEFT, MARKER, 0], False),  # wrong right
        ([1, 2, 3], False),  # none
    ],
)
def test_marker_well_formed_cases(ids, ok):
    assert marker_well_formed(ids, **IDS) is ok
    assert marker_well_formed(tuple(ids), **IDS) is ok


@FAST
@given(st.lists(st.sampled_from([0, LEFT, MARKER, RIGHT]), max_size=8))
def test_marker_well_formed_vs_reference(ids):
    assert marker_well_formed(ids, **IDS) is well_formed_reference(ids)
    # consistent with the site finder on a one-row batch
    if ids and marker_well_formed(ids, **IDS):
        assert find_injection_sites(torch.tensor([ids]), **IDS).shape[0] == 1


# ---------------------------------------------------------------- replace_at_sites (kitft's embedding replacement)

from nla_core import INJECTION_STYLES, replace_at_sites  # noqa: E402


def kitft_replace64(input_ids, embeds, vectors, norm):
    """kitft nla/injection.py inject_at_marked_positions after nla/schema.py normalize_activation, in float64:
    scan (row, position) in row-major order, skip the ends and wrong neighbours, overwrite the row."""
    out = embeds.double().clone()
    v = vectors.double()
    if norm is not None:
        v = v / (v.norm(dim=-1, keepdim=True).clamp_min(1e-12) / norm)
    k = 0
    for b, p in (input_ids == MARKER).nonzero().tolist():
        if p == 0 or p == input_ids.shape[1] - 1 or input_ids[b, p - 1] != LEFT or input_ids[b, p + 1] != RIGHT:
            continue
        out[b, p] = v[k]
        k += 1
    assert k == vectors.shape[0]
    return out


@FAST
@given(resid_with_sites(), st.sampled_from([None, 1.0, 150.0, 80000.0]))
def test_replace_equals_kitft_loop(data, norm):
    ids, embeds, sites, vectors = data
    out = replace_at_sites(embeds, find_injection_sites(ids, **IDS), vectors, norm=norm)
    torch.testing.assert_close(out.double(), kitft_replace64(ids, embeds, vectors, norm), rtol=1e-5, atol=1e-5 * (norm or 1))
    if sites.shape[0] and norm is not None:  # the injected rows have norm `norm` exactly (up to rounding)
        got = out[sites[:, 0], sites[:, 1]].double().norm(dim=-1)
        torch.testing.assert_close(got, torch.full_like(got, norm), rtol=1e-5, atol=0)


@FAST
@given(resid_with_sites(dtype=torch.bfloat16))
def test_replace_keeps_other_rows_bit_exact_and_rounds_once(data):
    ids, embeds, sites, vectors = data
    before = embeds.clone()
    out = replace_at_sites(embeds, sites, vectors, norm=2.0)
    assert out.dtype == torch.bfloat16 and torch.equal(embeds, before)
    mask = torch.ones(embeds.shape[:2], dtype=torch.bool)
    mask[sites[:, 0], sites[:, 1]] = False
    assert torch.equal(out[mask], embeds[mask])
    v32 = vectors / (vectors.norm(dim=-1, keepdim=True) / 2.0)
    assert torch.equal(out[sites[:, 0], sites[:, 1]], v32.to(torch.bfloat16))


def test_replace_does_not_depend_on_the_replaced_row_and_passes_gradient_elsewhere():
    embeds = torch.randn(1, 4, 3, requires_grad=True)
    out = replace_at_sites(embeds, torch.tensor([[0, 2]]), torch.tensor([[3.0, 0.0, 4.0]]), norm=10.0)
    torch.testing.assert_close(out[0, 2], torch.tensor([6.0, 0.0, 8.0]))
    out.sum().backward()
    assert embeds.grad[0, 2].abs().sum() == 0 and torch.equal(embeds.grad[0, [0, 1, 3]], torch.ones(3, 3))


@pytest.mark.parametrize("norm", [0.0, -1.0, float("inf"), float("nan")])
def test_replace_rejects_bad_norms(norm):
    with pytest.raises(ValueError, match="norm"):
        replace_at_sites(torch.zeros(1, 3, 2), torch.tensor([[0, 1]]), torch.ones(1, 2), norm=norm)


def test_replace_shape_errors_name_shapes():
    with pytest.raises(ValueError, match=r"\[M, D\] = \[1, 2\]"):
        replace_at_sites(torch.zeros(1, 3, 2), torch.tensor([[0, 1]]), torch.ones(2, 2), norm=None)


def test_style_names():
    assert INJECTION_STYLES == ("residual_add", "embedding_replace")
