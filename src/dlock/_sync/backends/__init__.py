# DO NOT EDIT: generated from src/dlock/_async/backends/__init__.py by scripts/unasync.py.
