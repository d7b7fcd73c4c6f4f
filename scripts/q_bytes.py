"""What the draft's q costs the router per sampled row per round, with q dense in the router (before) and kept
sparse (now): the bytes it holds and creates, and what it sends on to the target worker. docs/benchmarks.md,
"The draft's q on the wire", quotes its output.

The round: k drafts, each position's q holding the draft model's `Q_SUPPORT` most likely ids (the drafter's own
cut, from random logits over the vocabulary). The router decodes the draft worker's Proposal and encodes the
target worker's VerifyRequest. Before this change decode made q a dense float32 [k, V] tensor and encode scanned it
for its nonzeros (`_dense_round_trip` below restates that code); now q stays a `SparseQ` throughout.

Usage: .venv/bin/python scripts/q_bytes.py [--vocab-size 151936] [--k 8] [--support 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from deployments import codec
from specdec.v1 import worker_pb2 as wpb
from specdec_core.config import TokenShaping
from specdec_core.drafters.base import Proposal
from specdec_core.drafters.draft_model import Q_SUPPORT, _truncate
from specdec_core.sparse_q import SparseQ
from specdec_core.target import VerifyItem


def _dense_round_trip(msg: wpb.Proposal, vocab_size: int) -> tuple[torch.Tensor, list[wpb.SparseDistribution]]:
    """The router's q before this change: decoded into [k, V] float32, re-encoded by a nonzero scan per row."""
    q = torch.zeros(len(msg.q), vocab_size, dtype=torch.float32)  # [k, V]
    for i, row in enumerate(msg.q):
        q[i, torch.tensor(list(row.token_ids), dtype=torch.long)] = torch.tensor(list(row.probs))
    rows = []
    for row in q:
        ids = torch.nonzero(row).squeeze(-1)  # [nnz]
        rows.append(wpb.SparseDistribution(token_ids=ids.tolist(), probs=row[ids].tolist()))
    return q, rows


def _sparse_round_trip(msg: wpb.Proposal, vocab_size: int) -> tuple[SparseQ, list[wpb.SparseDistribution]]:
    q = codec.decode_proposal(msg, vocab_size, return_probs=False).q
    return q, codec.encode_distributions(q)


def _seconds(fn, *args, repeat: int = 20) -> float:
    """The best of `repeat` calls: indicative only (the machine is shared)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.element_size() * t.nelement() for t in tensors)


def measure(vocab_size: int, k: int, support: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    q = _truncate(torch.softmax(torch.randn(k, vocab_size, generator=gen), dim=-1), support)  # SparseQ [k, n]
    drafts = q.token_ids[:, 0].tolist()
    proposal = codec.encode_proposal(Proposal(drafts, q))  # what the draft worker sends
    dense, dense_rows = _dense_round_trip(proposal, vocab_size)
    sparse, sparse_rows = _sparse_round_trip(proposal, vocab_size)
    assert dense_rows == sparse_rows and torch.equal(dense, sparse.dense(vocab_size))  # the same q, the same bytes
    item = VerifyItem("0123abcd-0123456789abcdef", 1234, drafts, sparse, TokenShaping(temperature=0.8, top_p=0.95),
                      torch.rand(k, generator=gen, dtype=torch.float64), 0.5)
    verify = codec.encode_verify([item])
    q_message = sum(row.ByteSize() for row in sparse_rows)
    return {
        "vocab_size": vocab_size, "k": k, "ids_per_position": support,
        "proposal_message_bytes": proposal.ByteSize(),
        "before": {"q_tensor_bytes": _nbytes(dense), "q_message_bytes": q_message,
                   "router_seconds": _seconds(_dense_round_trip, proposal, vocab_size)},
        "after": {"q_tensor_bytes": _nbytes(sparse.token_ids, sparse.probs), "q_message_bytes": q_message,
                  "router_seconds": _seconds(_sparse_round_trip, proposal, vocab_size)},
        "verify_request_bytes": verify.ByteSize(),
        "verify_request_q_bytes": sum(row.ByteSize() for row in verify.items[0].q),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=151_936)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--support", type=int, default=Q_SUPPORT)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = measure(args.vocab_size, args.k, args.support)
    print(f"V = {result['vocab_size']}, k = {result['k']}, {result['ids_per_position']} ids per position; "
          f"per sampled row per round, in the router:")
    for when in ("before", "after"):
        r = result[when]
        print(f"  {when:6}  q tensors {r['q_tensor_bytes']:>9,} B   q re-encoded {r['q_message_bytes']:>6,} B   "
              f"decode + encode {r['router_seconds'] * 1e3:6.2f} ms")
    print(f"  Proposal message {result['proposal_message_bytes']:,} B; VerifyRequest (one row) "
          f"{result['verify_request_bytes']:,} B, of which q {result['verify_request_q_bytes']:,} B")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
