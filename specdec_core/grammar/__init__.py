"""Structured output: constraints on a request's output (`constraint.py`), compiled to grammars for a tokenizer
(`compiler.py`); each sequence's place in its grammar (`state.py`) and its packed masks (`bits.py`); the masks of a
round, applied to both p and q (`masks.py`, which says why that keeps speculative sampling exact)."""
