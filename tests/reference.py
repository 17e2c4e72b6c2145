"""The float64 reference (cpattn.testing.reference), by the name the tests import it under."""

from cpattn.testing.reference import Window, reference_attention, visible_mask  # noqa: F401
