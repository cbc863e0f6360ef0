"""Integrations of sparse-mla into model libraries (DESIGN §6): :mod:`sparse_mla.integrations.transformers`."""
