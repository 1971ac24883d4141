"""The trace contract both sides share: schema version, file naming, the JSON Lines writer, the
in-flight slot, compact rank lists and the source conditions recorded with call sites.

Imports nothing else of ddpdoctor (see the import-linter contract in pyproject.toml).
"""
