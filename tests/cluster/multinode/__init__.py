"""Placement across the Ray nodes of one machine: tests sharing one fake multi-node Ray cluster (conftest.py)."""
