"""DPO and its family, offline and online, in one place.

pairs.py      rows (text or chat, multi-turn prompts) -> `Pair`s -> the `PairBatch` the losses read
data.py       pairs as a resumable Grain pipeline, the held-out pairs
objective.py  the preference loss over a `PairBatch` (`posttrain.losses.preference`), its metrics, the reference
offline.py    offline DPO: a `core.method.Method` (`DPO`), the reference live or precomputed
online.py     online DPO: a method of the on-policy run, best / worst pairs of the policy's samples
"""
