# DO NOT EDIT: generated from tests/conformance/_async/__init__.py by scripts/unasync.py.
