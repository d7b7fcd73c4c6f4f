"""SparseQ: the draft's q as (id, probability) pairs, made dense only for the sampler."""

from __future__ import annotations

import pytest
import torch

from specdec_core.errors import InvalidArgument
from specdec_core.sparse_q import SparseQ


def test_dense_puts_each_probability_at_its_id_and_padding_nowhere():
    q = SparseQ(torch.tensor([[1, 3, 0], [0, 2, 4]]), torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.25, 0.25]]))
    expected = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0], [0.5, 0.0, 0.25, 0.0, 0.25]])  # [k, V]
    assert torch.equal(q.dense(5), expected)  # the padding's id 0 adds nothing to row 0
    assert len(q) == 2 and torch.equal(q.prefix(1).dense(5), expected[:1])


def test_from_dense_keeps_the_nonzeros_ascending_and_round_trips():
    dense = torch.tensor([[0.0, 0.6, 0.0, 0.4], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0]])  # [3, 4]
    q = SparseQ.from_dense(dense)
    assert q.token_ids.shape == (3, 4)  # the widest row
    assert q.token_ids[0, :2].tolist() == [1, 3] and q.probs[0, 2:].tolist() == [0.0, 0.0]
    assert torch.equal(q.dense(4), dense)


def test_from_rows_pads_short_rows_with_probability_zero():
    q = SparseQ.from_rows([torch.tensor([7, 9]), torch.tensor([3])], [torch.tensor([0.5, 0.5]), torch.tensor([1.0])])
    assert q.token_ids.shape == q.probs.shape == (2, 2)
    assert q.probs[1].tolist() == [1.0, 0.0]
    assert q.dense(10)[1, 3] == 1.0 and q.dense(10).sum().item() == 2.0


@pytest.mark.parametrize("ids_shape, probs_shape", [((2, 3), (2, 2)), ((3,), (3,))])
def test_shapes_must_agree(ids_shape, probs_shape):
    with pytest.raises(InvalidArgument) as err:
        SparseQ(torch.zeros(ids_shape, dtype=torch.long), torch.zeros(probs_shape))
    assert err.value.field == "q"
