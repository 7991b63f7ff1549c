"""Benchmarks behind `pdmesh bench ...`: each compares two things measured side by side in one
run."""
