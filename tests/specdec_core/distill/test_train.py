"""The training loop: it moves the draft towards the target, and a run cut short and run again ends where an
uninterrupted run ends."""

from __future__ import annotations

import random

import pytest
import torch

from specdec_core.distill.data import completion_sequence, score
from specdec_core.distill.forward import use_causal_attention
from specdec_core.distill.lora import trainable
from specdec_core.distill.train import TrainConfig, batch_indices, batch_loss, checkpoint_step, train
from specdec_core.errors import InvalidArgument
from specdec_core.models.loader import load_model

CONFIG = TrainConfig(steps=8, batch_size=3, learning_rate=5e-3, warmup_steps=2, checkpoint_every=3, seed=1)


@pytest.fixture(scope="module")
def examples(tiny_dir):
    target = use_causal_attention(load_model(tiny_dir / "target", dtype="float32").model)
    rng = random.Random(0)
    sequences = [
        completion_sequence([rng.randrange(3, 384) for _ in range(6)], [rng.randrange(3, 384) for _ in range(10)])
        for _ in range(7)
    ]
    return score(target, sequences, top_k=16, shared_vocab=384)


def _module(tiny_dir, rank=4):
    return trainable(use_causal_attention(load_model(tiny_dir / "draft", dtype="float32").model), rank)


def _weights(module):
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def test_each_epoch_visits_every_example_once():
    seen = [i for step in range(4) for i in batch_indices(6, 3, step, seed=2)]  # 12 draws: two epochs of 6
    assert sorted(seen[:6]) == sorted(seen[6:]) == list(range(6))
    assert seen[:6] != seen[6:]  # a fresh order per epoch


def test_training_moves_the_draft_towards_the_target(tiny_dir, examples):
    module = _module(tiny_dir, rank=0)
    with torch.no_grad():
        before = float(batch_loss(module, examples, 384, 384))
    train(
        module,
        examples,
        TrainConfig(steps=30, batch_size=4, learning_rate=3e-3, warmup_steps=3),
        draft_rows=384,
        shared_vocab=384,
    )
    with torch.no_grad():
        after = float(batch_loss(module, examples, 384, 384))
    assert after < 0.8 * before


class Interrupted(Exception):
    pass


def test_an_interrupted_run_resumed_ends_as_an_uninterrupted_one(tiny_dir, examples, tmp_path):
    whole = _module(tiny_dir)
    train(whole, examples, CONFIG, draft_rows=384, shared_vocab=384, checkpoint=tmp_path / "a.pt")

    def stop_at_5(step, loss):
        if step == 5:
            raise Interrupted  # after step 5, whose weights no checkpoint holds (the last was at step 3)

    cut = _module(tiny_dir)
    with pytest.raises(Interrupted):
        train(cut, examples, CONFIG, draft_rows=384, shared_vocab=384, checkpoint=tmp_path / "b.pt", on_step=stop_at_5)
    assert checkpoint_step(tmp_path / "b.pt") == 3 and checkpoint_step(tmp_path / "none.pt") == 0
    resumed = _module(tiny_dir)  # a new process: fresh adapters, as a rerun of the command has
    result = train(resumed, examples, CONFIG, draft_rows=384, shared_vocab=384, checkpoint=tmp_path / "b.pt")
    assert result.resumed_from == 3 and len(result.losses) == 5
    expected, got = _weights(whole), _weights(resumed)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n], got[n]) for n in expected)
    assert not all(torch.equal(expected[n], _weights(_module(tiny_dir))[n]) for n in expected)  # it did train


def test_a_checkpoint_of_another_run_is_refused(tiny_dir, examples, tmp_path):
    train(_module(tiny_dir), examples, CONFIG, draft_rows=384, shared_vocab=384, checkpoint=tmp_path / "c.pt")
    other = TrainConfig(**{**CONFIG.__dict__, "learning_rate": 1e-2})
    with pytest.raises(InvalidArgument, match="another run"):
        train(_module(tiny_dir), examples, other, draft_rows=384, shared_vocab=384, checkpoint=tmp_path / "c.pt")
