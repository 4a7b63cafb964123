"""Numerics suites of the Kimi K3 subjects: per-op grid cells whose oracles are k3_decode.reference."""
