"""Pure loss functions of per-token log-probs, one module per family: `policy` (GRPO / GSPO and their variants),
`kl` (the KL estimators). Each upcasts to float32, takes explicit masks and returns sums in the `core.train`
contract; each has a test against an independent NumPy reference (tests/test_grpo_losses.py)."""
