"""Rollout engines: SGLang in production, an embedded torch engine for CPU runs and tests."""
