"""Pipelines of weak peers: stages, subspace-compressed boundaries, the 1F1B schedule and its transport."""
