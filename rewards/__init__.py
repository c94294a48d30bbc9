"""Reward-function plugins: registry, built-ins and a process-pool runner (see docs/rewards.md)."""
