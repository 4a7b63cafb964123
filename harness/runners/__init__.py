"""Runners: what drives a subject from outside the gate's process (a vLLM server, lm-eval, request cells)."""
