"""Tandem's tests: `pytest` from the repo root runs them all, `pytest tests/engine` one part."""
