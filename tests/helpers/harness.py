"""The tests' short name for distopt.testing: forked gloo ranks, shared with the benchmarks."""

from distopt.testing import DEFAULT_TIMEOUT_S, Outcome, hsdp_groups, run_ranks, run_ranks_outcomes

__all__ = ["DEFAULT_TIMEOUT_S", "Outcome", "hsdp_groups", "run_ranks", "run_ranks_outcomes"]
