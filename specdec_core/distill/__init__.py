"""Distillation of a draft towards its target: the target's top-k next-token distributions at chosen positions
(`data`), a KL loss against them (`loss`), LoRA or full fine-tuning (`lora`), a resumable training loop (`train`),
and the trained draft written as a model directory the loader reads (`save`).

Notation as everywhere in specdec: p is the target's distribution, q the draft's.
"""
