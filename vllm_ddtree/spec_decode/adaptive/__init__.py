"""Adaptive trees: each step verifies, per request, the prefix of its tree (in build order)
that maximizes expected accepted tokens per second of step time, and drafting pauses when
no draft pays (sizing.py). Costs are measured (costs.py), acceptance is calibrated against
the target's verdicts (calibration.py)."""
