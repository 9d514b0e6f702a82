"""What the patch tool's and the rebase script's tests build patches from."""

# A patch file's header as the series requires it (patches/series), for a test's patch.
HEADER = """From: test <test@example.com>
Subject: [PATCH] {subject}

Why: a test needs it
Upstream-Status: not upstreamable: test
Drop-When: never
---
"""
