"""The command line's demos (`python -m cpattn demo`, `generate-demo`), imported by nothing else
of the library."""
