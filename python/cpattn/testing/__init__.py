"""Helpers for cpattn's tests, benchmarks and demos (not part of the attention API): the float64
reference attention and the spawned-ranks harness."""
