"""Writes the file named by argv[1] when it runs (tests check that it never ran)."""
import pathlib
import sys

pathlib.Path(sys.argv[1]).write_text("ran")
