"""PyTorch versions of V2 Triton kernels (see __init__)."""

from __future__ import annotations
