"""Runs a function on W real ranks (cpattn.testing.distributed), by the name the tests import."""

from cpattn.testing.distributed import run_ranks  # noqa: F401
