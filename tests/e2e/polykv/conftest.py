"""The operator fixtures (defined beside the first operator tests) for every test here."""

from .test_operator import operator, operator_kubeconfig

__all__ = ["operator", "operator_kubeconfig"]
