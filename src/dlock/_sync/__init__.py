# DO NOT EDIT: generated from src/dlock/_async/__init__.py by scripts/unasync.py.
