"""Shared builders and rigs: tiny checkpoints, transformers oracles, peer processes, cluster and front-end rigs."""
