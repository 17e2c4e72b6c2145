"""Integrations of cpattn with model libraries. Each submodule imports its library lazily: cpattn
itself never needs them (`import cpattn.integrations.transformers` needs transformers)."""
