"""Engram: the hash plan against an independent reference and committed goldens, the layer
and every gradient against a plain-module formulation, ShortConv streaming, the graft seam
(zero-init graft == bare model, torch path and native step), the file, bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engram_reference import GOLDEN, golden_case, golden_values, ref_hash, ref_multipliers, ref_primes
from fucina.models.engram.plan import EngramError, HashPlan, head_sizes


def _plan(case, **kw):
    return HashPlan(n_vocab=case["n_vocab"], layer_ids=case["layer_ids"], max_ngram=case["max_ngram"],
                    n_head=case["n_head"], vocab_per_ngram=case["vocab_per_ngram"], pad_id=case["pad_id"],
                    seed=case["seed"], lookup=case["lookup"], **kw)


def test_hash_matches_reference_goldens():
    g = json.loads(GOLDEN.read_text())
    case = golden_case()
    assert g["case"]["ids"] == case["ids"].tolist()      # the golden's input is the case's
    primes, mults, rows = golden_values(case)            # the independent formulation == its goldens
    for lid in case["layer_ids"]:
        assert primes[lid] == g["primes"][str(lid)]
        assert mults[lid].tolist() == g["multipliers"][str(lid)]
        assert rows[lid].tolist() == g["rows"][str(lid)]
    plan = _plan(case)
    for i, lid in enumerate(case["layer_ids"]):
        assert plan.sizes[i] == g["primes"][str(lid)]
        assert plan.multipliers[i].tolist() == g["multipliers"][str(lid)]
        want = np.array(g["rows"][str(lid)])
        for b in range(case["ids"].shape[0]):
            got = plan.rows(lid, plan.compress(case["ids"][b]))
            assert (got - plan.offsets[i]).tolist() == want[b].tolist()
            assert (got < plan.table_rows[i]).all() and (got >= 0).all()


def test_hash_wraps_and_streams():
    """Wrapping int64 products (odd multipliers near the int64 range), and rows of a
    sequence hashed in pieces with their history == hashed whole."""
    rng = np.random.default_rng(0)
    mult = (rng.integers(1 << 60, (1 << 62), size=(1, 4)) | 1).astype(np.int64)
    plan = HashPlan(n_vocab=1000, layer_ids=[0], max_ngram=4, n_head=2, vocab_per_ngram=[101, 103, 107],
                    pad_id=3, multipliers=mult)
    ids = rng.integers(0, 1000, size=40)
    whole = plan.rows(0, ids)
    primes = [plan.sizes[0][o] for o in range(3)]
    ref = ref_hash(ids[None], mult[0], primes, 4, 3)[0]
    assert (whole - plan.offsets[0]).tolist() == ref.tolist()
    for cut in (1, 2, 3, 17, 39):
        parts = np.concatenate([plan.rows(0, ids[:cut]), plan.rows(0, ids[cut:], prev=ids[:cut])])
        assert parts.tolist() == whole.tolist()


def test_prime_chain_is_global_and_capacity_one():
    sizes = head_sizes([0, 5], [10, 10], 2)
    assert sizes == list(ref_primes([0, 5], [10, 10], 2).values()) == [[[11, 13], [17, 19]], [[23, 29], [31, 37]]]
    assert head_sizes([2], [1, 1], 3) == [[[1, 1, 1], [1, 1, 1]]]
    p = HashPlan(n_vocab=50, layer_ids=[2], vocab_per_ngram=[1, 1], n_head=3)
    rows = p.rows(2, np.arange(10))
    assert rows.tolist() == [list(range(6))] * 10     # one row per head: the offsets only


def test_multipliers_drawn_as_the_reference_or_given():
    p = HashPlan(n_vocab=500, layer_ids=[3, 9], seed=4)
    ref = ref_multipliers([3, 9], 3, 500, 4)
    assert p.multipliers.tolist() == [ref[3].tolist(), ref[9].tolist()]
    q = HashPlan(n_vocab=500, layer_ids=[3, 9], seed=99, multipliers=p.multipliers)
    assert (q.rows(9, np.arange(20)) == p.rows(9, np.arange(20))).all()


def test_plan_bad_input():
    with pytest.raises(EngramError, match="out of range"):
        HashPlan(n_vocab=10, layer_ids=[0]).compress(np.array([3, 10]))
    with pytest.raises(EngramError, match="odd"):
        HashPlan(n_vocab=10, layer_ids=[0], multipliers=np.array([[2, 3, 5]]))
    with pytest.raises(EngramError, match="table size"):
        HashPlan(n_vocab=10, layer_ids=[0], vocab_per_ngram=[5])
    with pytest.raises(EngramError, match="carries no memory"):
        HashPlan(n_vocab=10, layer_ids=[0]).rows(1, np.arange(3))
    with pytest.raises(EngramError, match="compression"):
        HashPlan(n_vocab=10, layer_ids=[0], lookup=np.arange(9))
