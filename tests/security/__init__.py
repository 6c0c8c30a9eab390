"""Tier 2 (root): attacks on the agent and on the sandboxes, each written as a test first.

Every module here reproduces one attack of a red-team review against the real agent (a
subprocess), real sandboxes and real cgroups, and checks what must hold instead.
"""
